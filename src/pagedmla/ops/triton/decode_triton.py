"""Stage 1 of paged latent decode as a portable Triton kernel, and its per-regime configs.

Grid (head groups, programs): one program takes BLOCK_H query rows of one request (row
r is token r // N, head r % N) and one slice of its positions, a split (or a run of
splits one after another, in a persistent plan). Each [BLOCK_N, L + R] tile of cache
rows is loaded once and used by every row of the program: as keys (all L + R columns)
and, its first L columns, as values. That sharing across heads is what makes MQA decode
cheap in bytes. When a tile lies inside one page (page size a multiple of BLOCK_N) it is
copied in bulk by the tensor copy engine (TMA): one block-table lookup per tile, the
rows landing in shared memory where the MMAs read them. Other page sizes (1..128) gather
the rows through the block table one position at a time. L is handled as two halves
(the copy engine's boxes are at most 256 wide). Online softmax (base 2) accumulates
[BLOCK_H, L] in float32. With few heads per program the products are computed
transposed (SWAP_AB: positions fill the 64-row MMA of Hopper's wgmma instead of padding
16 heads to 64 rows).

An fp8_ds_mla cache (uint8 entries of 656 bytes, `pagedmla.cache`) is read by the row
gather: each tile's codes are multiplied by their rows' four group scales in registers
(`cache_ops.ds_mla_latent`) and the products run in q's dtype.

It runs on any GPU Triton supports and under the interpreter; on Hopper GPUs the Gluon
kernels take the calls they support (`selection`), fp8_ds_mla none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedmla.cache import DS_MLA_DTYPE, FP8_DTYPE
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    dot_precision,
    next_pow2,
    split_pow2,
    tiles_copyable,
)
from pagedmla.ops.triton.cache_ops import ds_mla_latent, ds_mla_rope, ds_mla_views
from pagedmla.ops.triton.split_plan import WORK_FIELDS, SplitPlan

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class DecodeConfig:
    """The portable kernel's launch parameters for one regime (query rows per request,
    cache dtype), and the split plan's bounds in that regime.

    block_h: query rows (heads x tokens) per program; block_n: positions per tile;
    min_chunk: fewest positions a split covers (bounds the partial-output traffic per
    byte of cache read); few_min_chunk: min_chunk instead for batches of at most
    FEW_REQUESTS requests (None: the same); programs_per_sm: programs one multiprocessor
    holds at once, for the split plan (these three bound the plan whichever stage-1
    kernel runs the regime); swap_ab: compute S^T = K Q^T and O^T = V^T P^T
    (positions as the MMA's M dimension), which suits few heads per program (see the
    kernel); paged: copy whole tiles with the bulk tensor copy engine (TMA) where the
    page size and layout allow (see `_page_descriptors`), else gather rows through the
    block table; prefetch: with bulk copies on a GPU, ask L2 for the tile this many
    tiles ahead (0: off).
    """

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int
    min_chunk: int
    programs_per_sm: int
    swap_ab: bool = False
    paged: bool = True
    prefetch: int = 0
    few_min_chunk: int | None = None

    def min_chunk_for(self, num_reqs: int) -> int:
        """min_chunk for a batch of num_reqs requests: few_min_chunk for at most
        FEW_REQUESTS of them, which would otherwise leave SMs idle (a host int, fixed in
        a CUDA graph, so the choice is graph-safe)."""
        if self.few_min_chunk is not None and num_reqs <= FEW_REQUESTS:
            return self.few_min_chunk
        return self.min_chunk


# Keyed by regime (`pick_config`); tuned with `python -m benchmarks.bench_kernels
# --sweep-configs decode` (CUDA-graph replays, 64-token pages so that tiles are copied in
# bulk), and any variant can be run by passing `config=` to `decode.mla_decode`:
# * rows16 (N * q_len <= 16, memory-bound): the swapped products (wgmma with M = 64
#   positions), one warpgroup, two stages of 64-position tiles (168 KB of shared memory).
# * rows32: the same form.
# * rows64 (N >= 64): the direct form; the [64, 512] float32 accumulator needs 8 warps
#   (128 registers per thread); two stages of 64-position tiles plus q fill 221 KB.
# * prefetch: with two stages only one tile per SM is in flight; asking L2 for the tile
#   `prefetch` tiles ahead keeps more in flight (off for rows32).
# * fp8: the tile is widened to float16 in registers, which the direct form with 8 warps
#   does with the fewest spills; with 64 rows the row gather beats the bulk copies.
# * min_chunk, few_min_chunk and programs_per_sm bound the split plan in their regime
#   whichever kernel runs it (the Gluon kernels too, `selection`): 128 positions (two
#   tiles) for rows32 and rows64, so that one short request still spreads over the SMs;
#   256 for rows16 but for one or two requests (few_min_chunk, 128).
DECODE_CONFIGS: dict[str, DecodeConfig] = {
    "rows16": DecodeConfig(16, 64, 4, 2, 256, 1, swap_ab=True, prefetch=1,
                           few_min_chunk=128),
    "rows16-fp8": DecodeConfig(16, 64, 8, 2, 256, 1, prefetch=2,
                               few_min_chunk=128),
    "rows32": DecodeConfig(32, 64, 4, 2, 128, 1, swap_ab=True),
    "rows32-fp8": DecodeConfig(32, 64, 8, 2, 128, 1),
    "rows64": DecodeConfig(64, 64, 8, 2, 128, 1, prefetch=2),
    "rows64-fp8": DecodeConfig(64, 64, 8, 2, 128, 1, paged=False),
    # float32 q (tests, fp32 models): exact IEEE dots on CUDA cores; small tiles.
    "fp32": DecodeConfig(16, 16, 4, 1, 256, 2),
}
FEW_REQUESTS = 2  # batches this small use a config's few_min_chunk


def quantized(data: torch.Tensor) -> bool:
    """Whether the cache data is fp8 (per-tensor scale) or fp8_ds_mla: the regimes'
    "-fp8" configs run them."""
    return data.dtype in (FP8_DTYPE, DS_MLA_DTYPE)


def pick_config(num_rows: int, dtype: torch.dtype, is_fp8: bool = False) -> DecodeConfig:
    """The regime's config for `num_rows` = N * max_query_len query rows per request, q
    of `dtype` and an fp8 or fp8_ds_mla cache (`quantized`) or not."""
    if dtype == torch.float32:
        return DECODE_CONFIGS["fp32"]
    rows = next_pow2(num_rows)
    key = "rows16" if rows <= 16 else "rows32" if rows <= 32 else "rows64"
    return DECODE_CONFIGS[key + ("-fp8" if is_fp8 else "")]


@triton.jit
def _load_split(work_ptr, split):
    """(request, lo, hi, the request's split count, seq_len, first token, q_len, the
    index of its partial on the partial buffer's split axis) from row `split` of a
    split plan's work."""
    row = work_ptr + WORK_FIELDS * split
    return (tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3),
            tl.load(row + 4), tl.load(row + 5), tl.load(row + 6), tl.load(row + 7))


@triton.jit
def _to_compute(x, compute_dtype: tl.constexpr):
    """x in the products' dtype; a bf16 q bound for float16 (fp8 cache) is clamped to
    float16's range first (an inf would turn the softmax into NaN)."""
    if x.dtype != compute_dtype:
        if compute_dtype == tl.float16:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0)
        x = x.to(compute_dtype)
    return x


@triton.jit
def load_rows(
    rows, ok, compute_dtype: tl.constexpr, L: tl.constexpr, R: tl.constexpr,
    HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Cache rows of L + R values at the pointers rows [M]: the latent halves [M, HALF_L]
    x 2 and the rope part [M, BLOCK_R], widened to compute_dtype. Rows where ok [M] is
    False come out zero and are not read: their slots may hold NaN."""
    cols = tl.arange(0, HALF_L)
    kv_a = tl.load(rows[:, None] + cols[None, :], mask=ok[:, None] & (cols[None, :] < L),
                   other=0.0)
    kv_b = tl.load(rows[:, None] + HALF_L + cols[None, :],
                   mask=ok[:, None] & (cols[None, :] + HALF_L < L), other=0.0)
    k_pe = kv_a  # placeholder when R == 0
    if R > 0:
        cols_r = tl.arange(0, BLOCK_R)
        k_pe = tl.load(rows[:, None] + L + cols_r[None, :],
                       mask=ok[:, None] & (cols_r[None, :] < R), other=0.0)
    return kv_a.to(compute_dtype), kv_b.to(compute_dtype), k_pe.to(compute_dtype)


@triton.jit
def load_ds_mla_rows(
    data_ptr, scales_ptr, rope_ptr, row, ok, compute_dtype: tl.constexpr,
    HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """load_rows for the fp8_ds_mla entries at byte offsets row [M] (L = 512, R = 64):
    the latent halves dequantized (codes x their group's scale) and the bfloat16 rope
    part, rows where ok is False zero and not read, in compute_dtype."""
    kv_a = ds_mla_latent(data_ptr, scales_ptr, row, ok, 0, HALF_L)
    kv_b = ds_mla_latent(data_ptr, scales_ptr, row, ok, HALF_L, HALF_L)
    k_pe = ds_mla_rope(rope_ptr, row, ok, BLOCK_R)
    return kv_a.to(compute_dtype), kv_b.to(compute_dtype), k_pe.to(compute_dtype)


@triton.jit
def _gather_tile(
    data_ptr, table_row, start, hi, stride_db, stride_dp, compute_dtype: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Cache rows of positions [start, start + BLOCK_N) below hi, found through the block
    table one position at a time (any page size), as `load_rows` returns them."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_ok = pos < hi
    block = tl.load(table_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
    rows = data_ptr + block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp
    return load_rows(rows, pos_ok, compute_dtype, L, R, HALF_L, BLOCK_R)


@triton.jit
def _gather_ds_mla_tile(
    data_ptr, scales_ptr, rope_ptr, table_row, start, hi, stride_db, stride_dp,
    compute_dtype: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """_gather_tile for fp8_ds_mla entries (strides in bytes), as `load_ds_mla_rows`
    returns them."""
    pos = start + tl.arange(0, BLOCK_N)
    pos_ok = pos < hi
    block = tl.load(table_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
    row = block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp
    return load_ds_mla_rows(data_ptr, scales_ptr, rope_ptr, row, pos_ok, compute_dtype,
                            HALF_L, BLOCK_R)


@triton.jit
def _paged_tile(
    latent_desc, rope_desc, table_row, start, hi, compute_dtype: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF_L: tl.constexpr, MASKED: tl.constexpr,
):
    """The same tile as _gather_tile when it lies inside one page (PAGE % BLOCK_N == 0):
    one block-table lookup and three bulk tensor copies (TMA) of contiguous rows.
    MASKED zeroes rows at or past hi (the last, partial tile of a slice: its slots may
    hold NaN, and 0 x NaN would reach the output)."""
    # Descriptor coordinates are int32: the cache holds fewer than 2**31 rows.
    row = tl.load(table_row + start // PAGE) * PAGE + start % PAGE
    kv_a = latent_desc.load([row, 0]).to(compute_dtype)
    kv_b = latent_desc.load([row, HALF_L]).to(compute_dtype)
    k_pe = kv_a
    if R > 0:
        k_pe = rope_desc.load([row, L]).to(compute_dtype)
    if MASKED:
        keep = (start + tl.arange(0, BLOCK_N) < hi)[:, None]
        kv_a = tl.where(keep, kv_a, 0.0)
        kv_b = tl.where(keep, kv_b, 0.0)
        if R > 0:
            k_pe = tl.where(keep, k_pe, 0.0)
    return kv_a, kv_b, k_pe


@triton.jit
def _prefetch_tile(data_ptr, table_row, start, stride_db, stride_dp, PAGE: tl.constexpr,
                   LINES: tl.constexpr, REST: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for the tile at `start` (LINES + REST lines of LINE elements from its first
    row; the tile is contiguous inside its page). Fire and forget: no register waits on
    it, and the bulk copy of that tile later finds it in L2."""
    block = tl.load(table_row + start // PAGE).to(tl.int64)
    base = data_ptr + block * stride_db + (start % PAGE).to(tl.int64) * stride_dp
    _prefetch_l2(base + tl.arange(0, LINES).to(tl.int64) * LINE)
    if REST > 0:
        _prefetch_l2(base + (LINES + tl.arange(0, REST)).to(tl.int64) * LINE)


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _attend_tile(
    acc_a, acc_b, m_i, l_i, kv_a, kv_b, k_pe, q_a, q_b, q_pe, visible, qk_scale,
    R: tl.constexpr, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """One online-softmax step (base 2) over a tile of cache rows for BLOCK_H query rows.

    Keys are all L + R columns of the tile, values its first L (the two latent halves):
    each row is read once and used by every query row. Direct form: scores [BLOCK_H,
    BLOCK_N], acc_* [BLOCK_H, HALF_L], q_* row-major. SWAP_AB: the transposed products
    S^T = K Q^T [BLOCK_N, BLOCK_H] and O^T += V^T P^T [HALF_L, BLOCK_H] with q_*
    transposed: positions (and L) become the MMA's M dimension, so with few heads the
    tile still fills Hopper's 64-row wgmma and the cache tile is the A operand in both
    products, while heads are the narrow N dimension.
    """
    if SWAP_AB:
        s = tl.dot(kv_a, q_a, input_precision=PRECISION)
        s = tl.dot(kv_b, q_b, s, input_precision=PRECISION)
        if R > 0:
            s = tl.dot(k_pe, q_pe, s, input_precision=PRECISION)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        # A row with nothing visible yet keeps m = -inf: shift by 0 so exp2 gives 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        p = p.to(kv_a.dtype)
        acc_a = tl.dot(tl.trans(kv_a), p, acc_a * alpha[None, :], input_precision=PRECISION)
        acc_b = tl.dot(tl.trans(kv_b), p, acc_b * alpha[None, :], input_precision=PRECISION)
    else:
        s = tl.dot(q_a, tl.trans(kv_a), input_precision=PRECISION)
        s = tl.dot(q_b, tl.trans(kv_b), s, input_precision=PRECISION)
        if R > 0:
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(kv_a.dtype)
        acc_a = tl.dot(p, kv_a, acc_a * alpha[:, None], input_precision=PRECISION)
        acc_b = tl.dot(p, kv_b, acc_b * alpha[:, None], input_precision=PRECISION)
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _visible(pos, hi, limit, SWAP_AB: tl.constexpr):
    """Which (position, row) pairs count: inside the slice and causally visible."""
    if SWAP_AB:
        visible = (pos < hi)[:, None] & (pos[:, None] < limit[None, :])
    else:
        visible = (pos < hi)[None, :] & (pos[None, :] < limit[:, None])
    return visible


@triton.jit
def _paged_step(
    acc_a, acc_b, m_i, l_i, latent_desc, rope_desc, table_row, start, hi, limit,
    q_a, q_b, q_pe, qk_scale, compute_dtype: tl.constexpr, L: tl.constexpr,
    R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HALF_L: tl.constexpr,
    MASKED: tl.constexpr, PRECISION: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """Copy the tile at `start` in bulk and fold it into (acc_a, acc_b, m_i, l_i)."""
    kv_a, kv_b, k_pe = _paged_tile(latent_desc, rope_desc, table_row, start, hi,
                                   compute_dtype, L, R, PAGE, BLOCK_N, HALF_L, MASKED)
    visible = _visible(start + tl.arange(0, BLOCK_N), hi, limit, SWAP_AB)
    return _attend_tile(acc_a, acc_b, m_i, l_i, kv_a, kv_b, k_pe, q_a, q_b, q_pe, visible,
                        qk_scale, R, PRECISION, SWAP_AB)


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "stride_lh", "num_partials"],
    do_not_specialize_on_alignment=["block_table_ptr"])
def _decode_partial_kernel(
    q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, ds_scales_ptr, ds_rope_ptr,
    block_table_ptr, work_ptr, starts_ptr, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_db, stride_dp,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_heads, num_partials, softmax_scale,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF_L: tl.constexpr,
    BLOCK_R: tl.constexpr, IS_FP8: tl.constexpr, DS_MLA: tl.constexpr,
    PRECISION: tl.constexpr, SWAP_AB: tl.constexpr, PAGED: tl.constexpr,
    COMPUTE: tl.constexpr, PREFETCH: tl.constexpr, PF_LINES: tl.constexpr,
    PF_REST: tl.constexpr, PF_LINE: tl.constexpr,
):
    """One head group of the splits starts[p] .. starts[p + 1] - 1 (p = program_id(1))
    of the split plan's work [num_partials, WORK] (`split_plan`), one after the other:
    out [BLOCK_H, L] and lse over each split's positions (`_decode_split`).
    PAGED: tiles come as bulk copies through latent_desc / rope_desc (host tensor
    descriptors over the cache viewed as [pages x PAGE, L + R]); otherwise gathered
    through data_ptr (DS_MLA: fp8_ds_mla entries, their scales and rope values through
    ds_scales_ptr and ds_rope_ptr, views of the same bytes). A request in one split
    gets its final out [T, N, L] (q dtype) and lse [N, T] through (stride_ot,
    stride_oh) and (stride_lt, stride_lh); a cut one float32 partials, at row (token x N
    + head) x num_partials + the split's partial index (field 7) of part [.., L] and
    part_lse (a row's splits adjacent); a row whose split holds no visible key gets lse
    -inf and no output (the combine never reads it).
    """
    program = tl.program_id(1)
    for split in range(tl.load(starts_ptr + program), tl.load(starts_ptr + program + 1)):
        _decode_split(
            q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, ds_scales_ptr, ds_rope_ptr,
            block_table_ptr, work_ptr, split, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
            stride_qt, stride_qh, stride_db, stride_dp, stride_bt, stride_ot, stride_oh,
            stride_lt, stride_lh, num_heads, num_partials, softmax_scale, L, R, PAGE,
            BLOCK_H, BLOCK_N, HALF_L, BLOCK_R, IS_FP8, DS_MLA, PRECISION, SWAP_AB, PAGED,
            COMPUTE, PREFETCH, PF_LINES, PF_REST, PF_LINE)


@triton.jit
def _decode_split(
    q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, ds_scales_ptr, ds_rope_ptr,
    block_table_ptr, work_ptr, split, out_ptr, lse_ptr, part_ptr, part_lse_ptr, stride_qt,
    stride_qh, stride_db, stride_dp, stride_bt, stride_ot, stride_oh, stride_lt, stride_lh,
    num_heads, num_partials, softmax_scale, L: tl.constexpr, R: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF_L: tl.constexpr,
    BLOCK_R: tl.constexpr, IS_FP8: tl.constexpr, DS_MLA: tl.constexpr,
    PRECISION: tl.constexpr, SWAP_AB: tl.constexpr, PAGED: tl.constexpr,
    COMPUTE: tl.constexpr,
    PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, PF_REST: tl.constexpr,
    PF_LINE: tl.constexpr,
):
    """Head group program_id(0) of work row `split` (see `_decode_partial_kernel`)."""
    group = tl.program_id(0)
    req, lo, hi, splits, seq_len, q_begin, q_len, partial = _load_split(work_ptr, split)
    num_rows = q_len * num_heads

    rows = group * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < num_rows
    tok = rows // num_heads
    head = rows % num_heads
    # Bottom-right causal: token t of q_len sees positions < seq_len - q_len + t + 1.
    limit = seq_len - q_len + tok + 1

    # The program's last valid row has the largest limit; nothing past it is needed.
    last_tok = (tl.minimum(group * BLOCK_H + BLOCK_H, num_rows) - 1) // num_heads
    hi = tl.minimum(hi, seq_len - q_len + last_tok + 1)
    hi = tl.where(group * BLOCK_H < num_rows, hi, lo)

    cols = tl.arange(0, HALF_L)
    q_rows = q_ptr + (q_begin + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_a = tl.load(q_rows[:, None] + cols[None, :],
                  mask=row_ok[:, None] & (cols[None, :] < L), other=0.0)
    q_b = tl.load(q_rows[:, None] + HALF_L + cols[None, :],
                  mask=row_ok[:, None] & (cols[None, :] + HALF_L < L), other=0.0)
    q_a = _to_compute(q_a, COMPUTE)
    q_b = _to_compute(q_b, COMPUTE)
    q_pe = q_a  # placeholder when R == 0
    if R > 0:
        cols_r = tl.arange(0, BLOCK_R)
        q_pe = tl.load(q_rows[:, None] + L + cols_r[None, :],
                       mask=row_ok[:, None] & (cols_r[None, :] < R), other=0.0)
        q_pe = _to_compute(q_pe, COMPUTE)
    if SWAP_AB:
        q_a = tl.trans(q_a)
        q_b = tl.trans(q_b)
        q_pe = tl.trans(q_pe)
        acc_a = tl.zeros([HALF_L, BLOCK_H], tl.float32)
    else:
        acc_a = tl.zeros([BLOCK_H, HALF_L], tl.float32)
    acc_b = tl.zeros_like(acc_a)

    # Scores in base 2: exp2 is the native instruction. An fp8 cache stores x / scale,
    # so the per-tensor scale multiplies the scores here and the output at the end.
    qk_scale = softmax_scale * 1.4426950408889634
    if IS_FP8:
        kv_scale = tl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    table_row = block_table_ptr + req.to(tl.int64) * stride_bt
    if PAGED:
        # Whole tiles need no mask (every row is a written slot below hi); only the
        # last, partial tile is zeroed past hi, which takes it through registers. Where
        # it goes is a register-allocation choice per form: first in the swapped form
        # (the accumulators are still empty there, which keeps ptxas from spilling
        # inside the loop), last in the direct form (the faster there).
        full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
        if SWAP_AB and full_hi < hi:
            acc_a, acc_b, m_i, l_i = _paged_step(
                acc_a, acc_b, m_i, l_i, latent_desc, rope_desc, table_row, full_hi, hi,
                limit, q_a, q_b, q_pe, qk_scale, COMPUTE, L, R, PAGE, BLOCK_N, HALF_L,
                True, PRECISION, SWAP_AB)
        for start in range(lo, full_hi, BLOCK_N):
            if PREFETCH > 0:
                # PREFETCH tiles ahead (the last whole tile again near the end: any tile
                # below full_hi is a valid page, and a repeat costs one L2 hit).
                ahead = tl.minimum(start + PREFETCH * BLOCK_N, full_hi - BLOCK_N)
                _prefetch_tile(data_ptr, table_row, ahead, stride_db, stride_dp, PAGE,
                               PF_LINES, PF_REST, PF_LINE)
            acc_a, acc_b, m_i, l_i = _paged_step(
                acc_a, acc_b, m_i, l_i, latent_desc, rope_desc, table_row, start, hi,
                limit, q_a, q_b, q_pe, qk_scale, COMPUTE, L, R, PAGE, BLOCK_N, HALF_L,
                False, PRECISION, SWAP_AB)
        if not SWAP_AB and full_hi < hi:
            acc_a, acc_b, m_i, l_i = _paged_step(
                acc_a, acc_b, m_i, l_i, latent_desc, rope_desc, table_row, full_hi, hi,
                limit, q_a, q_b, q_pe, qk_scale, COMPUTE, L, R, PAGE, BLOCK_N, HALF_L,
                True, PRECISION, SWAP_AB)
    else:
        for start in range(lo, hi, BLOCK_N):
            if DS_MLA:
                kv_a, kv_b, k_pe = _gather_ds_mla_tile(
                    data_ptr, ds_scales_ptr, ds_rope_ptr, table_row, start, hi, stride_db,
                    stride_dp, COMPUTE, PAGE, BLOCK_N, HALF_L, BLOCK_R)
            else:
                kv_a, kv_b, k_pe = _gather_tile(data_ptr, table_row, start, hi, stride_db,
                                                stride_dp, COMPUTE, L, R, PAGE, BLOCK_N,
                                                HALF_L, BLOCK_R)
            visible = _visible(start + tl.arange(0, BLOCK_N), hi, limit, SWAP_AB)
            acc_a, acc_b, m_i, l_i = _attend_tile(
                acc_a, acc_b, m_i, l_i, kv_a, kv_b, k_pe, q_a, q_b, q_pe, visible,
                qk_scale, R, PRECISION, SWAP_AB)
    if SWAP_AB:
        acc_a = tl.trans(acc_a)
        acc_b = tl.trans(acc_b)

    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    norm = 1.0 / tl.where(has_key, l_i, 1.0)
    if IS_FP8:
        norm = norm * kv_scale
    out_a = acc_a * norm[:, None]
    out_b = acc_b * norm[:, None]
    log_l = tl.math.log2(tl.where(has_key, l_i, 1.0))
    lse = tl.where(has_key, (m_i + log_l) * 0.6931471805599453, float("-inf"))  # natural log

    if splits == 1:
        token = (q_begin + tok).to(tl.int64)
        out_rows = out_ptr + token * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_rows[:, None] + cols[None, :], out_a.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < L))
        tl.store(out_rows[:, None] + HALF_L + cols[None, :],
                 out_b.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] + HALF_L < L))
        tl.store(lse_ptr + token * stride_lt + head.to(tl.int64) * stride_lh, lse, mask=row_ok)
    else:
        at = rows.to(tl.int64) * num_partials + partial
        store_ok = (row_ok & has_key)[:, None]
        tl.store(part_ptr + at[:, None] * L + cols[None, :], out_a,
                 mask=store_ok & (cols[None, :] < L))
        tl.store(part_ptr + at[:, None] * L + HALF_L + cols[None, :], out_b,
                 mask=store_ok & (cols[None, :] + HALF_L < L))
        tl.store(part_lse_ptr + at, lse, mask=row_ok)


def _page_descriptors(
    data: torch.Tensor, block_n: int, half_l: int, block_r: int, L: int
) -> tuple[TensorDescriptor, TensorDescriptor] | None:
    """Tensor descriptors for bulk tile copies, or None where the layout rules them out.

    Beyond `tiles_copyable`, the latent must split into two power-of-two halves of at
    most 256 columns (the copy engine's box). The cache is viewed as [pages x
    page_size, L + R] rows.
    """
    if not tiles_copyable(data, block_n) or 2 * half_l != L or half_l > 256 or block_r > 256:
        return None
    num_blocks, page, width = data.shape
    rows = [num_blocks * page, width]
    strides = [data.stride(1), 1]
    return (TensorDescriptor(data, rows, strides, [block_n, half_l]),
            TensorDescriptor(data, rows, strides, [block_n, block_r]))


def decode_partial(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
    part_lse: torch.Tensor, head_groups: int, softmax_scale: float, L: int,
    config: DecodeConfig,
) -> None:
    """Launch stage 1 with `config` (its block_h the rows per program): grid
    (head_groups, plan.programs), the splits of the split plan, several per program in a
    persistent plan.

    q [T, N, L + R]; data [num_blocks, page, L + R] (q's dtype, or fp8 scaled by `scale`
    [] float32), or fp8_ds_mla entries uint8 [num_blocks, page, 656] (L = 512, R = 64;
    gathered row by row whatever `config.paged` says); out [T, N, L] and lse [N, T] for
    requests in one split, part_out [.., plan.rows, L] and part_lse float32 for the
    others' partials (as `decode.mla_decode`)."""
    num_heads = q.shape[1]
    R = q.shape[2] - L
    is_fp8 = data.dtype == FP8_DTYPE
    ds_mla = data.dtype == DS_MLA_DTYPE
    block_n = config.block_n
    # fp8 widens to float16 (one instruction per two values; e4m3 is exact in float16)
    # and the 16-bit q is rounded to float16 too; float32 q keeps float32 products.
    # fp8_ds_mla's dequantized values (e4m3 x a power of two up to 2^127) need q's range:
    # products in q's dtype (bf16 holds them exactly).
    compute = _TL_DTYPES[torch.float16 if is_fp8 and q.dtype != torch.float32 else q.dtype]
    ds_views = ds_mla_views(data) if ds_mla else (data, data)

    half_l = max(32, next_pow2(L)) // 2
    block_r = max(16, next_pow2(R)) if R > 0 else 16
    paged = config.paged and not ds_mla
    descs = _page_descriptors(data, block_n, half_l, block_r, L) if paged else None
    # L2 prefetch of tiles ahead (inline PTX: GPU only, and only with bulk copies).
    prefetch = config.prefetch if descs is not None and not INTERPRETED else 0
    pf_line = 128 // data.element_size()  # elements per 128-byte line
    pf_lines, pf_rest = split_pow2(cdiv(block_n * data.stride(1), pf_line))
    pf_rest = next_pow2(pf_rest) if pf_rest else 0
    _decode_partial_kernel[(head_groups, plan.programs)](
        q, data, *(descs or (None, None)), scale, *ds_views, block_table, plan.work,
        plan.starts, out, lse, part_out, part_lse,
        q.stride(0), q.stride(1), data.stride(0), data.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(1), lse.stride(0),
        num_heads, plan.rows, float(softmax_scale),
        L=L, R=R, PAGE=data.shape[1], BLOCK_H=config.block_h, BLOCK_N=block_n,
        HALF_L=half_l, BLOCK_R=block_r, IS_FP8=is_fp8, DS_MLA=ds_mla,
        PRECISION=dot_precision(q.dtype),
        SWAP_AB=config.swap_ab, PAGED=descs is not None, COMPUTE=compute,
        PREFETCH=prefetch, PF_LINES=pf_lines, PF_REST=pf_rest, PF_LINE=pf_line,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
