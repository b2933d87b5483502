"""Block-scaled fp8 linear layers on a GPU: `ops.triton.fp8_linear` against bf16
`torch.matmul` and `torch._scaled_mm` at DeepSeek-V3's shapes (tensor parallel 1).

For each linear (N, K) and token count M, in one process:

* ours: `fp8_linear` on bf16 x (x quantized per token and 128-group inside, 128 x 128
  weight blocks);
* bf16: x @ W.T with W in bf16 (`torch.matmul`);
* scaled_mm: `torch._scaled_mm` of e4m3 x and W (W column-major), per-tensor float32
  scales, bf16 out: the library's fp8 GEMM, x quantized beforehand (not timed).

Each is timed as a CUDA graph that calls it on one weight copy after another, enough
copies to exceed the L2 cache three times over, so that no call finds its weight in
L2 (`harness.bench` of the replay, divided by the copies). Rates: the fp8 weight's
bytes per second against the card's HBM read rate (`harness.ceilings`, same run), and
TFLOP/s (2 M N K) against both baselines. The issue's targets, judged per row: M <= 64
reads the weight at >= 85% of the HBM read rate; M >= 2048 reaches >= 1.6x bf16 and
>= 0.9x scaled_mm. Each result is checked against the quantized x times the
dequantized W in float32 first.

    python -m benchmarks.bench_fp8_gemm --out fp8_gemm.json
    python -m benchmarks.bench_fp8_gemm --quick                  # fewer shapes and M
    python -m benchmarks.bench_fp8_gemm --sweep --out sweep.json # launch configs
    python -m benchmarks.bench_fp8_gemm --sweep --shapes q_a kv_a --m 1 16

`--sweep` times `Fp8GemmConfig` variants (`candidate_configs`) per (shape, M) instead:
the search behind `ops.triton.fp8_gemm.pick_config`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.harness import DEV, bench, ceilings, graphed
from pagedmla.ops.block_fp8 import dequantize_blocks, quantize_activations, scale_grid
from pagedmla.ops.triton._utils import l2_cache_bytes, multiprocessor_count
from pagedmla.ops.triton.fp8_gemm import Fp8GemmConfig, fp8_linear, pick_config

SHAPES = {  # name: (N, K), DeepSeek-V3 at tensor parallel 1
    "q_a": (1536, 7168),
    "kv_a": (576, 7168),
    "q_b": (24576, 1536),
    "o_proj": (7168, 16384),
    "mlp_gate_up": (36864, 7168),
    "mlp_down": (7168, 18432),
    "expert_gate_up": (4096, 7168),
    "expert_down": (7168, 2048),
}
TOKENS = (1, 16, 64, 256, 2048, 8192)
QUICK_SHAPES = ("q_a", "kv_a", "o_proj", "mlp_gate_up")
QUICK_TOKENS = (1, 64, 2048)
BLOCK = (128, 128)
READ_TARGET, BF16_TARGET, SCALED_MM_TARGET = 0.85, 1.6, 0.9


def weights(N: int, K: int, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` random fp8 weights [N, K] (codes over e4m3's range) with their scales."""
    out = []
    for _ in range(copies):
        w = (torch.randn(N, K, device=DEV) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
        out.append((w, torch.rand(scale_grid((N, K), BLOCK), device=DEV) * 1e-3 + 1e-4))
    return out


def copies_for(nbytes: int) -> int:
    """Weight copies whose bytes exceed three times the L2 cache."""
    return max(1, math.ceil(3 * l2_cache_bytes(torch.device(DEV)) / nbytes))


def rotated_us(calls: list[Callable[[], object]], rep_ms: int = 100) -> float:
    """Microseconds per call of a CUDA graph running calls back to back (replays timed
    by `harness.bench`)."""
    return bench(graphed(lambda: [call() for call in calls]), rep_ms=rep_ms) / len(calls)


def check(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, got: torch.Tensor) -> float:
    """Relative error of got against x quantized as the spec says times W dequantized,
    in float32."""
    codes, scales = quantize_activations(x, BLOCK[1])
    xq = codes.float() * scales.repeat_interleave(BLOCK[1], 1)[:, :x.shape[1]]
    want = xq @ dequantize_blocks(w, s, BLOCK).T
    return float((got.float() - want).norm() / want.norm())


def measure(name: str, M: int, ceil: dict[str, float]) -> dict:
    """One row: ours, bf16 and scaled_mm at (shape, M), with rates and verdicts."""
    N, K = SHAPES[name]
    gen = torch.Generator(device=DEV).manual_seed(M)
    x = torch.randn(M, K, device=DEV, generator=gen).bfloat16()
    fp8 = weights(N, K, copies_for(N * K))
    rel = check(x, *fp8[0], fp8_linear(x, *fp8[0], BLOCK))
    if rel > 1e-2:
        raise SystemExit(f"{name} M={M}: relative error {rel:.2e} against the spec")
    row = {"shape": name, "M": M, "N": N, "K": K, "rel_err": rel,
           "config": vars(pick_config(M, N, K, BLOCK[1], multiprocessor_count(x.device))),
           "us": rotated_us([lambda w=w, s=s: fp8_linear(x, w, s, BLOCK) for w, s in fp8])}
    bf16 = [dequantize_blocks(*fp8[0], BLOCK, torch.bfloat16)]
    bf16 += [bf16[0].clone() for _ in range(copies_for(2 * N * K) - 1)]
    row["bf16_us"] = rotated_us([lambda w=w: torch.matmul(x, w.T) for w in bf16])
    del bf16
    one = torch.ones((), device=DEV)
    codes = quantize_activations(x, K)[0]  # any fp8 A: the time does not depend on it
    try:
        row["scaled_mm_us"] = rotated_us([
            lambda w=w: torch._scaled_mm(codes, w.T, scale_a=one, scale_b=one,
                                         out_dtype=torch.bfloat16) for w, _ in fp8])
    except RuntimeError as error:  # shapes it does not take (M not a multiple of 16)
        row["scaled_mm_us"], row["scaled_mm_error"] = None, str(error).splitlines()[0]
    flops = 2 * M * N * K
    row["weight_gbps"] = N * K / row["us"] / 1e3
    row["read_fraction"] = row["weight_gbps"] / (ceil["hbm_read_tbps"] * 1e3)
    row["tflops"] = flops / row["us"] / 1e6
    row["bf16_tflops"] = flops / row["bf16_us"] / 1e6
    row["vs_bf16"] = row["bf16_us"] / row["us"]
    if row["scaled_mm_us"]:
        row["scaled_mm_tflops"] = flops / row["scaled_mm_us"] / 1e6
        row["vs_scaled_mm"] = row["scaled_mm_us"] / row["us"]
    row["verdict"] = verdict(row)
    return row


def verdict(row: dict) -> str:
    """The issue's target of the row's M, met ("pass") or not ("miss"); "-" without one."""
    if row["M"] <= 64:
        return "pass" if row["read_fraction"] >= READ_TARGET else "miss"
    if row["M"] >= 2048:
        ok = row["vs_bf16"] >= BF16_TARGET and row.get("vs_scaled_mm", 0) >= SCALED_MM_TARGET
        return "pass" if ok else "miss"
    return "-"


def table(rows: list[dict], ceil: dict[str, float]) -> str:
    """The markdown table printed last."""
    lines = [f"HBM read {ceil['hbm_read_tbps']:.2f} TB/s, bf16 matmul "
             f"{ceil['bf16_matmul_tflops']:.0f} TFLOP/s (8192^3)", "",
             "| shape | M | N | K | µs | weight GB/s (% read) | TFLOP/s | bf16 TFLOP/s "
             "| scaled_mm TFLOP/s | vs bf16 | vs scaled_mm | target |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        smm = f"{r['scaled_mm_tflops']:.0f}" if "scaled_mm_tflops" in r else "n/a"
        vs_smm = f"{r['vs_scaled_mm']:.2f}x" if "vs_scaled_mm" in r else "n/a"
        lines.append(
            f"| {r['shape']} | {r['M']} | {r['N']} | {r['K']} | {r['us']:.1f} "
            f"| {r['weight_gbps']:.0f} ({100 * r['read_fraction']:.0f}%) | {r['tflops']:.0f} "
            f"| {r['bf16_tflops']:.0f} | {smm} | {r['vs_bf16']:.2f}x | {vs_smm} "
            f"| {r['verdict']} |")
    return "\n".join(lines)


def candidate_configs(M: int, N: int, K: int, num_sms: int) -> list[Fp8GemmConfig]:
    """The sweep's configs at (M, N, K): around `pick_config`'s, on both paths for
    M <= 256 (tiles, splits, warps, stages)."""
    base = pick_config(M, N, K, BLOCK[1], num_sms)
    found = {base}
    if M <= 256:
        block_m = max(16, triton.next_power_of_2(M))
        splits = sorted({1, max(1, base.split_k // 2), base.split_k, 2 * base.split_k})
        for fused, block_n, split_k, warps, stages in itertools.product(
                (True, False), (64, 128), splits, (4, 8), (3, 4, 6)):
            if fused and M > 64:
                continue
            found.add(Fp8GemmConfig(fused, block_m if fused else max(block_m, 64), block_n,
                                    split_k, 8, warps, stages))
    else:
        for block_m, block_n, group_m, warps, stages in itertools.product(
                (64, 128), (128, 256), (8, 16), (4, 8), (3, 4)):
            found.add(replace(base, block_m=block_m, block_n=block_n, group_m=group_m,
                              num_warps=warps, num_stages=stages))
    return sorted(found, key=str)


def sweep(names: list[str], tokens: list[int], out: str) -> None:
    """Time `candidate_configs` at each (shape, M); print the default's time and the
    best; write every timing."""
    rows = []
    for name in names:
        N, K = SHAPES[name]
        fp8 = weights(N, K, copies_for(N * K))
        for M in tokens:
            x = torch.randn(M, K, device=DEV).bfloat16()
            sms = multiprocessor_count(x.device)
            timed = []
            for config in candidate_configs(M, N, K, sms):
                try:
                    us = rotated_us([
                        lambda x=x, w=w, s=s, c=config: fp8_linear(x, w, s, BLOCK, c)
                        for w, s in fp8], rep_ms=30)
                except (OutOfResources, CompilationError):
                    continue  # does not fit in shared memory, or does not build
                timed.append((us, config))
                rows.append({"shape": name, "M": M, "N": N, "K": K, "config": vars(config),
                             "us": us, "weight_gbps": N * K / us / 1e3,
                             "tflops": 2 * M * N * K / us / 1e6})
            default = pick_config(M, N, K, BLOCK[1], sms)
            default_us = {c: us for us, c in timed}.get(default, math.nan)
            best_us, best = min(timed, key=lambda item: item[0])
            print(f"{name} M={M}: default {default} {default_us:.1f} µs; best {best} "
                  f"{best_us:.1f} µs", flush=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "sweep": rows}, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fp8_gemm.json")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and token counts")
    parser.add_argument("--sweep", action="store_true", help="time launch configs instead")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: all")
    parser.add_argument("--m", nargs="+", type=int, help="token counts (default: all)")
    args = parser.parse_args()
    names = args.shapes or list(QUICK_SHAPES if args.quick else SHAPES)
    tokens = args.m or list(QUICK_TOKENS if args.quick else TOKENS)
    if args.sweep:
        sweep(names, tokens, args.out)
        return
    ceil = ceilings()
    rows = []
    for name in names:
        for M in tokens:
            rows.append(measure(name, M, ceil))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "results": rows},
                  f, indent=1)
    print("\n" + table(rows, ceil))


if __name__ == "__main__":
    main()
