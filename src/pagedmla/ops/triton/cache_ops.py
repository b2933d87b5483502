"""Paged latent cache write (with fp8 quantization) and context gather (dequantization).

Both are pure data movement: one program moves a few whole rows of L + R values, so
every access is a contiguous row segment. Rows are addressed through slots (write) or
block tables (gather), computed per row, so any page size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    check_device,
    last_dim_contiguous,
    next_pow2,
    split_pow2,
)

ROW_ELEMENTS = 4096  # elements per program (rows x row width), 4 warps
CACHE_WARPS = 4


@triton.jit
def _quantize_fp8(x, scale, SOFTWARE_ROUND: tl.constexpr):
    """x / scale clamped to +-448, ready for float8_e4m3fn (round to nearest even).

    SOFTWARE_ROUND (interpreter only): Triton 3.9's interpreter rounds fp32 -> fp8
    wrongly where the mantissa carries into the exponent (31.9 -> 16), so the value is
    first rounded onto the e4m3 grid here; the conversion is then exact. On the GPU the
    hardware conversion (round to nearest even, saturating) does it.
    """
    # Correctly rounded division, as torch's x / scale (bit-exact cache contents).
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if SOFTWARE_ROUND:
        bits = y.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        # Spacing of e4m3 values near y: 3 mantissa bits, subnormal below 2^-6.
        ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        steps = tl.abs(y) / ulp  # exact (power of two), < 16
        steps = (steps + 8388608.0) - 8388608.0  # round half to even in float32
        y = tl.where(bits < 0, -steps, steps) * ulp  # sign bit: keeps -0.0
    return y


@triton.jit
def _write_cache_kernel(
    data_ptr, kv_c_ptr, k_pe_ptr, slot_ptr, scale_ptr,
    stride_db, stride_dp, stride_ct, stride_pt, num_tokens,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    IS_FP8: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):
    """Rows [kv_c | k_pe] of BLOCK_T tokens to their slots; slot -1 is skipped."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    keep = tok_ok & (slot >= 0)
    row = (slot // PAGE) * stride_db + (slot % PAGE) * stride_dp
    t = toks.to(tl.int64)
    if IS_FP8:
        scale = tl.load(scale_ptr)

    cols = tl.arange(0, BLOCK_L)
    mask = keep[:, None] & (cols[None, :] < L)
    x = tl.load(kv_c_ptr + t[:, None] * stride_ct + cols[None, :], mask=mask, other=0.0)
    if IS_FP8:
        x = _quantize_fp8(x, scale, SOFTWARE_ROUND)
    tl.store(data_ptr + row[:, None] + cols[None, :], x.to(data_ptr.dtype.element_ty),
             mask=mask)
    if R > 0:
        cols_r = tl.arange(0, BLOCK_R)
        mask_r = keep[:, None] & (cols_r[None, :] < R)
        y = tl.load(k_pe_ptr + t[:, None] * stride_pt + cols_r[None, :], mask=mask_r,
                    other=0.0)
        if IS_FP8:
            y = _quantize_fp8(y, scale, SOFTWARE_ROUND)
        tl.store(data_ptr + row[:, None] + L + cols_r[None, :],
                 y.to(data_ptr.dtype.element_ty), mask=mask_r)


def write_cache(
    data: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    """Store [kv_c | k_pe] ([T, L], [T, R]) at slot_mapping [T] (-1: skip) of
    data [num_blocks, block_size, L + R]; fp8: x / scale clamped to +-448."""
    check_device(data, kv_c)
    num_tokens, L = kv_c.shape
    R = k_pe.shape[-1]
    if num_tokens == 0:
        return
    if data.stride(-1) != 1:
        raise ValueError("cache data must have a contiguous last dimension")
    kv_c = last_dim_contiguous(kv_c)
    k_pe = last_dim_contiguous(k_pe)
    block_l = next_pow2(L)
    block_t = max(1, min(64, ROW_ELEMENTS // block_l))
    _write_cache_kernel[(cdiv(num_tokens, block_t),)](
        data, kv_c, k_pe, slot_mapping, scale,
        data.stride(0), data.stride(1), kv_c.stride(0), k_pe.stride(0) if R else 0,
        num_tokens,
        L=L, R=R, PAGE=data.shape[1], BLOCK_T=block_t, BLOCK_L=block_l,
        BLOCK_R=next_pow2(R) if R else 1, IS_FP8=data.dtype == FP8_DTYPE,
        SOFTWARE_ROUND=INTERPRETED, num_warps=CACHE_WARPS,
    )


@triton.jit
def _gather_cache_kernel(
    data_ptr, scale_ptr, block_table_ptr, starts_ptr, cu_seq_lens_ptr, token_to_seq_ptr,
    out_ptr,
    stride_db, stride_dp, stride_bt, stride_ot, num_rows,
    W1: tl.constexpr, W2: tl.constexpr, BLOCK_W2: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, IS_FP8: tl.constexpr,
):
    """BLOCK_ROWS output rows: row r belongs to request j = token_to_seq[r] and is its
    context position starts[j] + r - cu_seq_lens[j]. A row is W1 + W2 wide (W1 a power
    of two, W2 the rest: 576 = 512 + 64)."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    seq = tl.load(token_to_seq_ptr + rows, mask=row_ok, other=0)
    pos = tl.load(starts_ptr + seq, mask=row_ok, other=0) + rows - tl.load(
        cu_seq_lens_ptr + seq, mask=row_ok, other=0)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // PAGE,
                    mask=row_ok, other=0).to(tl.int64)
    src = data_ptr + block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp
    dst = out_ptr + rows.to(tl.int64) * stride_ot
    if IS_FP8:
        scale = tl.load(scale_ptr)

    cols = tl.arange(0, W1)
    x = tl.load(src[:, None] + cols[None, :], mask=row_ok[:, None], other=0.0)
    if IS_FP8:
        x = x.to(tl.float32) * scale
    tl.store(dst[:, None] + cols[None, :], x.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if W2 > 0:
        cols2 = tl.arange(0, BLOCK_W2)
        mask2 = row_ok[:, None] & (cols2[None, :] < W2)
        y = tl.load(src[:, None] + W1 + cols2[None, :], mask=mask2, other=0.0)
        if IS_FP8:
            y = y.to(tl.float32) * scale
        tl.store(dst[:, None] + W1 + cols2[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mask2)


def gather_cache(
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    starts: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    token_to_seq: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Copy context rows of a chunk into out [rows, L + R], dequantizing fp8.

    Request j contributes positions [starts[j], starts[j] + n_j) of its context
    (block_table [J, max_blocks] row j) to out rows [cu_seq_lens[j], cu_seq_lens[j+1]);
    token_to_seq [rows] names the request of each out row (int32 throughout).
    """
    check_device(data, out)
    num_rows, width = out.shape
    if num_rows == 0:
        return
    if data.stride(-1) != 1:
        raise ValueError("cache data must have a contiguous last dimension")
    target = last_dim_contiguous(out)
    w1, w2 = split_pow2(width)
    block_rows = max(1, min(64, ROW_ELEMENTS // next_pow2(width)))
    _gather_cache_kernel[(cdiv(num_rows, block_rows),)](
        data, scale, block_table, starts, cu_seq_lens, token_to_seq, target,
        data.stride(0), data.stride(1), block_table.stride(0), target.stride(0), num_rows,
        W1=w1, W2=w2, BLOCK_W2=next_pow2(w2) if w2 else 1, PAGE=data.shape[1],
        BLOCK_ROWS=block_rows, IS_FP8=data.dtype == FP8_DTYPE, num_warps=CACHE_WARPS,
    )
    if target is not out:
        out.copy_(target)
