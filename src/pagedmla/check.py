"""`pagedmla check`: one mixed MLA step through MLAAttention against the dense oracle."""

from __future__ import annotations

import time

import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.testing import make_paged_batch, relative_error

SHAPES = {
    "DeepSeek-V2-Lite": MLADims(16, 512, 128, 64, 128),
    "DeepSeek-V3": MLADims(128, 512, 128, 64, 128, q_lora_rank=1536),
}
# Decodes (1 token), multi-token decodes (2-4 tokens), prefills with context, and a
# prefill without context; the small workspace forces several chunks and continuations.
QUERY_LENS = [1, 1, 3, 4, 37, 50, 20]
SEQ_LENS = [300, 17, 129, 64, 737, 50, 333]
DECODE_THRESHOLD = 4
BLOCK_SIZE = 16
WORKSPACE_ROWS = 256


def run_check(device: str, dtype: torch.dtype, backend: str, repeats: int = 3,
              kv_cache_dtype: str = "auto", kv_cache_scale: float = 1.0) -> bool:
    """Run the step for every shape; print the plan, the error and the time, and for an fp8
    cache (of scale kv_cache_scale) what its writes clipped. True if all pass."""
    tolerance = 2e-4 if dtype == torch.float32 else 2e-2
    ok = True
    for name, dims in SHAPES.items():
        batch = make_paged_batch(
            dims, QUERY_LENS, SEQ_LENS, BLOCK_SIZE, dtype=dtype, device=device, seed=len(name),
            kv_cache_dtype=kv_cache_dtype, fp8_scale=kv_cache_scale,
        )
        batch.cache.track()
        builder = MLAMetadataBuilder(
            dims, block_size=BLOCK_SIZE, device=device, workspace_rows=WORKSPACE_ROWS,
            decode_threshold=DECODE_THRESHOLD,
        )
        meta = builder.build(batch.spec)
        attn = MLAAttention(dims, batch.softmax_scale, batch.kv_b_proj, backend=backend)
        out = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
        clipped, amax = batch.cache.clipped, batch.cache.amax  # of the step's writes
        error = relative_error(out, batch.oracle(DECODE_THRESHOLD))
        times = []
        for _ in range(repeats):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, builder.build(batch.spec))
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        passed = error < tolerance
        ok &= passed
        print(f"== {name}: N={dims.num_heads} L={dims.kv_lora_rank} R={dims.qk_rope_head_dim} "
              f"P={dims.qk_nope_head_dim} V={dims.v_head_dim}, {dtype}, {device}, "
              f"backend {attn.ops(batch.q.device).name}")
        print(meta.describe())
        print(f"relative error vs float64 dense oracle: {error:.2e} "
              f"(tolerance {tolerance:.0e}) {'PASS' if passed else 'FAIL'}")
        if clipped is not None:
            print(f"fp8 cache, scale {float(batch.cache.scale):g}: largest |value| written "
                  f"{amax:.3g}, {clipped} values clipped (> 448 x scale) of "
                  f"{batch.kv_c.numel() + batch.k_pe.numel()}")
        print(f"time per step (build + forward, median of {repeats}): "
              f"{sorted(times)[len(times) // 2] * 1e3:.1f} ms")
    return ok
