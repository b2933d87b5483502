"""Paged latent decode (absorbed MQA) with split-KV, in two Triton kernels.

Stage 1 (`_decode_partial_kernel`), grid (head groups, programs): one program takes
BLOCK_H query rows of one request (row r is token r // N, head r % N) and one slice of
its positions, a piece (or a run of pieces one after another, in a persistent plan).
Each [BLOCK_N, L + R] tile of cache rows is loaded once and used by every row of the
program: as keys (all L + R columns) and, its first L columns, as values. That sharing
across heads is what makes MQA decode cheap in bytes. When a tile lies inside one page
(page size a multiple of BLOCK_N) it is copied in bulk by the tensor copy engine (TMA):
one block-table lookup per tile, the rows landing in shared memory where the MMAs read
them. Other page sizes (1..128) gather the rows through the block table one position at
a time. L is handled as two halves (the copy engine's boxes are at most 256 wide).
Online softmax (base 2) accumulates [BLOCK_H, L] in float32. With few heads per program
the products are computed transposed (SWAP_AB: positions fill the 64-row MMA of Hopper's
wgmma instead of padding 16 heads to 64 rows).

On a Hopper GPU, stage 1 runs as a warp-specialized Gluon kernel instead, with the same
outputs: `decode_hopper` for at most 16 query rows per request (the memory-bound
regime; `decode_hopper_fp8` with an fp8 cache, up to 32 rows in two head groups),
`decode_hopper_heads` for more (64 rows per program). A producer
warp streams the tiles while warpgroups compute, which plain Triton's software pipeline
cannot express (see those modules).

Stage 2 (`_decode_combine_kernel`) folds the splits of each (token, head) by
log-sum-exp, all splits of a column block in one load. With one split, stage 1 writes
the final output and stage 2 is skipped.

How each request is cut into pieces (split-KV) is planned on the device from the
actual lengths (`split_plan`): one tiny kernel, no value read back, so a decode step never
synchronises and can be captured in a CUDA graph, and the plan follows the lengths of
every replay. Stage 1's grid is (head groups, programs), each program's pieces given by
the plan; a request left whole gets its final output from stage 1, and the combine
skips it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.triton._utils import (
    GRID_YZ_MAX,
    INTERPRETED,
    cdiv,
    check_device,
    dot_precision,
    gluon_modules,
    last_dim_contiguous,
    multiprocessor_count,
    next_pow2,
    split_pow2,
)
from pagedmla.ops.triton.split_plan import LONE_WAVE, WORK_FIELDS, plan_splits
from pagedmla.validation import positive_finite

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16,
              torch.bfloat16: tl.bfloat16}


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1 for one regime (rows per program, cache dtype).

    block_h: query rows (heads x tokens) per program; block_n: positions per tile;
    min_chunk: fewest positions a piece covers (bounds the partial-output traffic per
    byte of cache read); few_min_chunk: min_chunk instead for batches of at most
    FEW_REQUESTS requests (None: the same); programs_per_sm: programs one multiprocessor
    holds at once, for the split plan; swap_ab: compute S^T = K Q^T and O^T = V^T P^T
    (positions as the MMA's M dimension), which suits few heads per program (see the
    kernel); paged: copy whole tiles with the bulk tensor copy engine (TMA) where the
    page size and layout allow (see `_page_descriptors`), else gather rows through the
    block table; prefetch: with bulk copies on a GPU, ask L2 for the tile this many
    tiles ahead (0: off); hopper: on a Hopper GPU, run stage 1 as the warp-specialized
    Gluon kernel that supports the call (`hopper_kernel`; else this config's Triton
    kernel).
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
    hopper: bool = False
    few_min_chunk: int | None = None

    def min_chunk_for(self, num_reqs: int) -> int:
        """min_chunk for a batch of num_reqs requests: few_min_chunk for at most
        FEW_REQUESTS of them, which would otherwise leave SMs idle (a host int, fixed in
        a CUDA graph, so the choice is graph-safe)."""
        if self.few_min_chunk is not None and num_reqs <= FEW_REQUESTS:
            return self.few_min_chunk
        return self.min_chunk


# Keyed by regime; try variants by passing `config=` (`benchmarks/bench_kernels.py
# --sweep-configs decode` times a set of them). Chosen from sweeps on an H200 (Triton
# 3.6, CUDA-graph replay, 64-token pages so that tiles are copied in bulk):
# * rows16 (N * q_len <= 16, memory-bound): swapped products (wgmma with M = 64
#   positions), one warpgroup, two stages of 64-position tiles (168 KB of shared
#   memory): 3.2 TB/s at B = 128, N = 16, 8k; 8 warps 2.4, the direct form 3.0, the
#   row gather 2.4.
# * rows32: the same form: 2.66 TB/s at B = 128, N = 32, 8k (8 warps: 1.78).
# * rows64 (N >= 64): direct form; the [64, 512] float32 accumulator needs 8 warps
#   (128 registers per thread); two stages of 64-position tiles plus q fill 221 KB:
#   273-287 TFLOP/s at N = 128, B = 64-128, 4k-8k.
# * prefetch: with two stages only one tile per SM is in flight; asking L2 for the tile
#   `prefetch` tiles ahead adds more: rows16 379 -> 344 us at B = 128, 8k (1 ahead; 2 and
#   3 ahead were slower), rows64 267 -> 253 us at B = 64, N = 128, 4k (2 ahead), fp8
#   rows16 504 -> 472 us (2 ahead). Not measured for rows32: off there.
# * fp8: the tile is widened to float16 in registers, which the direct form with 8
#   warps does with the fewest spills; still slower than bf16 (see docs/PERFORMANCE.md).
#   With 64 rows the bulk copies lose to the gather (340 vs 621 us at B = 64, 4k).
# * hopper: the Gluon kernels replace these on Hopper GPUs. rows16 (`decode_hopper`, fp8
#   `decode_hopper_fp8`): B = 128, N = 16, 8k: bf16 344 -> 280 us (4.3 TB/s), fp8 471 ->
#   266 us (then widening e4m3 tiles; products on e4m3 codes: 231 us, two consumers:
#   173 us, P V^T on 32 columns and one q load: 166 us). rows32 and
#   rows64 (`decode_hopper_heads`, 64 rows per program, so 32 rows pad to 64): N = 128,
#   B = 64 x 4k 250 -> 146 us (501 TFLOP/s), B = 128 x 8k 1010 -> 544 us; N = 32, B =
#   128 x 8k 457 -> 306 us (4.0 TB/s); N = 16 x q_len 2 464 -> 302 us; fp8 (rows widened
#   from registers into 64-position tiles) N = 128, B = 64 x 4k 337 -> 207 us, N = 32
#   683 -> 393 us.
# * min_chunk of rows64 and rows32: 128 positions (two tiles), where 512 (rows64) left
#   SMs idle on one short request: B = 1, N = 128 at 4k 30.3 -> 24.1 us, 16k 35.1 ->
#   30.0, fp8 16k 40.7 -> 31.7; B = 4 x 4k 33.2 -> 29.1; 32k and longer unchanged (64
#   would gain another 0.6 us at 4k only). rows32 against its 256: B = 1, N = 32, 8k
#   22.4 -> 20.9, B = 4 x 4k unchanged (rows32-fp8, the same kernel, not timed). rows16
#   keeps 256 (128 is 1.5-2.5% slower at B = 4 x 8k) except for one or two requests
#   (few_min_chunk), where 128 is 4-14% faster: bf16 B = 1 x 8k 18.2 -> 16.5 us, fp8
#   20.5 -> 17.7, B = 2 x 8k 20.5 -> 19.6.
DECODE_CONFIGS: dict[str, DecodeConfig] = {
    "rows16": DecodeConfig(16, 64, 4, 2, 256, 1, swap_ab=True, prefetch=1, hopper=True,
                           few_min_chunk=128),
    "rows16-fp8": DecodeConfig(16, 64, 8, 2, 256, 1, prefetch=2, hopper=True,
                               few_min_chunk=128),
    "rows32": DecodeConfig(32, 64, 4, 2, 128, 1, swap_ab=True, hopper=True),
    "rows32-fp8": DecodeConfig(32, 64, 8, 2, 128, 1, hopper=True),
    "rows64": DecodeConfig(64, 64, 8, 2, 128, 1, prefetch=2, hopper=True),
    "rows64-fp8": DecodeConfig(64, 64, 8, 2, 128, 1, paged=False, hopper=True),
    # float32 q (tests, fp32 models): exact IEEE dots on CUDA cores; small tiles.
    "fp32": DecodeConfig(16, 16, 4, 1, 256, 2),
}
FEW_REQUESTS = 2  # batches this small use a config's few_min_chunk
COMBINE_ELEMENTS = 4096  # splits x columns per combine program
COMBINE_WARPS = 4
COMBINE_PROGRAMS_PER_SM = 32  # the combine grid's cap (`combine_entries`)


def pick_config(num_rows: int, dtype: torch.dtype, is_fp8: bool = False) -> DecodeConfig:
    """The stage-1 config for `num_rows` = N * max_query_len query rows per request."""
    if dtype == torch.float32:
        return DECODE_CONFIGS["fp32"]
    rows = next_pow2(num_rows)
    key = "rows16" if rows <= 16 else "rows32" if rows <= 32 else "rows64"
    return DECODE_CONFIGS[key + ("-fp8" if is_fp8 else "")]


@triton.jit
def _load_piece(work_ptr, piece):
    """(request, lo, hi, the request's piece count, seq_len, first token, q_len, the
    index of its partial on the partial buffer's piece axis) from row `piece` of a
    split plan's work."""
    row = work_ptr + WORK_FIELDS * piece
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
def _gather_tile(
    data_ptr, table_row, start, hi, stride_db, stride_dp, compute_dtype: tl.constexpr,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    HALF_L: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Cache rows of positions [start, start + BLOCK_N) below hi, found through the block
    table one position at a time (any page size): the latent halves [BLOCK_N, HALF_L]
    x 2 and the rope part [BLOCK_N, BLOCK_R], masked rows zero, widened to compute_dtype.
    """
    pos = start + tl.arange(0, BLOCK_N)
    pos_ok = pos < hi
    block = tl.load(table_row + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
    rows = data_ptr + block * stride_db + (pos % PAGE).to(tl.int64) * stride_dp
    cols = tl.arange(0, HALF_L)
    # Masked rows are never read: slots past seq_len may hold NaN.
    kv_a = tl.load(rows[:, None] + cols[None, :], mask=pos_ok[:, None] & (cols[None, :] < L),
                   other=0.0)
    kv_b = tl.load(rows[:, None] + HALF_L + cols[None, :],
                   mask=pos_ok[:, None] & (cols[None, :] + HALF_L < L), other=0.0)
    k_pe = kv_a  # placeholder when R == 0
    if R > 0:
        cols_r = tl.arange(0, BLOCK_R)
        k_pe = tl.load(rows[:, None] + L + cols_r[None, :],
                       mask=pos_ok[:, None] & (cols_r[None, :] < R), other=0.0)
    return kv_a.to(compute_dtype), kv_b.to(compute_dtype), k_pe.to(compute_dtype)


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


@triton.jit
def _decode_partial_kernel(
    q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, block_table_ptr, work_ptr,
    starts_ptr, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_db, stride_dp,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_heads, num_pieces, softmax_scale,
    L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF_L: tl.constexpr,
    BLOCK_R: tl.constexpr, IS_FP8: tl.constexpr, PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr, PAGED: tl.constexpr, COMPUTE: tl.constexpr,
    PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, PF_REST: tl.constexpr,
    PF_LINE: tl.constexpr,
):
    """One head group of the pieces starts[p] .. starts[p + 1] - 1 (p = program_id(1))
    of the split plan's work [num_pieces, WORK] (`split_plan`), one after the other:
    out [BLOCK_H, L] and lse over each piece's positions (`_decode_piece`).
    PAGED: tiles come as bulk copies through latent_desc / rope_desc (host tensor
    descriptors over the cache viewed as [pages x PAGE, L + R]); otherwise gathered
    through data_ptr. A request in one piece gets its final out [T, N, L] (q dtype) and
    lse [N, T] through (stride_ot, stride_oh) and (stride_lt, stride_lh); a cut one
    float32 partials, at row (token x N + head) x num_pieces + the piece's partial index
    (field 7) of part [.., L] and part_lse (a row's pieces adjacent); a row whose piece
    holds no visible key gets lse -inf and no output (the combine never reads it).
    """
    program = tl.program_id(1)
    for piece in range(tl.load(starts_ptr + program), tl.load(starts_ptr + program + 1)):
        _decode_piece(
            q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, block_table_ptr, work_ptr,
            piece, out_ptr, lse_ptr, part_ptr, part_lse_ptr, stride_qt, stride_qh,
            stride_db, stride_dp, stride_bt, stride_ot, stride_oh, stride_lt, stride_lh,
            num_heads, num_pieces, softmax_scale, L, R, PAGE, BLOCK_H, BLOCK_N, HALF_L,
            BLOCK_R, IS_FP8, PRECISION, SWAP_AB, PAGED, COMPUTE, PREFETCH, PF_LINES,
            PF_REST, PF_LINE)


@triton.jit
def _decode_piece(
    q_ptr, data_ptr, latent_desc, rope_desc, scale_ptr, block_table_ptr, work_ptr, piece,
    out_ptr, lse_ptr, part_ptr, part_lse_ptr, stride_qt, stride_qh, stride_db, stride_dp,
    stride_bt, stride_ot, stride_oh, stride_lt, stride_lh, num_heads, num_pieces,
    softmax_scale, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF_L: tl.constexpr,
    BLOCK_R: tl.constexpr, IS_FP8: tl.constexpr, PRECISION: tl.constexpr,
    SWAP_AB: tl.constexpr, PAGED: tl.constexpr, COMPUTE: tl.constexpr,
    PREFETCH: tl.constexpr, PF_LINES: tl.constexpr, PF_REST: tl.constexpr,
    PF_LINE: tl.constexpr,
):
    """Head group program_id(0) of work row `piece` (see `_decode_partial_kernel`)."""
    group = tl.program_id(0)
    req, lo, hi, pieces, seq_len, q_begin, q_len, partial = _load_piece(work_ptr, piece)
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
        # it goes is a register-allocation choice, measured per form on an H200: first
        # in the swapped form (the accumulators are still empty there, which kept
        # ptxas from spilling inside the loop), last in the direct form (faster there).
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

    has_key = l_i > 0.0
    norm = 1.0 / tl.where(has_key, l_i, 1.0)
    if IS_FP8:
        norm = norm * kv_scale
    out_a = acc_a * norm[:, None]
    out_b = acc_b * norm[:, None]
    log_l = tl.math.log2(tl.where(has_key, l_i, 1.0))
    lse = tl.where(has_key, (m_i + log_l) * 0.6931471805599453, float("-inf"))  # natural log

    if pieces == 1:
        token = (q_begin + tok).to(tl.int64)
        out_rows = out_ptr + token * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_rows[:, None] + cols[None, :], out_a.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < L))
        tl.store(out_rows[:, None] + HALF_L + cols[None, :],
                 out_b.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] + HALF_L < L))
        tl.store(lse_ptr + token * stride_lt + head.to(tl.int64) * stride_lh, lse, mask=row_ok)
    else:
        at = rows.to(tl.int64) * num_pieces + partial
        store_ok = (row_ok & has_key)[:, None]
        tl.store(part_ptr + at[:, None] * L + cols[None, :], out_a,
                 mask=store_ok & (cols[None, :] < L))
        tl.store(part_ptr + at[:, None] * L + HALF_L + cols[None, :], out_b,
                 mask=store_ok & (cols[None, :] + HALF_L < L))
        tl.store(part_lse_ptr + at, lse, mask=row_ok)


@triton.jit
def _combine_entry(cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS: tl.constexpr,
                   INSIDE: tl.constexpr):
    """Entry `entry` of the combine, for its token t: (its first piece, its piece count,
    first token, q_len, the partials' token index); count 0 past the last entry (a
    check left out where the entry is known to be INSIDE the list)."""
    if ALL_SPLITS:  # entry k is token k, with every split, at its own index
        return 0, tl.where(INSIDE or entry < num_entries, num_splits, 0), entry, 1, entry
    request = cut_ptr + WORK_FIELDS * entry
    if INSIDE:
        return (tl.load(request + 1), tl.load(request + 3), tl.load(request + 5),
                tl.load(request + 6), t)
    live = entry < num_entries
    return (tl.load(request + 1, mask=live, other=0),
            tl.load(request + 3, mask=live, other=0),  # 0 past the cut requests too
            tl.load(request + 5, mask=live, other=0), tl.load(request + 6, mask=live, other=0),
            t)


@triton.jit
def _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin, q_len,
               part_token, t, head, cols,
               stride_pt, stride_ph, stride_ps, stride_st, stride_sh, stride_ss,
               stride_ot, stride_oh, stride_lh, stride_lt,
               L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr):
    """Merge one row's `count` pieces (partials first .. first + count - 1) by lse into
    its output columns `cols` and lse; nothing past the entry's q_len (nor for count 0).
    Pieces are taken BLOCK_S at a time in one online pass, each chunk's lse and partials
    loaded together; a piece with lse -inf or +inf (no visible key) was not written and
    gets weight 0 (what was loaded for it is dropped)."""
    used = tl.where(t < q_len, count, 0)  # tokens past this request's q_len: nothing
    token = (q_begin + t).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    part_at = (part_out_ptr + part_token.to(tl.int64) * stride_pt + head * stride_ph
               + cols[None, :])
    lse_at = part_lse_ptr + part_token.to(tl.int64) * stride_st + head * stride_sh
    peak = tl.full([], float("-inf"), tl.float32)
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([BLOCK_C], tl.float32)
    for s0 in range(0, used, BLOCK_S):
        at = first + s0 + splits
        lse = tl.load(lse_at + at * stride_ss, mask=s0 + splits < used, other=float("-inf"))
        part = tl.load(part_at + at[:, None].to(tl.int64) * stride_ps,
                       mask=(s0 + splits < used)[:, None] & (cols[None, :] < L), other=0.0)
        lse = tl.where(lse == float("inf"), float("-inf"), lse)  # +inf marks empty too
        new_peak = tl.maximum(peak, tl.max(lse, 0))
        shift = tl.where(new_peak == float("-inf"), 0.0, new_peak)
        rescale = tl.math.exp2((peak - shift) * 1.4426950408889634)
        weight = tl.math.exp2((lse - shift) * 1.4426950408889634)
        total = total * rescale + tl.sum(weight, 0)
        acc = acc * rescale + tl.sum(tl.where((weight > 0.0)[:, None], weight[:, None] * part,
                                              0.0), 0)
        peak = new_peak
    out = acc / tl.where(total > 0.0, total, 1.0)
    # (Masks are built as one comparison: the interpreter mistypes scalar & tensor.)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + cols,
             out.to(out_ptr.dtype.element_ty), mask=cols < tl.where(t < q_len, L, 0))
    merged = tl.where(total > 0.0, peak + tl.log(tl.where(total > 0.0, total, 1.0)),
                      float("-inf"))
    # Every column block writes the same lse value: a harmless duplicate store.
    tl.store(lse_ptr + head * stride_lh + token * stride_lt, merged, mask=t < q_len)


@triton.jit
def _decode_combine_kernel(
    part_out_ptr, part_lse_ptr, cut_ptr, out_ptr, lse_ptr,
    stride_pt, stride_ph, stride_ps,
    stride_st, stride_sh, stride_ss,
    stride_ot, stride_oh,
    stride_lh, stride_lt,
    num_heads, num_splits, num_rows, num_entries,
    L: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr, ALL_SPLITS: tl.constexpr,
    LOOP: tl.constexpr, PDL: tl.constexpr,
):
    """One (column block, row, entry): merge the row's pieces by lse (`_merge_row`).
    Rows are head x token (t * num_heads + head), num_rows per entry. The grid is one
    axis, column blocks fastest, then rows, then E entries (the order of a [blocks,
    rows, E] grid, whose second axis would hold at most 65535 rows: 128 heads x 512
    tokens are 65536). LOOP: the grid covers fewer entries than num_entries, and a
    program goes on to entry + E, + 2E, ... until one has no pieces (a loop that costs
    registers, so only there).

    An entry is a row of the split plan's `cut` [num_entries, WORK] (request -1 once the
    cut requests end: nothing more to do): its pieces are the partials first .. first +
    count - 1 (stride_ps / stride_ss apart), its tokens 0 .. q_len - 1 (stride_pt /
    stride_st). ALL_SPLITS (decode context parallel partials, `merge_partials`): entry
    k is token k, whose num_splits partials all count, at its own token index; cut is
    not read. PDL: launched as a programmatic dependent of stage 1 (`launch_pdl`), so it
    may start before stage 1 ends; it reads its first entry, then waits for stage 1
    (griddepcontrol.wait) before reading the partials. A program whose first entry is
    idle ends without waiting, as the entries after it are idle too, so that a plan
    that cuts no request leaves no program waiting out stage 1's tail.
    """
    COL_BLOCKS: tl.constexpr = (L + BLOCK_C - 1) // BLOCK_C
    col_block = tl.program_id(0) % COL_BLOCKS
    rows_entry = tl.program_id(0) // COL_BLOCKS
    row = rows_entry % num_rows
    entry = rows_entry // num_rows
    head = row % num_heads
    t = row // num_heads
    cols = col_block * BLOCK_C + tl.arange(0, BLOCK_C)
    first, count, q_begin, q_len, part_token = _combine_entry(cut_ptr, entry, t, num_entries,
                                                              num_splits, ALL_SPLITS, True)
    # Program 0 waits even so: the combine then never ends before stage 1, whose outputs
    # of uncut requests the kernels after the combine read.
    if PDL and ((count > 0) | (tl.program_id(0) == 0)):
        gdc_wait()
    strides = (stride_pt, stride_ph, stride_ps, stride_st, stride_sh, stride_ss,
               stride_ot, stride_oh, stride_lh, stride_lt)
    _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin, q_len,
               part_token, t, head, cols, *strides, L, BLOCK_C, BLOCK_S)
    if LOOP:
        step = tl.num_programs(0) // (COL_BLOCKS * num_rows)  # E
        entry += step
        first, count, q_begin, q_len, part_token = _combine_entry(
            cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS, False)
        while count > 0:
            _merge_row(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, first, count, q_begin,
                       q_len, part_token, t, head, cols, *strides, L, BLOCK_C, BLOCK_S)
            entry += step
            first, count, q_begin, q_len, part_token = _combine_entry(
                cut_ptr, entry, t, num_entries, num_splits, ALL_SPLITS, False)


def combine_blocks(num_rows: int, entries: int, pieces: int, max_pieces: int, width: int,
                   num_sms: int) -> tuple[int, int]:
    """(BLOCK_C, BLOCK_S) of the combine for num_rows rows x `entries` requests of
    about `pieces` (at most max_pieces) pieces each, `width` columns. One load should
    take all of a request's pieces (each further chunk is one more round trip), so
    BLOCK_C x `pieces` (rounded to the nearer power of two: a bound of 66 pieces is
    mostly 64 real ones, and sizing for 128 would leave half of every load masked) fits
    COMBINE_ELEMENTS (registers); within that, whole rows per program where that still
    gives two programs per multiprocessor, narrower column blocks where it does not (a
    long request's 128 heads alone)."""
    typical = next_pow2(pieces)
    if 2 * pieces * pieces < typical * typical:
        typical //= 2
    block_c = max(16, min(next_pow2(width), COMBINE_ELEMENTS // typical))
    while block_c > 16 and num_rows * entries * cdiv(width, block_c) < 2 * num_sms:
        block_c //= 2
    return block_c, max(1, min(next_pow2(max_pieces), COMBINE_ELEMENTS // block_c))


def combine_entries(per_entry: int, entries: int, num_sms: int) -> int:
    """Entries the combine's grid covers at once, of `entries` (the cut list's bound) with
    `per_entry` programs each: all of them, or as many as fill COMBINE_PROGRAMS_PER_SM
    programs per multiprocessor, its programs then taking further entries in turn.
    Most of a bound past one wave may be idle rows (a batch of whole requests cuts
    none), and each idle program still costs its launch and one read of its row: at
    N = 128 (128 rows per entry) 100 x 4k and 140 x 2k whole on an H200 took 2-4% less
    time so (session 39). Fewer programs per multiprocessor (8, 16) took another ~1 us
    off batches of whole requests at N = 16 but made 70 x 8k at N = 128, every request
    cut, 3-6% slower: a program's entries run one after another."""
    return max(1, min(entries, cdiv(COMBINE_PROGRAMS_PER_SM * num_sms, per_entry)))


def hopper_kernel(q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int):
    """The Gluon module whose warp-specialized stage 1 takes this call on a Hopper GPU:
    `decode_hopper_fp8` for an fp8 cache and at most 32 query rows per request,
    `decode_hopper` for at most 16 (16-bit cache), `decode_hopper_heads` for more; None
    where none supports it (and always off Hopper, under the interpreter, or where
    Triton lacks Gluon)."""
    modules = gluon_modules(q.device, "decode_hopper_fp8", "decode_hopper",
                            "decode_hopper_heads") or ()
    return next((m for m in modules if m.supported(q, data, num_rows, L)), None)


def tiles_copyable(data: torch.Tensor, block_n: int) -> bool:
    """Whether the copy engine can read [block_n, ...] tiles of the cache `data`
    [num_blocks, page, L + R] as rows: tiles inside one page (page a multiple of
    block_n), pages adjacent in rows, 16-byte aligned base and row stride, and fewer
    than 2**31 rows (int32 coordinates)."""
    num_blocks, page, _ = data.shape
    return (page % block_n == 0 and data.stride(-1) == 1
            and data.stride(0) == page * data.stride(1)
            and (data.stride(1) * data.element_size()) % 16 == 0
            and data.data_ptr() % 16 == 0 and num_blocks * page < 2**31)


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


def mla_decode(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    kv_lora_rank: int,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over the paged latent cache (as `reference.mla_decode`).

    q [T, N, L + R]; data [num_blocks, block_size, L + R] (q's dtype or fp8, scaled by
    `scale` [] float32 in the kernel: finite and positive, as `LatentKVCache` makes it
    and the 64-row kernel's softmax needs; a device value, so not checked here, which
    would cost a host sync); block_table int32 [B, max_blocks]; seq_lens int32
    [B]; query_start_loc int32 [B + 1]. Token i of request b sees positions
    < seq_lens[b] - q_len_b + i + 1. Returns out [T, N, L] (q dtype), lse [N, T] float32.

    max_query_len / max_seq_len are host ints bounding the batch: they size the grid
    and must not be smaller than the true values (for CUDA graphs pass the largest
    seq_len the graph will see, e.g. the model's max length). The split plan is made on
    the device from seq_lens (`split_plan`); `plans`, a dict the caller keeps for calls
    on the same seq_lens contents (the layers of one forward), holds it so that it is
    made once; a CUDA graph captured with the plan already in `plans` reads the plan's
    tensors at every replay, so the dict must outlive the graph. num_splits (pieces of
    the longest request) / config override the plan and the kernel config (tuning,
    tests).
    """
    check_device(q, data)
    # (Positive: the 64-row kernel scales row maxima.)
    softmax_scale = positive_finite("softmax_scale", softmax_scale)
    num_tokens, num_heads, width = q.shape
    L = kv_lora_rank
    R = width - L
    if data.shape[-1] != width:
        raise ValueError(f"cache rows have {data.shape[-1]} columns, q has {width}")
    if data.shape[0] * data.shape[1] == 0:  # (nor could the copy engine describe it)
        raise ValueError(f"data: a cache of shape {tuple(data.shape)} holds no position")
    num_reqs = seq_lens.shape[0]
    out = torch.empty(num_tokens, num_heads, L, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q = last_dim_contiguous(q)
    data = last_dim_contiguous(data)
    is_fp8 = data.dtype == FP8_DTYPE

    # Query rows per request (token x N + head): what stage 1's programs split in groups.
    rows_per_req = num_heads * max_query_len
    cfg = config or pick_config(rows_per_req, q.dtype, is_fp8)
    hopper = hopper_kernel(q, data, rows_per_req, L) if cfg.hopper else None
    if hopper is not None:
        block_h = hopper.BLOCK_H
    else:
        block_h = min(cfg.block_h, max(16, next_pow2(rows_per_req)))
    cfg = replace(cfg, block_h=block_h)
    # Pieces are whole tiles of the kernel that runs (the Gluon kernels' are 64).
    block_n = hopper.BLOCK_N if hopper is not None else cfg.block_n
    head_groups = cdiv(rows_per_req, block_h)
    num_sms = multiprocessor_count(q.device)
    slots = num_sms * cfg.programs_per_sm
    min_chunk = cfg.min_chunk_for(num_reqs)
    # Stage 1 runs several pieces per program but in the Gluon kernels that do not.
    persistent = hopper is None or hopper.PERSISTENT
    past_tiles, lone_wave = ((0, LONE_WAVE) if hopper is None
                             else (hopper.PAST_WAVE_TILES, hopper.LONE_WAVE))
    key = (seq_lens.data_ptr(), num_reqs, head_groups, max_seq_len, slots, block_n,
           min_chunk, block_h, num_splits, persistent, past_tiles, lone_wave)
    plan = plans.get(key) if plans is not None else None
    if plan is None:
        plan = plan_splits(seq_lens, query_start_loc, head_groups, max_seq_len, slots,
                           block_n, min_chunk, block_h, num_splits, persistent, past_tiles,
                           lone_wave)
        if plans is not None:
            plans[key] = plan
    if plan.programs > GRID_YZ_MAX:  # stage 1's pieces are its grid's second axis
        raise ValueError(f"seq_lens: a batch of {num_reqs} requests takes {plan.programs} "
                         f"stage-1 programs, more than the {GRID_YZ_MAX} a launch allows; "
                         "split the batch")
    # fp8 widens to float16 (one instruction per two values; e4m3 is exact in float16)
    # and the 16-bit q is rounded to float16 too; float32 q keeps float32 products.
    compute = _TL_DTYPES[torch.float16 if is_fp8 and q.dtype != torch.float32 else q.dtype]

    half_l = max(32, next_pow2(L)) // 2
    block_r = max(16, next_pow2(R)) if R > 0 else 16
    descs = (_page_descriptors(data, block_n, half_l, block_r, L)
             if cfg.paged and hopper is None else None)
    # L2 prefetch of tiles ahead (inline PTX: GPU only, and only with bulk copies).
    prefetch = cfg.prefetch if descs is not None and not INTERPRETED else 0
    pf_line = 128 // data.element_size()  # elements per 128-byte line
    pf_lines, pf_rest = split_pow2(cdiv(block_n * data.stride(1), pf_line))
    pf_rest = next_pow2(pf_rest) if pf_rest else 0
    # Partials of cut requests [token, head, piece, ..]: a row's pieces are adjacent, so
    # the combine reads each row's in one contiguous stretch.
    cut = plan.max_pieces > 1
    part_out = (torch.empty(max_query_len, num_heads, plan.rows, L, dtype=torch.float32,
                            device=q.device) if cut else out)
    part_lse = (torch.empty(max_query_len, num_heads, plan.rows, dtype=torch.float32,
                            device=q.device) if cut else lse)
    if hopper is not None:
        hopper.decode_partial(
            q, data, scale, block_table, plan, out, lse, part_out, part_lse,
            head_groups, softmax_scale, L)
    else:
        _decode_partial_kernel[(head_groups, plan.programs)](
            q, data, *(descs or (None, None)), scale, block_table, plan.work, plan.starts,
            out, lse, part_out, part_lse,
            q.stride(0), q.stride(1), data.stride(0), data.stride(1), block_table.stride(0),
            out.stride(0), out.stride(1), lse.stride(1), lse.stride(0),
            num_heads, plan.rows, float(softmax_scale),
            L=L, R=R, PAGE=data.shape[1], BLOCK_H=block_h, BLOCK_N=block_n, HALF_L=half_l,
            BLOCK_R=block_r, IS_FP8=is_fp8, PRECISION=dot_precision(q.dtype),
            SWAP_AB=cfg.swap_ab, PAGED=descs is not None, COMPUTE=compute,
            PREFETCH=prefetch, PF_LINES=pf_lines, PF_REST=pf_rest, PF_LINE=pf_line,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not cut:
        return out, lse
    max_cut = plan.cut.shape[0]
    # The Gluon kernels let the combine launch once their tiles are done (programmatic
    # dependent launch); it waits for stage 1 before reading the partials.
    pdl = hopper is not None
    # A cut request has about rows / max_cut pieces (every one of the plan's, when one
    # request is cut).
    block_c, block_s = combine_blocks(
        rows_per_req, max_cut, min(plan.max_pieces, cdiv(plan.rows, max_cut)), plan.max_pieces,
        L, num_sms)
    per_entry = cdiv(L, block_c) * rows_per_req
    entries = combine_entries(per_entry, max_cut, num_sms)
    _decode_combine_kernel[(per_entry * entries,)](
        part_out, part_lse, plan.cut, out, lse,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_heads, plan.max_pieces, rows_per_req, max_cut,
        L=L, BLOCK_C=block_c, BLOCK_S=block_s, ALL_SPLITS=False, LOOP=entries < max_cut,
        PDL=pdl,
        num_warps=COMBINE_WARPS, launch_pdl=pdl,
    )
    return out, lse


def merge_partials(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """As `reference.merge_partials`, in one launch of the decode combine kernel: D
    partials over disjoint keys, out [D, T, N, L] (any strides, unit last) and lse
    [D, T, N] float32 -> [T, N, L] in dtype. Decode context parallelism merges its
    ranks' partials with it, one split per rank."""
    check_device(out, lse)
    if out.dim() != 4 or tuple(lse.shape) != tuple(out.shape[:3]):
        raise ValueError(f"out must be [D, T, N, L] and lse [D, T, N], got "
                         f"{list(out.shape)} and {list(lse.shape)}")
    D, T, N, L = out.shape
    out = last_dim_contiguous(out)
    merged = torch.empty(T, N, L, dtype=dtype, device=out.device)
    if D == 0 or T == 0 or N == 0 or L == 0:
        return merged.zero_()
    merged_lse = torch.empty(N, T, dtype=torch.float32, device=out.device)  # not returned
    block_c, block_s = combine_blocks(N, T, D, D, L, multiprocessor_count(out.device))
    _decode_combine_kernel[(cdiv(L, block_c) * N * T,)](
        out, lse, lse, merged, merged_lse,  # (cut, the third: not read)
        out.stride(1), out.stride(2), out.stride(0),
        lse.stride(1), lse.stride(2), lse.stride(0),
        merged.stride(0), merged.stride(1), merged_lse.stride(0), merged_lse.stride(1),
        N, D, N, T,
        L=L, BLOCK_C=block_c, BLOCK_S=block_s, ALL_SPLITS=True, LOOP=False, PDL=False,
        num_warps=COMBINE_WARPS,
    )
    return merged
