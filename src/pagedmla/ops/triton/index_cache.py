"""The lightning indexer's key cache write (`reference_indexer.write_indexer_cache` is the
specification: layouts, rotation, scales), bit for bit the reference's bytes.

One program takes a few tokens, whole rows of D values; a token whose slot is -1 is
masked off in the kernel, so nothing reads a device value on the host or allocates by
one (graph-safe).

* Float cache [num_blocks, block_size, D]: the row in the cache's dtype.
* fp8 cache (uint8 [num_blocks, block_size, D + 4], `fp8_cache_views`): the row is
  rotated in registers by the fast Walsh-Hadamard butterfly in the reference's order
  (`hadamard_transform`: log2 D stages of one add and one subtract per pair, then one
  multiply; nothing a compiler could fuse into an FMA), so the rotated values are the
  reference's bits. A product with the Hadamard matrix (tl.dot, a BLAS or cuBLAS
  matmul) sums in an order of its own: on random keys about 1 code in 60000 then
  differs. Then the power-of-two scale of the row (`fp8_scales`), the codes (the
  latent cache writer's `_quantize_fp8`: IEEE division, saturated to +-448, round to
  nearest even, NaN kept) and both stores at their places in the block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.block_fp8 import E4M3_MAX
from pagedmla.ops.reference_indexer import (
    AMAX_FLOOR,
    cache_head_dim,
    check_power_of_two,
    fp8_cache_views,
    hadamard_scale,
    is_fp8_cache,
)
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    check_device,
    last_dim_contiguous,
    next_pow2,
)
from pagedmla.ops.triton.cache_ops import _quantize_fp8, _to_bf16
from pagedmla.ops.triton.fp8_quant import _nan_max

_ROW_ELEMENTS = 2048  # key values per program (tokens x D)
_MAX_TOKENS = 64
_WARPS = 4
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def _hadamard(x, BLOCK_T: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr,
              SCALE: tl.constexpr):
    """Rows of x [BLOCK_T, D] float32 by `reference_indexer.hadamard_transform`'s
    stages: (a, b) = (x[2j], x[2j + 1]) -> x[j] = a + b, x[j + D/2] = a - b, then
    x * SCALE (float32(D^-0.5))."""
    for _ in tl.static_range(LOG2_D):
        a, b = tl.split(tl.reshape(x, (BLOCK_T, D // 2, 2)))
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (BLOCK_T, D))
    return x * SCALE


@triton.jit
def _pow2_scale(amax):
    """`reference_indexer.fp8_scales`: the smallest 2^e >= max(amax, 1e-4) / 448 (IEEE
    division), at most 2^127, NaN where amax is NaN."""
    ratio = tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR, propagate_nan=tl.PropagateNan.ALL),
                           _E4M3_MAX)
    bits = ratio.to(tl.int32, bitcast=True)  # > 0: exponent field, then mantissa
    exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2)
    scale = ((tl.minimum(exponent, 127) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(ratio != ratio, float("nan"), scale)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["num_tokens"],
    do_not_specialize_on_alignment=["slot_ptr"])
def _write_kernel(
    data_ptr, scales_ptr, k_ptr, slot_ptr, num_tokens,
    stride_kt, stride_db, stride_dp, stride_sb,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_T: tl.constexpr,
    FP8: tl.constexpr, LOG2_D: tl.constexpr, SCALE: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):
    """Keys of BLOCK_T tokens to their slots (slot < 0 skipped). FP8: data_ptr the
    codes (uint8, row stride_dp = D), scales_ptr the float32 scales [blocks, PAGE]
    (block stride stride_sb); else data_ptr the float rows (scales_ptr unused)."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    keep = tok_ok & (slot >= 0)
    block, offset = slot // PAGE, slot % PAGE
    cols = tl.arange(0, BLOCK_D)
    mask = keep[:, None] & (cols < D)[None, :]
    x = tl.load(k_ptr + toks.to(tl.int64)[:, None] * stride_kt + cols[None, :], mask=mask,
                other=0.0)
    row = data_ptr + (block * stride_db + offset * stride_dp)[:, None] + cols[None, :]
    if FP8:
        y = _hadamard(x.to(tl.float32), BLOCK_T, D, LOG2_D, SCALE)
        scale = _pow2_scale(tl.reduce(tl.abs(y), 1, _nan_max))
        y = _quantize_fp8(y, scale[:, None], SOFTWARE_ROUND)
        codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if SOFTWARE_ROUND:  # the interpreter encodes NaN as +-384 (0x7C): e4m3's is 0x7F
            codes = tl.where(y != y, codes | 0x7F, codes)
        tl.store(row, codes, mask=mask)
        tl.store(scales_ptr + block * stride_sb + offset, scale, mask=keep)
    elif data_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(row, _to_bf16(x, SOFTWARE_ROUND), mask=mask)
    else:
        tl.store(row, x.to(data_ptr.dtype.element_ty), mask=mask)


def write_indexer_cache(data: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store keys k [T, D] at the slots of slot_mapping [T] (-1: skip) of the key cache
    `data`, as `reference_indexer.write_indexer_cache` (same bytes): in the cache's
    dtype, or rotated and quantized (codes and scale) in the fp8 layout."""
    check_device(data, k, slot_mapping)
    num_tokens, head_dim = k.shape
    if head_dim != cache_head_dim(data) or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"k must be [T, D] and slot_mapping [T] for a key cache of D = "
                         f"{cache_head_dim(data)}, got k {tuple(k.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)}")
    if num_tokens == 0:
        return
    fp8 = is_fp8_cache(data)
    if fp8:
        check_power_of_two(head_dim)
        codes, scales = fp8_cache_views(data)
        rows = codes.view(torch.uint8)
    elif data.stride(-1) != 1:
        raise ValueError(f"data must have a contiguous last dimension, got strides "
                         f"{data.stride()}")
    else:
        rows = scales = data
    k = last_dim_contiguous(k)
    block_d = next_pow2(head_dim)
    block_t = max(1, min(_MAX_TOKENS, _ROW_ELEMENTS // block_d))
    _write_kernel[(cdiv(num_tokens, block_t),)](
        rows, scales, k, slot_mapping, num_tokens,
        k.stride(0), rows.stride(0), rows.stride(1), scales.stride(0),
        D=head_dim, BLOCK_D=block_d, PAGE=data.shape[1], BLOCK_T=block_t, FP8=fp8,
        LOG2_D=head_dim.bit_length() - 1, SCALE=hadamard_scale(head_dim),
        SOFTWARE_ROUND=INTERPRETED, num_warps=_WARPS,
    )
