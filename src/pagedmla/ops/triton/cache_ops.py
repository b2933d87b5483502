"""Paged latent cache write (with fp8 quantization) and context gather (dequantization).

Both are pure data movement: one program moves a few whole rows of L + R values, so
every access is a contiguous row segment. Rows are addressed through slots (write) or
block tables (gather), computed per row, so any page size works. An fp8_ds_mla cache
(uint8 [num_blocks, page, 656], `pagedmla.cache`) has its own kernels: the write
computes each 128-value group's power-of-two scale in registers, and `ds_mla_latent` /
`ds_mla_rope` read entries back (the gather and the portable decode and sparse kernels
use them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.cache import (
    DS_MLA_DTYPE,
    DS_MLA_GROUP,
    DS_MLA_GROUPS,
    DS_MLA_LATENT,
    DS_MLA_MAX_EXP,
    DS_MLA_MIN_EXP,
    DS_MLA_ROPE,
    DS_MLA_ROPE_AT,
    DS_MLA_SCALES_AT,
    FP8_DTYPE,
)
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
# The fp8_ds_mla layout, for the kernels.
_GROUP = tl.constexpr(DS_MLA_GROUP)
_GROUPS = tl.constexpr(DS_MLA_GROUPS)
_ROPE = tl.constexpr(DS_MLA_ROPE)
_SCALES_AT4 = tl.constexpr(DS_MLA_SCALES_AT // 4)  # in float32 words
_ROPE_AT2 = tl.constexpr(DS_MLA_ROPE_AT // 2)  # in bfloat16 words
_MIN_EXP = tl.constexpr(DS_MLA_MIN_EXP)
_MAX_EXP = tl.constexpr(DS_MLA_MAX_EXP)
DS_MLA_TOKENS = 16  # tokens per program of the fp8_ds_mla write and gather


@triton.jit
def _quantize_fp8(x, scale, SOFTWARE_ROUND: tl.constexpr):
    """x / scale clamped to +-448 (NaN stays NaN), ready for float8_e4m3fn (round to
    nearest even).

    SOFTWARE_ROUND (interpreter only): Triton 3.9's interpreter rounds fp32 -> fp8
    wrongly where the mantissa carries into the exponent (31.9 -> 16), so the value is
    first rounded onto the e4m3 grid here; the conversion is then exact. On the GPU the
    hardware conversion (round to nearest even, saturating) does it.
    """
    # Correctly rounded division, as torch's x / scale (bit-exact cache contents).
    y = tl.math.div_rn(x.to(tl.float32), scale)
    # Saturate, keeping NaN (plain min / max return the other operand for NaN).
    y = tl.maximum(y, -448.0, propagate_nan=tl.PropagateNan.ALL)
    y = tl.minimum(y, 448.0, propagate_nan=tl.PropagateNan.ALL)
    if SOFTWARE_ROUND:
        bits = y.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        # Spacing of e4m3 values near y: 3 mantissa bits, subnormal below 2^-6.
        ulp = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
        steps = tl.abs(y) / ulp  # exact (power of two), < 16
        steps = (steps + 8388608.0) - 8388608.0  # round half to even in float32
        y = tl.where(bits < 0, -steps, steps) * ulp  # sign bit: keeps -0.0
    return y


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["num_tokens"],
    do_not_specialize_on_alignment=["slot_ptr"])
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
    data [num_blocks, block_size, L + R]; fp8: x / scale clamped to +-448; fp8_ds_mla
    (uint8 data [num_blocks, block_size, 656]): entries as `pagedmla.cache` lays them
    out (`scale` unused)."""
    check_device(data, kv_c)
    num_tokens, L = kv_c.shape
    R = k_pe.shape[-1]
    if num_tokens == 0:
        return
    if data.dtype == DS_MLA_DTYPE:
        _write_ds_mla(data, kv_c, k_pe, slot_mapping)
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
def _context_rows(
    block_table_ptr, starts_ptr, cu_seq_lens_ptr, token_to_seq_ptr, stride_db, stride_dp,
    stride_bt, num_rows, PAGE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """Program pid(0)'s BLOCK_ROWS output rows of a gather, which of them exist, and each
    one's cache offset (block * stride_db + page offset * stride_dp): row r belongs to
    request j = token_to_seq[r] and is its context position starts[j] + r -
    cu_seq_lens[j]."""
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    seq = tl.load(token_to_seq_ptr + rows, mask=row_ok, other=0)
    pos = tl.load(starts_ptr + seq, mask=row_ok, other=0) + rows - tl.load(
        cu_seq_lens_ptr + seq, mask=row_ok, other=0)
    block = tl.load(block_table_ptr + seq.to(tl.int64) * stride_bt + pos // PAGE,
                    mask=row_ok, other=0).to(tl.int64)
    return rows, row_ok, block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "num_rows"],
    do_not_specialize_on_alignment=["block_table_ptr", "starts_ptr", "cu_seq_lens_ptr",
                                    "token_to_seq_ptr"])
def _gather_cache_kernel(
    data_ptr, scale_ptr, block_table_ptr, starts_ptr, cu_seq_lens_ptr, token_to_seq_ptr,
    out_ptr,
    stride_db, stride_dp, stride_bt, stride_ot, num_rows,
    W1: tl.constexpr, W2: tl.constexpr, BLOCK_W2: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, IS_FP8: tl.constexpr,
):
    """BLOCK_ROWS output rows (`_context_rows`), each W1 + W2 wide (W1 a power of two,
    W2 the rest: 576 = 512 + 64)."""
    rows, row_ok, src = _context_rows(
        block_table_ptr, starts_ptr, cu_seq_lens_ptr, token_to_seq_ptr, stride_db,
        stride_dp, stride_bt, num_rows, PAGE, BLOCK_ROWS)
    src += data_ptr
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
    """Copy context rows of a chunk into out [rows, L + R], dequantizing fp8 and
    fp8_ds_mla (uint8 data [num_blocks, page, 656]).

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
    if data.dtype == DS_MLA_DTYPE:
        _gather_ds_mla(data, block_table, starts, cu_seq_lens, token_to_seq, target)
    else:
        w1, w2 = split_pow2(width)
        block_rows = max(1, min(64, ROW_ELEMENTS // next_pow2(width)))
        _gather_cache_kernel[(cdiv(num_rows, block_rows),)](
            data, scale, block_table, starts, cu_seq_lens, token_to_seq, target,
            data.stride(0), data.stride(1), block_table.stride(0), target.stride(0),
            num_rows, W1=w1, W2=w2, BLOCK_W2=next_pow2(w2) if w2 else 1,
            PAGE=data.shape[1], BLOCK_ROWS=block_rows, IS_FP8=data.dtype == FP8_DTYPE,
            num_warps=CACHE_WARPS,
        )
    if target is not out:
        out.copy_(target)


@triton.jit
def _to_bf16(x, SOFTWARE_ROUND: tl.constexpr):
    """x (float32 or 16-bit) as bfloat16, rounded to nearest even. SOFTWARE_ROUND
    (interpreter only): Triton 3.9's interpreter truncates float32 -> bfloat16, so the
    value is rounded onto the bfloat16 grid here first (NaN kept as it is)."""
    if SOFTWARE_ROUND:
        x = x.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(tl.bfloat16)


@triton.jit
def _ds_mla_scale(x):
    """The fp8_ds_mla scale of each row of x [M, 128] float32: the smallest power of two
    >= amax / 448, clamped to [2^_MIN_EXP, 2^_MAX_EXP], NaN for a row holding a NaN."""
    ratio = tl.math.div_rn(tl.max(tl.abs(x), 1), 448.0)
    bits = ratio.to(tl.int32, bitcast=True)  # >= 0: exponent field, then mantissa
    exponent = (bits >> 23) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)  # ceil(log2)
    exponent = tl.minimum(tl.maximum(exponent, _MIN_EXP), _MAX_EXP)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    # (tl.max may pass over a NaN on the GPU: look for one.)
    has_nan = tl.max((x != x).to(tl.int32), 1) > 0
    return tl.where(has_nan, float("nan"), scale)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["num_tokens"],
    do_not_specialize_on_alignment=["slot_ptr"])
def _write_ds_mla_kernel(
    data_ptr, scales_ptr, rope_ptr, kv_c_ptr, k_pe_ptr, slot_ptr,
    stride_db, stride_dp, stride_ct, stride_pt, num_tokens,
    PAGE: tl.constexpr, BLOCK_T: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):
    """fp8_ds_mla entries of BLOCK_T tokens to their slots (slot -1 skipped). data_ptr,
    scales_ptr, rope_ptr: the cache as uint8, float32 and bfloat16 (one storage); the
    strides are in bytes."""
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens
    slot = tl.load(slot_ptr + toks, mask=tok_ok, other=-1).to(tl.int64)
    keep = tok_ok & (slot >= 0)
    row = (slot // PAGE) * stride_db + (slot % PAGE) * stride_dp  # bytes
    t = toks.to(tl.int64)
    cols = tl.arange(0, _GROUP)
    for g in tl.static_range(_GROUPS):
        x = tl.load(kv_c_ptr + t[:, None] * stride_ct + g * _GROUP + cols[None, :],
                    mask=keep[:, None], other=0.0).to(tl.float32)
        scale = _ds_mla_scale(x)
        codes = _quantize_fp8(x, scale[:, None], SOFTWARE_ROUND).to(tl.float8e4nv)
        tl.store(data_ptr + row[:, None] + g * _GROUP + cols[None, :],
                 codes.to(tl.uint8, bitcast=True), mask=keep[:, None])
        tl.store(scales_ptr + row // 4 + _SCALES_AT4 + g, scale, mask=keep)
    cols_r = tl.arange(0, _ROPE)
    y = tl.load(k_pe_ptr + t[:, None] * stride_pt + cols_r[None, :], mask=keep[:, None],
                other=0.0)
    tl.store(rope_ptr + (row // 2 + _ROPE_AT2)[:, None] + cols_r[None, :],
             _to_bf16(y, SOFTWARE_ROUND), mask=keep[:, None])


@triton.jit
def ds_mla_latent(data_ptr, scales_ptr, row, ok, START: tl.constexpr, WIDTH: tl.constexpr):
    """Latent values [START, START + WIDTH) of the fp8_ds_mla entries at byte offsets
    row [M] (int64) as float32 [M, WIDTH] (codes x their group's scale; START and WIDTH
    whole groups, WIDTH a power of two); rows where ok [M] is False come out 0 and are
    not read. One scale load per row and group, spread over its columns in registers."""
    cols = tl.arange(0, WIDTH)
    codes = tl.load(data_ptr + row[:, None] + START + cols[None, :], mask=ok[:, None], other=0)
    at = row // 4 + _SCALES_AT4 + START // _GROUP
    scale = tl.load(scales_ptr + at, mask=ok, other=0.0)[:, None]
    for g in tl.static_range(1, WIDTH // _GROUP):
        group = tl.load(scales_ptr + at + g, mask=ok, other=0.0)
        scale = tl.where(cols[None, :] >= g * _GROUP, group[:, None], scale)
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale


@triton.jit
def ds_mla_rope(rope_ptr, row, ok, BLOCK_R: tl.constexpr):
    """The rope values of the fp8_ds_mla entries at byte offsets row [M] as bfloat16
    [M, BLOCK_R] (columns past 64 and rows where ok is False 0)."""
    cols = tl.arange(0, BLOCK_R)
    return tl.load(rope_ptr + (row // 2 + _ROPE_AT2)[:, None] + cols[None, :],
                   mask=ok[:, None] & (cols[None, :] < _ROPE), other=0.0)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "num_rows"],
    do_not_specialize_on_alignment=["block_table_ptr", "starts_ptr", "cu_seq_lens_ptr",
                                    "token_to_seq_ptr"])
def _gather_ds_mla_kernel(
    data_ptr, scales_ptr, rope_ptr, block_table_ptr, starts_ptr, cu_seq_lens_ptr,
    token_to_seq_ptr, out_ptr, stride_db, stride_dp, stride_bt, stride_ot, num_rows,
    PAGE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
):
    """As _gather_cache_kernel for fp8_ds_mla entries (strides in bytes): out rows
    [latent (512) | rope (64)] in out's dtype."""
    rows, row_ok, src = _context_rows(
        block_table_ptr, starts_ptr, cu_seq_lens_ptr, token_to_seq_ptr, stride_db,
        stride_dp, stride_bt, num_rows, PAGE, BLOCK_ROWS)
    dst = out_ptr + rows.to(tl.int64) * stride_ot
    cols = tl.arange(0, _GROUP)
    for g in tl.static_range(_GROUPS):
        x = ds_mla_latent(data_ptr, scales_ptr, src, row_ok, g * _GROUP, _GROUP)
        tl.store(dst[:, None] + g * _GROUP + cols[None, :], x.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
    cols_r = tl.arange(0, _ROPE)
    y = ds_mla_rope(rope_ptr, src, row_ok, _ROPE)
    tl.store(dst[:, None] + _GROUPS * _GROUP + cols_r[None, :],
             y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def ds_mla_views(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8_ds_mla cache data [num_blocks, page, 656] (uint8) as float32 and bfloat16
    (the scales' and the rope values' pointers); ValueError where its strides are not
    whole float32 words."""
    if data.stride(-1) != 1 or data.stride(0) % 4 or data.stride(1) % 4:
        raise ValueError("an fp8_ds_mla cache needs a contiguous last dimension and strides "
                         f"of whole 4-byte words, got strides {data.stride()}")
    return data.view(torch.float32), data.view(torch.bfloat16)


def _write_ds_mla(data: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """write_cache for an fp8_ds_mla cache: kv_c [T, 512], k_pe [T, 64]."""
    if kv_c.shape[-1] != DS_MLA_LATENT or k_pe.shape[-1] != DS_MLA_ROPE:
        raise ValueError(f"an fp8_ds_mla cache stores kv_c [T, {DS_MLA_LATENT}] and k_pe "
                         f"[T, {DS_MLA_ROPE}], got {tuple(kv_c.shape)} and "
                         f"{tuple(k_pe.shape)}")
    scales, rope = ds_mla_views(data)
    kv_c = last_dim_contiguous(kv_c)
    k_pe = last_dim_contiguous(k_pe)
    _write_ds_mla_kernel[(cdiv(kv_c.shape[0], DS_MLA_TOKENS),)](
        data, scales, rope, kv_c, k_pe, slot_mapping,
        data.stride(0), data.stride(1), kv_c.stride(0), k_pe.stride(0), kv_c.shape[0],
        PAGE=data.shape[1], BLOCK_T=DS_MLA_TOKENS, SOFTWARE_ROUND=INTERPRETED,
        num_warps=CACHE_WARPS,
    )


def _gather_ds_mla(data: torch.Tensor, block_table: torch.Tensor, starts: torch.Tensor,
                   cu_seq_lens: torch.Tensor, token_to_seq: torch.Tensor,
                   out: torch.Tensor) -> None:
    """gather_cache for an fp8_ds_mla cache: out [rows, 576] (unit last stride)."""
    if out.shape[-1] != DS_MLA_LATENT + DS_MLA_ROPE:
        raise ValueError(f"out: an fp8_ds_mla cache gathers rows of "
                         f"{DS_MLA_LATENT + DS_MLA_ROPE} values, got {out.shape[-1]}")
    scales, rope = ds_mla_views(data)
    _gather_ds_mla_kernel[(cdiv(out.shape[0], DS_MLA_TOKENS),)](
        data, scales, rope, block_table, starts, cu_seq_lens, token_to_seq, out,
        data.stride(0), data.stride(1), block_table.stride(0), out.stride(0), out.shape[0],
        PAGE=data.shape[1], BLOCK_ROWS=DS_MLA_TOKENS, num_warps=CACHE_WARPS,
    )
