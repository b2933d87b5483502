"""Triton backend kernels on one GPU: speed against measured ceilings and baselines.

    python -m benchmarks.bench_kernels --out bench_kernels.json           # every shape
    python -m benchmarks.bench_kernels --quick --out bench_kernels.json   # fewer shapes
    python -m benchmarks.bench_kernels --sweep-configs [decode|prefill]   # config variants
    python -m benchmarks.bench_kernels --plots-from bench_kernels.json --plots results/

It measures, in one process: the card's HBM read bandwidth (the faster of a large
torch.sum and a plain streaming-read Triton kernel, `harness.stream_read`) and copy
bandwidth, the bf16 matmul rate (8192^3, random data), and our kernels against
baselines: decode against a plain PyTorch gather + bmm (`baselines.torch_decode`) and,
on three shapes, the float32 reference op; merge against torch.compile of the reference
op; prefill against PyTorch SDPA (cuDNN or flash) on dense causal shapes. Decode rows
are judged against the HBM read rate, merge against the copy rate, prefill against the
bf16 matmul rate.

Times are medians of triton.testing.do_bench, which wipes a 256 MB buffer (several times
the 60 MB L2) before every call; decode rows time CUDA-graph replays, prefill rows
(ours and SDPA's) `bench_covered`, which keeps the host's launch work off the clock,
with the eager timing and the host's time per call beside them. Byte and FLOP counts
are the fewest each kernel must move / compute; they are written next to each result.

The kernels' correctness at these sizes is checked by tests/test_kernel_sweep.py
(`pytest -m cuda tests/test_kernel_sweep.py`); two results are compared row by row
with `python -m benchmarks.compare_results OLD.json NEW.json`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

from benchmarks.baselines import sdpa_baseline, torch_decode
from benchmarks.harness import (
    DEV,
    SmClock,
    bench,
    bench_covered,
    ceilings,
    graphed,
    host_us,
    read_times,
)
from benchmarks.kernel_choice import (
    decode_block_h,
    decode_configs,
    decode_runs_gluon,
    prefill_runs_gluon,
    triton_decode_config,
    triton_prefill_config,
)
from benchmarks.plots import write_plots
from benchmarks.sweep_configs import sweep_decode_configs, sweep_prefill_configs
from benchmarks.workloads import FP8, attention_flops, cu_lens, decode_cost, decode_inputs
from pagedmla.ops import reference as ref
from pagedmla.ops import triton as triton_ops
from pagedmla.ops.triton import merge_attn_states, mla_decode, prefill_attention, varlen_attention


def bench_decode(quick: bool, ceil: dict[str, float]) -> list[dict]:
    """Decode shapes on 64-token pages (one bulk copy per tile), plus 16-token pages
    (four copies per tile on Hopper) for comparison; bf16 and fp8 caches."""
    shapes = [  # (batch, heads, context, q_len, regime, page size)
        (64, 16, 2048, 1, "memory", 64), (64, 16, 8192, 1, "memory", 64),
        (128, 16, 8192, 1, "memory", 64), (256, 16, 4096, 1, "memory", 64),
        (64, 16, 32768, 1, "memory", 64), (256, 16, 32768, 1, "memory", 64),
        (1, 16, 131072, 1, "memory", 64),
        (1, 128, 65536, 1, "compute", 64), (1, 128, 131072, 1, "compute", 64),
        (64, 128, 4096, 1, "compute", 64), (128, 128, 8192, 1, "compute", 64),
        (64, 16, 8192, 4, "memory", 64), (128, 16, 8192, 1, "memory", 16),
        (128, 32, 8192, 1, "mixed", 64), (128, 64, 8192, 1, "compute", 64),
        (64, 128, 4096, 1, "compute", 16),
    ]
    if quick:
        shapes = [shapes[i] for i in (0, 2, 5, 6, 7, 9, 10, 12)]
    shapes = [(*shape, None) for shape in shapes]
    # Ragged batches, one long request among short ones (as serving batches are): the
    # split plan follows the lengths.
    shapes += [(64, 16, 131072, 1, "memory", 64, [131072] + [2048] * 63),
               (32, 128, 65536, 1, "compute", 64, [65536] + [4096] * 31)]
    # Past one wave of programs (132 SMs on an H200), and a wave that a CUDA graph pads
    # past it with empty rows (seq_len 0), as an engine's decode step does.
    if not quick:
        shapes += [(140, 16, 2048, 1, "memory", 64, None),
                   (144, 16, 1088, 1, "memory", 64, [1088] * 132 + [0] * 12)]
    # The oracle (`reference.mla_decode`, float32, eager) is timed too on three shapes.
    reference_for = {(64, 16, 2048), (1, 128, 65536), (64, 128, 4096)}
    rows = []
    for batch, heads, context, q_len, regime, page, lengths in shapes:
        for cache in (torch.bfloat16, FP8):
            args = decode_inputs(batch, heads, context, q_len, block_size=page, cache=cache,
                                 lengths=lengths)
            # As each layer of a forward pays it: the split plan is made once per forward
            # (`plans`), here before the capture; with_plan_us includes making it.
            plans: dict = {}
            replay = graphed(lambda args=args, plans=plans: mla_decode(*args, plans=plans))
            with SmClock() as clock:
                us = bench(replay)
            clean_us = bench_covered(replay, clean_l2=True)
            with_plan_us = bench(graphed(lambda args=args: mla_decode(*args)))
            eager_us = bench(lambda args=args: mla_decode(*args))
            # Where a Gluon kernel runs stage 1, time the Triton kernel of the same config.
            plain = triton_decode_config(args)
            plain_us = None
            if decode_runs_gluon(args):
                plain_us = bench(graphed(lambda args=args, plain=plain, plans=plans:
                                         mla_decode(*args, config=plain, plans=plans)))
            # The Triton kernel at a fixed 4 splits per request, as widely used Triton MLA
            # decode kernels split: what the split plan is worth.
            four: dict = {}
            fixed4_us = bench(graphed(lambda args=args, plain=plain, four=four: mla_decode(
                *args, config=plain, num_splits=4, plans=four)))
            nbytes, flops = decode_cost(batch, heads, context, q_len, args[1].element_size(),
                                        sum(lengths) if lengths else None)
            # A plain read of as many bytes, timed the same way: what a short grid's fixed
            # costs (launch, ramp-up, the L2 write-back the flush leaves) do to any read.
            src = torch.empty(nbytes // 2, device=DEV, dtype=torch.bfloat16).normal_()
            same_read_us = min(read_times(src))
            del src
            base_us = ref_us = None
            if cache == torch.bfloat16 and q_len == 1 and lengths is None:
                base_us = bench(graphed(lambda args=args: torch_decode(*args)))
                if page == 64 and (batch, heads, context) in reference_for:
                    ref_us = bench(lambda args=args: ref.mla_decode(*args), rep_ms=200)
            name = "bf16" if cache == torch.bfloat16 else "fp8"
            row = {
                "kernel": "mla_decode", "cache": name, "regime": regime, "B": batch,
                "N": heads, "context": context, "q_len": q_len, "page": page, "us": us,
                "with_plan_us": with_plan_us, "eager_us": eager_us, "bytes": nbytes,
                "flops": flops, "tbps": nbytes / us / 1e6, "tflops": flops / us / 1e6,
                "clean_l2_us": clean_us,
                "baseline": "PyTorch gather + bmm (torch_decode)" if base_us else None,
                "baseline_us": base_us, "reference_us": ref_us,
                "stage1": "gluon" if plain_us else "triton",
                "triton_stage1_us": plain_us, "triton_4_splits_us": fixed4_us,
                "same_size_read_us": same_read_us,
                "sm_mhz": clock.mhz,
            }
            row["pct_ceiling"] = 100 * row["tbps"] / ceil["hbm_read_tbps"]
            row["pct_ceiling_clean_l2"] = 100 * nbytes / clean_us / 1e6 / ceil["hbm_read_tbps"]
            if cache == FP8:  # rows[-1]: the shape's bf16 row, measured just before
                row["fp8_speedup_vs_bf16"] = rows[-1]["us"] / us
                row["fp8_speedup_vs_bf16_clean_l2"] = rows[-1]["clean_l2_us"] / clean_us
            if lengths:
                row["lengths"] = " + ".join(f"{len(list(run))} x {n}"
                                            for n, run in itertools.groupby(lengths))
            rows.append(row)
            del args
            torch.cuda.empty_cache()
    return rows


def bench_merge(quick: bool, ceil: dict[str, float]) -> list[dict]:
    """merge_attn_states on T = 16384 tokens, N = 128 heads of width 128 (bf16), against
    torch.compile of the reference op; judged against the copy rate (it reads two
    partial outputs and writes one)."""
    T, N, D = 16384, 128, 128
    po = torch.randn(T, N, D, device=DEV, dtype=torch.bfloat16)
    so = torch.randn(T, N, D, device=DEV, dtype=torch.bfloat16)
    pl = torch.randn(N, T, device=DEV)
    sl = torch.randn(N, T, device=DEV)
    out = torch.empty_like(po)
    out_lse = torch.empty_like(pl)
    nbytes = 3 * T * N * D * 2 + 3 * N * T * 4

    def eager(po: torch.Tensor, pl: torch.Tensor, so: torch.Tensor, sl: torch.Tensor,
              out: torch.Tensor, out_lse: torch.Tensor) -> None:
        ref.merge_attn_states(po, pl, so, sl, out, out_lse)

    compiled = torch.compile(eager)
    compiled(po, pl, so, sl, out, out_lse)
    us = bench(lambda: merge_attn_states(po, pl, so, sl, out, out_lse))
    base_us = bench(lambda: compiled(po, pl, so, sl, out, out_lse))
    return [{
        "kernel": "merge_attn_states", "T": T, "N": N, "D": D, "us": us, "bytes": nbytes,
        "tbps": nbytes / us / 1e6, "pct_ceiling": 100 * nbytes / us / 1e6 / ceil[
            "hbm_copy_tbps"], "baseline": "torch.compile(reference)", "baseline_us": base_us,
    }]


def bench_prefill(quick: bool) -> list[dict]:
    """Varlen attention (the Gluon kernel on Hopper, the Triton kernel for comparison)
    and the backend's prefill op (cuDNN for equal-length batches) against cuDNN / flash
    SDPA on the same dense shape; ragged batches, which SDPA cannot take in one call,
    against the Triton kernel only."""
    qk, dv = 192, 128
    cases = [  # (label, heads, q_lens, k_lens, causal)
        *((f"S={s} causal", n, [s], [s], True)
          for n, s in ((16, 4096), (16, 16384), (128, 4096), (128, 8192), (128, 16384))),
        ("context q=2048 k=8192", 128, [2048], [8192], False),
    ]
    ragged = [200 + (i * 1237) % 2800 for i in range(12)]  # 200..3000 tokens, fixed
    cases += [(f"12 ragged seqs, {sum(ragged)} tokens, causal", n, ragged, ragged, True)
              for n in (16, 128)]
    if quick:
        cases = [cases[i] for i in (1, 3, 6)]
    rows = []
    for label, heads, q_lens, k_lens, causal in cases:
        q = torch.randn(sum(q_lens), heads, qk, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(sum(k_lens), heads, qk + dv, device=DEV, dtype=torch.bfloat16)
        k, v = kv[..., :qk], kv[..., qk:]
        args = (q, k, v, cu_lens(q_lens), cu_lens(k_lens), max(q_lens), max(k_lens),
                qk**-0.5, causal)
        flops = attention_flops(q_lens, k_lens, heads, qk + dv, causal)
        base_us, base = None, None
        if len(q_lens) == 1:
            base_us, base = sdpa_baseline(q, k.contiguous(), v.contiguous(), causal)
        plain = triton_prefill_config(qk, dv, q.dtype)
        triton_us = bench_covered(
            lambda args=args, plain=plain: varlen_attention(*args, config=plain), rep_ms=200)
        gluon = prefill_runs_gluon(*args)
        for kernel, fn in (("varlen_attention", varlen_attention),
                           ("prefill_attention", prefill_attention)):
            call = functools.partial(fn, *args)
            us = bench_covered(call, rep_ms=200)
            rows.append({
                "kernel": kernel, "shape": label, "N": heads, "tokens": sum(q_lens),
                "qk": qk, "v": dv, "causal": causal, "us": us, "flops": flops,
                "tflops": flops / us / 1e6, "baseline": base, "baseline_us": base_us,
                "stage": ("gluon" if gluon else "triton") if kernel == "varlen_attention"
                else "backend op", "triton_kernel_us": triton_us,
                # The same call timed as `bench` times it (host work beyond the wipe
                # counts), and its host work alone.
                "eager_us": bench(call, rep_ms=200), "host_us": host_us(call),
            })
        del q, kv, k, v
    return rows


def markdown(ceil: dict[str, float], rows: list[dict]) -> str:
    """The results as a markdown table, with a legend of its columns."""
    lines = [
        f"ceilings: HBM read {ceil['hbm_read_tbps']:.2f} TB/s (torch.sum "
        f"{ceil.get('hbm_read_torch_sum_tbps', math.nan):.2f}), copy "
        f"{ceil['hbm_copy_tbps']:.2f} TB/s, bf16 matmul {ceil['bf16_matmul_tflops']:.0f} "
        "TFLOP/s",
        "",
        "% ceiling: decode vs the HBM read rate, merge vs the copy rate (it reads and writes)",
        "decode µs: one CUDA-graph replay (GPU time, as in the engine's decode steps); "
        "eager µs adds Python's launch overhead; [Gluon; ...]: stage 1 ran a Hopper "
        "kernel (decode_hopper up to 16 query rows, decode_hopper_fp8 for an fp8 cache, "
        "decode_hopper_heads above), and the "
        "Triton kernel's time is shown for comparison",
        "",
        "read µs: torch.sum over as many bytes as the decode moves, timed the same way",
        "",
        "clean-L2 µs (% ceiling): the decode's replay after a wipe that reads 256 MB "
        "instead of writing it, so that no dirty lines are left to write back during "
        "the call (`bench_covered(clean_l2=True)`)",
        "",
        "prefill µs (and its baseline's): GPU time, with the host's work for the call "
        "kept off the clock (`bench_covered`); eager µs: the call timed as the decode's "
        "eager column is, where host work beyond the L2 wipe counts",
        "",
        "SM MHz: the median SM clock while the µs column was measured (nvidia-smi); the "
        "card lowers it at its power cap",
        "",
        "| kernel | shape | µs | eager µs | TB/s | % ceiling | read µs | clean-L2 µs "
        "| TFLOP/s | baseline | baseline µs | speedup | SM MHz |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r["kernel"] == "mla_decode":
            ctx = f"ctx={r['lengths']}" if "lengths" in r else f"ctx={r['context']}"
            shape = (f"{r['cache']} B={r['B']} N={r['N']} {ctx} "
                     f"q_len={r['q_len']} page={r.get('page', 64)}")
            if "fp8_speedup_vs_bf16" in r:
                shape += f" (x{r['fp8_speedup_vs_bf16']:.2f} vs bf16)"
            if r.get("triton_stage1_us"):
                shape += f" [Gluon; Triton kernel: {r['triton_stage1_us']:.1f} µs]"
            if r.get("triton_4_splits_us"):
                shape += f" [Triton kernel, 4 splits: {r['triton_4_splits_us']:.1f} µs]"
        elif r["kernel"] == "merge_attn_states":
            shape = f"T={r['T']} N={r['N']} D={r['D']} bf16"
        else:
            shape = (f"N={r['N']} {r['shape']} qk={r['qk']} v={r['v']} [{r['stage']}; "
                     f"Triton kernel: {r['triton_kernel_us']:.1f} µs; host "
                     f"{r['host_us']:.0f} µs per call]")
        read = f"{r['same_size_read_us']:.1f}" if "same_size_read_us" in r else ""
        clean = (f"{r['clean_l2_us']:.1f} ({r['pct_ceiling_clean_l2']:.0f}%)"
                 if "clean_l2_us" in r else "")
        tbps = f"{r['tbps']:.2f}" if "tbps" in r else ""
        pct = f"{r['pct_ceiling']:.0f}" if "pct_ceiling" in r else ""
        tflops = f"{r['tflops']:.0f}" if "tflops" in r else ""
        base = r.get("baseline") or ""
        base_us = f"{r['baseline_us']:.1f}" if r.get("baseline_us") else ""
        speed = f"{r['baseline_us'] / r['us']:.2f}x" if r.get("baseline_us") else ""
        eager = f"{r['eager_us']:.1f}" if "eager_us" in r else ""
        mhz = f"{r['sm_mhz']:.0f}" if r.get("sm_mhz") else ""
        lines.append(f"| {r['kernel']} | {shape} | {r['us']:.1f} | {eager} | {tbps} | {pct} "
                     f"| {read} | {clean} | {tflops} "
                     f"| {base} | {base_us} | {speed} | {mhz} |")
    return "\n".join(lines)


def kernel_sources_digest() -> str:
    """sha256 over the Triton backend's source files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(triton_ops.__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def report_header() -> dict:
    """What a benchmark report records of its run: date, GPU, versions, command, commit
    and the kernels' sources digest."""
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(sys.argv),
    }
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True,
                                          check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        report["commit"] = "unknown"
    # The git metadata of a copied tree can lag its files: the kernels' own content
    # identifies what was measured (compare with `kernel_sources_digest()` of a commit).
    report["kernel_sources_sha256"] = kernel_sources_digest()
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--plots", default=None, help="write PNG plots into this directory")
    parser.add_argument("--plots-from", default=None,
                        help="only draw the plots of an earlier JSON report")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    parser.add_argument("--sweep-configs", nargs="?", const="all", default=None,
                        choices=["decode", "prefill", "all"],
                        help="time config variants (decode, prefill or all) instead of "
                        "the benchmarks")
    args = parser.parse_args(argv)
    if args.plots_from:
        with open(args.plots_from) as f:
            print("\n".join(write_plots(json.load(f), args.plots or ".")))
        return 0
    if not torch.cuda.is_available():
        print("the kernel benchmarks need a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    start = time.time()
    report = report_header()
    if args.sweep_configs:
        report["sweep"] = []
        if args.sweep_configs in ("decode", "all"):
            report["sweep"] += sweep_decode_configs()
        if args.sweep_configs in ("prefill", "all"):
            report["sweep"] += sweep_prefill_configs()
    else:
        ceil = ceilings()
        report["ceilings"] = ceil
        print(f"ceilings {ceil}", flush=True)
        rows = bench_decode(args.quick, ceil)
        rows += bench_merge(args.quick, ceil)
        rows += bench_prefill(args.quick)
        report["results"] = rows
        report["configs"] = decode_configs()
        report["decode_regimes"] = {n: decode_block_h(n) for n in (16, 32, 128)}
    report["seconds"] = time.time() - start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if "results" in report:
        if args.plots:
            write_plots(report, args.plots)
        print()
        print(markdown(report["ceilings"], report["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
