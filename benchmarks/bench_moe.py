"""Routed experts on a GPU: the Triton `fused_experts` against PyTorch baselines.

For DeepSeek-V2-Lite's experts (64, top 6, H 2048, I 1408) and DeepSeek-V3's (256, top 8,
H 7168, I 2048) at token counts from decode to prefill, random routing (each token's k
experts distinct) and bf16 weights, in one process:

* fused: `ops.triton.fused_experts`, replayed from a CUDA graph (GPU time);
* grouped: the reference op (pairs sorted by expert, one matmul per expert that got
  tokens; reads the expert counts on the host), eager;
* dense: every expert on every token, weighted by its routing weight (0 if not chosen):
  the form without host syncs that a CUDA graph can hold without a fused op; graphed.

Bytes: the weights of the experts the routing touches, plus x and the output; FLOPs:
2 * T * k * 3 * H * I. Rates are compared with the card's HBM read rate and bf16 matmul
rate, measured in the same run (`benchmarks.harness.ceilings`).

    python -m benchmarks.bench_moe --out moe.json
    python -m benchmarks.bench_moe --sweep --out moe_sweep.json  # launch configs
    python -m benchmarks.bench_moe --fp8 --out moe_fp8.json
    python -m benchmarks.bench_moe --fp8 --sweep --out moe_fp8_sweep.json

`--sweep` times `MoEConfig` variants (block_m, block_n, block_k, warps, stages) at a few
of these shapes instead, the search behind `ops.triton.moe.pick_config`.

`--fp8`: block-fp8 experts (128 x 128 blocks, the bf16 weights quantized) against the
same experts in bf16, both `ops.triton.fused_experts` replayed from CUDA graphs, at
DeepSeek-V3's widths for T = 1 to 8192: all 256 experts on one GPU, and a TP 8 rank's
32 (routing over 256, so about 1/8 of the pairs are local). Bytes: the touched experts'
weights (and fp8 scales) plus x and the output; FLOPs count local pairs. With
`--sweep`, the fp8 launch configs (block_k = 128) at the TP 8 share.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from benchmarks.harness import bench, ceilings, graphed
from pagedmla.ops import reference
from pagedmla.ops.block_fp8 import E4M3_MAX, FP8_WEIGHT_DTYPE
from pagedmla.ops.triton import fused_experts
from pagedmla.ops.triton.moe import MoEConfig, pick_config

SHAPES = {  # name: (E, k, H, I, token counts)
    "V2-Lite": (64, 6, 2048, 1408, (1, 16, 128, 512, 4096)),
    "V3": (256, 8, 7168, 2048, (16, 128, 1024)),
}


def dense_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert on every token, scaled by its routing weight: no host sync."""
    E = w13.shape[0]
    dense = torch.zeros(x.shape[0], E + 1, dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids.clamp(max=E), weights.float())
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(E):
        gate, up = torch.nn.functional.linear(x, w13[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out += y.float() * dense[:, e, None]
    return out.to(x.dtype)


def _experts(E: int, H: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 w13 [E, 2I, H] and w2 [E, H, I], drawn on the GPU."""
    w13 = (torch.randn(E, 2 * inter, H, device="cuda") / H**0.5).bfloat16()
    return w13, (torch.randn(E, H, inter, device="cuda") / inter**0.5).bfloat16()


def _tokens(T: int, E: int, k: int, H: int, gen: torch.Generator):
    """x [T, H] bf16, routing weights [T, k] and ids [T, k] (each token's experts distinct)."""
    x = torch.randn(T, H, generator=gen).bfloat16().cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).cuda()
    return x, torch.rand(T, k, generator=gen).cuda(), ids


def sweep(out: str) -> None:
    """Time launch configs at V2-Lite 16 / 128 / 4096 tokens and V3 128 tokens."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, token_counts in (("V2-Lite", (16, 128, 4096)), ("V3", (128,))):
        E, k, H, inter, _ = SHAPES[name]
        w13, w2 = _experts(E, H, inter)
        for T in token_counts:
            x, weights, ids = _tokens(T, E, k, H, gen)
            _sweep_one(name, (x, w13, w2, weights, ids), rows)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "sweep": rows}, f, indent=1)


def _sweep_one(name: str, args_: tuple, rows: list[dict], fp8: bool = False) -> None:
    """Time the sweep's grid of configs on one input (x, w13, w2, weights, ids, and for
    block-fp8 experts their scales and block size); print the default's time and the
    best."""
    T, k = args_[4].shape
    E = args_[1].shape[0]
    if fp8:  # block_k is the weights' bk; the gate_up kernel's column tile too
        block_ms = (32, 64) if T >= 128 else (16, 32)
        grid = itertools.product(block_ms, (64, 128), (128,), (4, 8), (3, 4, 5))
    else:
        block_ms = (64, 128) if T >= 1024 else (16, 32)
        grid = itertools.product(block_ms, (64, 128), (64, 128), (4, 8), (3, 4))
    timed = []
    for bm, bn, bk, warps, stages in grid:
        config = MoEConfig(bm, bn, bk, warps, stages)
        try:
            us = bench(graphed(lambda c=config, a=args_: fused_experts(*a, config=c)),
                       rep_ms=30)
        except triton.runtime.errors.OutOfResources:
            continue  # does not fit in shared memory
        timed.append((us, config))
        rows.append({"shape": name, "T": T, "fp8": fp8, "config": vars(config), "us": us})
    us = bench(graphed(lambda a=args_: fused_experts(*a)), rep_ms=30)
    best_us, best = min(timed, key=lambda item: item[0])
    default = pick_config(T * k, E, group=128 if fp8 else None)
    print(f"{name}{' fp8' if fp8 else ''} T={T}: default {default} {us:.1f} µs; best {best} "
          f"{best_us:.1f} µs", flush=True)


FP8_SHAPES = {  # name: (experts routed over, experts held, k, H, I)
    "V3": (256, 256, 8, 7168, 2048),
    "V3 TP8 share": (256, 32, 8, 7168, 2048),
}
FP8_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
BLOCK = (128, 128)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked weights [E, N, K] -> (e4m3 [E, N, K], float32 scales [E, N / 128, K / 128]):
    one amax / 448 scale per 128 x 128 block (N and K multiples of 128), expert by expert."""
    E, N, K = w.shape
    bn, bk = BLOCK
    q = torch.empty(E, N, K, dtype=FP8_WEIGHT_DTYPE, device=w.device)
    scales = torch.empty(E, N // bn, K // bk, dtype=torch.float32, device=w.device)
    for e in range(E):
        blocks = w[e].float().view(N // bn, bn, K // bk, bk)
        s = blocks.abs().amax(dim=(1, 3), keepdim=True) / E4M3_MAX
        q[e] = (blocks / torch.where(s == 0, 1.0, s)).to(FP8_WEIGHT_DTYPE).view(N, K)
        scales[e] = s.view(N // bn, K // bk)
    return q, scales


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """bf16 experts as block-fp8: (w13, w2, w13_scale_inv [E, 2, I / 128, H / 128],
    w2_scale_inv)."""
    E, two_i, H = w13.shape
    q13, s13 = quantize_blocks(w13)
    q2, s2 = quantize_blocks(w2)
    return q13, q2, s13.view(E, 2, two_i // 2 // BLOCK[0], H // BLOCK[1]), s2


def sweep_fp8(out: str) -> None:
    """Time fp8 launch configs at the TP 8 share, T = 8, 128, 2048."""
    gen = torch.Generator().manual_seed(0)
    routed, E, k, H, inter = FP8_SHAPES["V3 TP8 share"]
    q13, q2, s13, s2 = fp8_experts(*_experts(E, H, inter))
    rows: list[dict] = []
    for T in (8, 128, 2048):
        x, weights, ids = _tokens(T, routed, k, H, gen)
        _sweep_one("V3 TP8 share", (x, q13, q2, weights, ids, s13, s2, BLOCK), rows, fp8=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "sweep": rows}, f, indent=1)


def main_fp8(out: str) -> None:
    """fp8 against bf16 experts, both fused and graphed; JSON rows, a table last."""
    ceil = ceilings()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (routed, E, k, H, inter) in FP8_SHAPES.items():
        w13, w2 = _experts(E, H, inter)
        q13, q2, s13, s2 = fp8_experts(w13, w2)
        for T in FP8_TOKENS:
            x, weights, ids = _tokens(T, routed, k, H, gen)
            bf16_args = (x, w13, w2, weights, ids)
            fp8_args = (x, q13, q2, weights, ids, s13, s2, BLOCK)
            want = reference.fused_experts(*fp8_args).float()
            got = fused_experts(*fp8_args).float()
            # Against the reference's dequantized weights: the kernels round x and the
            # intermediate to e4m3 (2^-4 relative each; ~4% relative L2 together).
            rel = float((got - want).norm() / want.norm())
            if rel > 0.1:
                raise SystemExit(f"{name} T={T}: fp8 relative error {rel:.2e} against the "
                                 "reference")
            local = ids[ids < E]
            touched = int(local.unique().numel())
            scale_bytes = touched * (s13[0].numel() + s2[0].numel()) * 4
            act_bytes = 2 * T * H * 2
            flops = 2 * local.numel() * 3 * H * inter
            row = {"shape": name, "E": E, "routed": routed, "k": k, "H": H, "I": inter, "T": T,
                   "rel_err": rel, "experts_touched": touched, "flops": flops,
                   "fp8_bytes": touched * 3 * H * inter + scale_bytes + act_bytes,
                   "bf16_bytes": touched * 3 * H * inter * 2 + act_bytes,
                   "fp8_us": bench(graphed(lambda a=fp8_args: fused_experts(*a))),
                   "bf16_us": bench(graphed(lambda a=bf16_args: fused_experts(*a)))}
            for kind in ("fp8", "bf16"):
                row[f"{kind}_tbps"] = row[f"{kind}_bytes"] / row[f"{kind}_us"] / 1e6
                row[f"{kind}_tflops"] = flops / row[f"{kind}_us"] / 1e6
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            rows.append(row)
            print(row, flush=True)
        del w13, w2, q13, q2, s13, s2
        torch.cuda.empty_cache()
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "results": rows}, f,
                  indent=1)
    read = ceil["hbm_read_tbps"]
    print(f"\nceilings: HBM read {read:.2f} TB/s, bf16 matmul "
          f"{ceil['bf16_matmul_tflops']:.0f} TFLOP/s")
    print("| experts | T | fp8 µs | TB/s (% read) | TFLOP/s | bf16 µs | TB/s (% read) "
          "| TFLOP/s | fp8 speedup |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['T']} | {r['fp8_us']:.1f} | {r['fp8_tbps']:.2f} "
              f"({100 * r['fp8_tbps'] / read:.0f}%) | {r['fp8_tflops']:.0f} "
              f"| {r['bf16_us']:.1f} | {r['bf16_tbps']:.2f} ({100 * r['bf16_tbps'] / read:.0f}%) "
              f"| {r['bf16_tflops']:.0f} | {r['speedup']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="moe.json")
    parser.add_argument("--sweep", action="store_true", help="time launch configs instead")
    parser.add_argument("--fp8", action="store_true",
                        help="block-fp8 experts against bf16 ones (DeepSeek-V3 widths)")
    args = parser.parse_args()
    if args.sweep:
        (sweep_fp8 if args.fp8 else sweep)(args.out)
        return
    if args.fp8:
        main_fp8(args.out)
        return
    ceil = ceilings()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for name, (E, k, H, inter, token_counts) in SHAPES.items():
        w13, w2 = _experts(E, H, inter)
        for T in token_counts:
            x, weights, ids = _tokens(T, E, k, H, gen)
            args_ = (x, w13, w2, weights, ids)
            want = reference.fused_experts(*args_).float()
            got = fused_experts(*args_).float()
            rel = float((got - want).norm() / want.norm())
            if rel > 1e-2:
                raise SystemExit(f"{name} T={T}: relative error {rel:.2e} against the reference")
            touched = int(ids.unique().numel())
            nbytes = touched * 3 * H * inter * 2 + 2 * T * H * 2
            flops = 2 * T * k * 3 * H * inter
            row = {"shape": name, "E": E, "k": k, "H": H, "I": inter, "T": T, "rel_err": rel,
                   "experts_touched": touched, "bytes": nbytes, "flops": flops,
                   "fused_us": bench(graphed(lambda a=args_: fused_experts(*a))),
                   "grouped_us": bench(lambda a=args_: reference.fused_experts(*a))}
            if E * T <= 64 * 512:  # every expert on every token: too slow beyond
                row["dense_us"] = bench(graphed(lambda a=args_: dense_experts(*a)))
            row["tbps"] = nbytes / row["fused_us"] / 1e6
            row["tflops"] = flops / row["fused_us"] / 1e6
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "results": rows}, f,
                  indent=1)
    print(f"\nceilings: HBM read {ceil['hbm_read_tbps']:.2f} TB/s, bf16 matmul "
          f"{ceil['bf16_matmul_tflops']:.0f} TFLOP/s")
    print("| experts | T | fused µs | TB/s (% read) | TFLOP/s | grouped µs | dense µs "
          "| vs grouped | vs dense |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        dense = f"{r['dense_us']:.0f}" if "dense_us" in r else ""
        vs_dense = f"{r['dense_us'] / r['fused_us']:.1f}x" if "dense_us" in r else ""
        print(f"| {r['shape']} | {r['T']} | {r['fused_us']:.1f} | {r['tbps']:.2f} "
              f"({100 * r['tbps'] / ceil['hbm_read_tbps']:.0f}%) | {r['tflops']:.0f} "
              f"| {r['grouped_us']:.0f} | {dense} | {r['grouped_us'] / r['fused_us']:.1f}x "
              f"| {vs_dense} |")


if __name__ == "__main__":
    main()
