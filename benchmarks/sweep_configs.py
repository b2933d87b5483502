"""Launch-config sweeps of the Triton decode and prefill kernels
(`python -m benchmarks.bench_kernels --sweep-configs [decode|prefill]`).

They time variants of a regime's config (tile sizes, warps, stages, product form, tile
loader, prefetch distance) on representative shapes and print each variant's time,
rate and compiled code (registers, spills, shared memory, wgmma / TMA use): the search
behind the tables of configs in `ops/triton/decode_triton.py` and
`ops/triton/prefill_triton.py`.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch
from triton.runtime.jit import JITFunction

from benchmarks.baselines import sdpa_baseline
from benchmarks.harness import DEV, bench, graphed
from benchmarks.kernel_choice import (
    PrefillConfig,
    decode_config,
    decode_stage1_kernel,
    prefill_kernel_jit,
)
from benchmarks.workloads import FP8, decode_cost, decode_inputs
from pagedmla.ops.triton import mla_decode, varlen_attention
from pagedmla.testing import relative_error


def compiled_stats(jit_fn: JITFunction) -> str:
    """Registers, spills and shared memory of the kernel `jit_fn` compiled last, and
    whether its PTX uses wgmma (best effort: Triton internals differ across versions)."""
    try:
        kernel = list(next(iter(jit_fn.device_caches.values()))[0].values())[-1]
        ptx = kernel.asm.get("ptx", "")
        wgmma, tma = "wgmma" in ptx, "cp.async.bulk.tensor" in ptx
        return (f"regs={kernel.n_regs} spills={kernel.n_spills} "
                f"smem={kernel.metadata.shared} wgmma={wgmma} tma={tma}")
    except Exception as error:  # diagnostics only
        return f"stats unavailable ({type(error).__name__})"


def sweep_decode_configs() -> list[dict]:
    """Time stage-1 variants per regime on representative shapes (CUDA-graph replays);
    prints each variant."""
    rows = []
    # regime: (shapes, variants as (block_n, warps, stages, swap_ab, paged, block_h,
    # prefetch)); the first variant is the one the others must agree with.
    cases = {
        "rows16": ([(128, 16, 8192), (64, 16, 2048), (1, 16, 131072)],
                   [(64, 4, 2, True, True, 16, 0), (64, 4, 2, True, True, 16, 1),
                    (64, 4, 2, True, True, 16, 2), (64, 4, 2, True, True, 16, 3)]),
        "rows16-fp8": ([(128, 16, 8192)],
                       [(64, 8, 2, False, True, 16, 0), (64, 8, 2, False, True, 16, 2)]),
        "rows64": ([(64, 128, 4096)],
                   [(64, 8, 2, False, True, 64, 0), (64, 8, 2, False, True, 64, 2)]),
    }
    for key, (shapes, variants) in cases.items():
        base = decode_config(key)
        for cache in ((FP8,) if key.endswith("fp8") else (torch.bfloat16,)):
            for batch, heads, context in shapes:
                args = decode_inputs(batch, heads, context, cache=cache)
                nbytes, flops = decode_cost(batch, heads, context, 1, args[1].element_size())
                found = []
                first = None
                for block_n, warps, stages, swap, paged, block_h, prefetch in variants:
                    cfg = replace(base, block_n=block_n, num_warps=warps, num_stages=stages,
                                  swap_ab=swap, paged=paged, block_h=block_h,
                                  prefetch=prefetch)
                    try:
                        # Every variant must agree with the first (a cheap sanity check).
                        got = mla_decode(*args, config=cfg)[0]
                        first = got if first is None else first
                        if relative_error(got, first) > 1e-2:
                            print(f"  {key} {cfg}: WRONG (rel "
                                  f"{relative_error(got, first):.3g})")
                            continue
                        us = bench(graphed(lambda cfg=cfg, args=args:
                                           mla_decode(*args, config=cfg)), rep_ms=50)
                    except Exception as error:  # out of resources etc.
                        print(f"  {key} h={block_h} n={block_n} w={warps} s={stages} "
                              f"swap={swap} paged={paged}: "
                              f"{type(error).__name__}", flush=True)
                        continue
                    row = {"regime": key, "cache": str(cache), "B": batch, "N": heads,
                           "context": context, "block_n": block_n, "warps": warps,
                           "stages": stages, "swap_ab": swap, "paged": paged,
                           "block_h": block_h, "prefetch": prefetch, "us": us,
                           "tbps": nbytes / us / 1e6,
                           "tflops": flops / us / 1e6,
                           "stats": compiled_stats(decode_stage1_kernel())}
                    found.append(row)
                    print(f"  {key} {cache} B={batch} N={heads} ctx={context} h={block_h} "
                          f"n={block_n} pf={prefetch} "
                          f"w={warps} s={stages} swap={swap} paged={paged}: {us:.1f} us "
                          f"{row['tbps']:.2f} TB/s "
                          f"{row['tflops']:.0f} TFLOP/s {row['stats']}", flush=True)
                rows += found
                del args
    return rows


def sweep_prefill_configs() -> list[dict]:
    """Time prefill configs (block_m, block_n, warps, stages) per head-dim pair on
    8k causal tokens, against cuDNN / flash SDPA on the same dense shape."""
    cases = {(192, 128): [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                          (64, 64, 4, 2)],
             (256, 256): [(128, 64, 8, 2)],
             (128, 128): [(128, 128, 8, 3), (128, 64, 8, 3)]}
    rows = []
    for (qk, dv), variants in cases.items():
        for heads in ((16, 128) if qk == 192 else (16,)):
            seq = 8192
            q = torch.randn(seq, heads, qk, device=DEV, dtype=torch.bfloat16)
            kv = torch.randn(seq, heads, qk + dv, device=DEV, dtype=torch.bfloat16)
            k, v = kv[..., :qk], kv[..., qk:]
            cu = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
            flops = 2 * heads * (seq * (seq + 1) // 2) * (qk + dv)
            base_us, label = sdpa_baseline(q, k.contiguous(), v.contiguous(), True)
            print(f"  prefill {qk}/{dv} N={heads}: {label} {base_us:.0f} us", flush=True)
            for bm, bn, w, st in variants:
                cfg = PrefillConfig(bm, bn, w, st)
                try:
                    us = bench(lambda cfg=cfg, q=q, k=k, v=v, cu=cu, seq=seq: varlen_attention(
                        q, k, v, cu, cu, seq, seq, 0.07, True, config=cfg), rep_ms=100)
                except Exception as error:
                    print(f"  prefill {qk}/{dv} {cfg}: {type(error).__name__}", flush=True)
                    continue
                row = {"N": heads, "S": seq, "qk": qk, "v": dv, "config": asdict(cfg),
                       "us": us, "tflops": flops / us / 1e6, "baseline_us": base_us,
                       "stats": compiled_stats(prefill_kernel_jit())}
                rows.append(row)
                print(f"  prefill {qk}/{dv} N={heads} {bm}/{bn}/{w}/{st}: "
                      f"{us:.0f} us {row['tflops']:.0f} TFLOP/s {base_us / us:.2f}x "
                      f"{row['stats']}", flush=True)
            del q, kv, k, v
    return rows
