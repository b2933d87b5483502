"""Stage 1 of paged latent decode on Hopper: a warp-specialized kernel in Gluon.

Same contract as `decode_triton._decode_partial_kernel` (a program per head group and
split of a request, or per run of splits in a persistent plan; final output or float32
partials plus lse), for the memory-bound regime: at most BLOCK_H = 16 query rows per
request, page size a multiple of 8, 64-row tiles.

Why a second kernel: plain Triton pipelines the tile copies in software, inside the
instruction stream that also runs the products, and with a bf16 tile of 72 KB it fits
only two stages; it also does not multi-buffer a copy whose first use is a conversion,
which leaves an fp8 cache one stage. Here the roles are split:

* a producer warp walks the block table and issues bulk tensor copies (TMA) into a
  ring of STAGES tile buffers, each guarded by a `ready` and an `empty` mbarrier, so a
  buffer is refilled the moment the consumer lets go of it; the first STAGES tiles'
  copies leave from the prologue, as soon as q's loads are on their way
  (`copy_first_tiles`);
* the consumer warpgroup runs the swapped products with wgmma, S^T = K Q^T over all
  L + R columns and O^T += V^T P^T over the first L (positions are the MMA's 64 rows, so
  16 heads do not pad to 64), and the online softmax (base 2) between them.

Rows at or past the slice end may hold NaN (slots past seq_len), and 0 x NaN reaches
the output: the slice's last, partial tile is zeroed there, in place.

In a persistent plan (`split_plan`) a program runs several splits one after the other:
the producer goes on to the next split's tiles as soon as ring buffers free up (the
ring's count runs on across splits), while the consumer stores a split's result and
loads the next split's q over the last.

An fp8 cache takes `decode_hopper_fp8` instead (products on e4m3 codes). The program's
slice, the ring, the q load, the producer, the e4m3 widening, the tail zeroing and the
descriptors are shared with it and with `decode_hopper_heads` (64 query rows per
program, for the compute-bound regime).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.triton._utils import tiles_copyable
from pagedmla.ops.triton.split_plan import WORK_FIELDS, SplitPlan

BLOCK_N = 64  # positions per tile: the wgmma's M
MIN_COPY_ROWS = 8  # fewest rows per bulk copy: one period of the 128-byte swizzle
BLOCK_H = 16  # query rows per program: the wgmma's N
STAGES = 2  # ring buffers (with q, 165 KB)
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
              FP8_DTYPE: gl.float8e4nv}


def supported(q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int) -> bool:
    """Whether this kernel takes the call (on a Hopper GPU: the decode table in `selection`
    checks the device): DeepSeek widths (L = 512, R = 64), 16-bit q, a cache of q's
    dtype, at most BLOCK_H query rows per request, and pages the copy engine can read
    (`pages_copyable`)."""
    return (deepseek_call(q, data, L) and num_rows <= BLOCK_H and data.dtype == q.dtype
            and pages_copyable(data))


def deepseek_call(q: torch.Tensor, data: torch.Tensor, L: int) -> bool:
    """What every Gluon decode kernel needs of a call: DeepSeek's widths (L = 512, R =
    64) and a 16-bit q."""
    return L == 512 and data.shape[-1] == L + 64 and q.dtype in (torch.bfloat16, torch.float16)


def copy_rows(page: int) -> int:
    """Rows per bulk copy for pages of `page` positions: a 64-position tile is one copy
    inside a page of a multiple of 64, else gcd(page, 64) rows per copy, each inside
    its page (a tile of pages of 16 takes four copies)."""
    return math.gcd(page, BLOCK_N)


def pages_copyable(data: torch.Tensor) -> bool:
    """Whether the copy engine can fill 64-position tiles from the cache `data`: copies
    of at least MIN_COPY_ROWS rows (pages of a multiple of 8 positions), with the layout
    `_utils.tiles_copyable` asks for."""
    rows = copy_rows(data.shape[1])
    return rows >= MIN_COPY_ROWS and tiles_copyable(data, rows)


@gluon.jit
def program_slice(work_ptr, num_heads, BLOCK_H: gl.constexpr, TILE_N: gl.constexpr):
    """Where a program of one split works: its head group from the grid, and the
    `split_slice` of its split (its row of the work, program_id(1))."""
    group = gl.program_id(0)
    splits, req, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles, partial = split_slice(
        work_ptr, gl.program_id(1), group, num_heads, BLOCK_H, TILE_N)
    return group, splits, req, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles, partial


@gluon.jit
def split_slice(work_ptr, split, group, num_heads, BLOCK_H: gl.constexpr,
                TILE_N: gl.constexpr):
    """Head group `group` of row `split` of the split plan's work (`split_plan`, WORK
    fields): the request's split count, the request, its seq_len, first token and q_len
    (all 0 for an idle row, which gets no rows); the query rows (q_len x N); the
    positions [lo, hi) in num_tiles tiles of TILE_N; and the index of the split's
    partial on the partial buffer's split axis. A split stops at the last position
    any of the group's rows sees (bottom-right causal), and is empty for a group past
    the rows."""
    row = work_ptr + WORK_FIELDS * split
    req = gl.maximum(gl.load(row), 0)
    splits = gl.load(row + 3)
    seq_len = gl.load(row + 4)
    q_begin = gl.load(row + 5)
    q_len = gl.load(row + 6)
    num_rows = q_len * num_heads
    lo = gl.load(row + 1)
    last_tok = (gl.minimum(group * BLOCK_H + BLOCK_H, num_rows) - 1) // num_heads
    hi = gl.minimum(gl.load(row + 2), seq_len - q_len + last_tok + 1)
    hi = gl.where(group * BLOCK_H < num_rows, hi, lo)
    num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), TILE_N)
    return splits, req, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles, gl.load(row + 7)


@gluon.jit
def allocate_ring(dtype: gl.constexpr, latent_layout: gl.constexpr, rope_layout: gl.constexpr,
                  STAGES: gl.constexpr, TILE_N: gl.constexpr, HALF_L: gl.constexpr,
                  R: gl.constexpr):
    """The ring of tile buffers, latent halves [STAGES, TILE_N, L / 2] x 2 and rope
    [STAGES, TILE_N, R] of dtype in the given layouts (the copies', or 16-bit ones an
    fp8 widener fills), with a `ready` mbarrier per buffer (the filler's) and an `empty`
    one (its reader's)."""
    ring_a = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HALF_L], latent_layout)
    ring_b = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, HALF_L], latent_layout)
    ring_r = gl.allocate_shared_memory(dtype, [STAGES, TILE_N, R], rope_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(STAGES):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    return ring_a, ring_b, ring_r, ready, empty


@gluon.jit
def copy_ring(latent_desc, rope_desc, STAGES: gl.constexpr, TILE_N: gl.constexpr):
    """The ring of STAGES tile buffers (`allocate_ring`) that bulk copies through
    latent_desc and rope_desc fill, in their layouts."""
    HALF_L: gl.constexpr = latent_desc.block_type.shape[1]
    R: gl.constexpr = rope_desc.block_type.shape[1]
    latent_layout: gl.constexpr = latent_desc.layout
    rope_layout: gl.constexpr = rope_desc.layout
    return allocate_ring(latent_desc.dtype, latent_layout, rope_layout, STAGES, TILE_N,
                         HALF_L, R)


@gluon.jit
def _times(x, SCALE: gl.constexpr):
    """x * SCALE in x's dtype (SCALE a power of two: exact unless it overflows)."""
    if SCALE != 1.0:
        x = (x * SCALE).to(x.dtype)
    return x


@gluon.jit
def query_rows(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh,
               BLOCK_H: gl.constexpr, layout: gl.constexpr):
    """Pointers to the first column of the program's BLOCK_H query rows (row r: token
    r // N, head r % N) and whether each exists (r < num_rows), [BLOCK_H] in `layout`."""
    r_idx = group * BLOCK_H + gl.arange(0, BLOCK_H, layout)
    q_rows = (q_ptr + (q_begin + r_idx // num_heads).to(gl.int64) * stride_qt
              + (r_idx % num_heads).to(gl.int64) * stride_qh)
    return q_rows, r_idx < num_rows


@gluon.jit
def load_q(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh,
           BLOCK_H: gl.constexpr, L: gl.constexpr, HALF_L: gl.constexpr, R: gl.constexpr,
           rows: gl.constexpr):
    """The program's q rows (row r: token r // N, head r % N; zero past num_rows) in
    registers, in `rows`: [BLOCK_H, HALF_L] x 2 (the latent halves) and [BLOCK_H, R]."""
    q_rows, r_ok = query_rows(q_ptr, q_begin, group, num_heads, num_rows, stride_qt,
                              stride_qh, BLOCK_H, gl.SliceLayout(1, rows))
    cols = gl.arange(0, HALF_L, gl.SliceLayout(0, rows))
    cols_r = gl.arange(0, R, gl.SliceLayout(0, rows))
    x_a = gl.load(q_rows[:, None] + cols[None, :], mask=r_ok[:, None], other=0.0)
    x_b = gl.load(q_rows[:, None] + HALF_L + cols[None, :], mask=r_ok[:, None], other=0.0)
    x_r = gl.load(q_rows[:, None] + L + cols_r[None, :], mask=r_ok[:, None], other=0.0)
    return x_a, x_b, x_r


@gluon.jit
def q_operands(x_a, x_b, x_r, Q_SCALE: gl.constexpr = 1.0):
    """q's parts from `load_q` times Q_SCALE (a power of two), in shared memory for
    wgmma."""
    compute: gl.constexpr = x_a.dtype
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(x_a.type.shape, compute)
    q_r_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(x_r.type.shape, compute)
    return (gl.allocate_shared_memory(compute, x_a.type.shape, q_layout, _times(x_a, Q_SCALE)),
            gl.allocate_shared_memory(compute, x_b.type.shape, q_layout, _times(x_b, Q_SCALE)),
            gl.allocate_shared_memory(compute, x_r.type.shape, q_r_layout,
                                      _times(x_r, Q_SCALE)))


@gluon.jit
def _copy_starts(table_row, start, last, hi, COPIES: gl.constexpr, CHUNK: gl.constexpr,
                 PAGE: gl.constexpr, layout: gl.constexpr):
    """Cache rows where the COPIES copies of the tile at `start` begin ([COPIES] int32),
    each copy's position clamped to `last` (the slice's last copy: past it the block
    table holds no page of this slice). An empty slice reads no table entry (row 0)."""
    pos = gl.minimum(start + CHUNK * gl.arange(0, COPIES, layout), last)
    page = gl.load(table_row + pos // PAGE, mask=pos < hi, other=0)
    return page * PAGE + pos % PAGE


@gluon.jit
def _copy_tile(latent_desc, rope_desc, ring_a, ring_b, ring_r, bar, slot, rows, index, at):
    """Issue one tile's bulk copies into ring buffer `slot`, completing on the mbarrier
    `bar`: copy j (the descriptors' box of CHUNK rows) starts at cache row rows[at + j]
    (`_copy_starts`; index: arange over rows, in its layout)."""
    HALF_L: gl.constexpr = ring_a.type.shape[2]
    CHUNK: gl.constexpr = latent_desc.block_type.shape[0]
    COPIES: gl.constexpr = ring_a.type.shape[1] // CHUNK
    mbarrier.expect(bar, COPIES * (2 * latent_desc.block_type.nbytes
                                   + rope_desc.block_type.nbytes))
    for j in gl.static_range(COPIES):
        row = gl.sum(gl.where(index == at + j, rows, 0), 0)
        tma.async_copy_global_to_shared(latent_desc, [row, 0], bar,
                                        ring_a.index(slot).slice(j * CHUNK, CHUNK))
        tma.async_copy_global_to_shared(latent_desc, [row, HALF_L], bar,
                                        ring_b.index(slot).slice(j * CHUNK, CHUNK))
        tma.async_copy_global_to_shared(rope_desc, [row, 2 * HALF_L], bar,
                                        ring_r.index(slot).slice(j * CHUNK, CHUNK))


@gluon.jit
def copy_first_tiles(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, table_row, lo,
                     hi, num_tiles, PAGE: gl.constexpr):
    """Issue the copies of the slice's first tiles, one per ring buffer (all free yet),
    from the program's prologue: their block-table entries in one round trip to memory,
    made beside q's, and the copies right after, so that they fly while the prologue
    finishes and the warps fork. Returns the tiles issued, where `produce_tiles` goes
    on."""
    STAGES: gl.constexpr = ring_a.type.shape[0]
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    CHUNK: gl.constexpr = latent_desc.block_type.shape[0]
    COPIES: gl.constexpr = TILE_N // CHUNK
    # Every thread holds every entry, so picking one is a sum within the thread.
    every: gl.constexpr = gl.BlockedLayout([STAGES * COPIES], [32], [gl.num_warps()], [0])
    index = gl.arange(0, STAGES * COPIES, every)
    last = gl.maximum(hi - 1, 0) // CHUNK * CHUNK
    rows = _copy_starts(table_row, lo, last, hi, STAGES * COPIES, CHUNK, PAGE, every)
    fence_async_shared()  # the ring's mbarriers, initialised, before the copy engine's use
    for k in gl.static_range(STAGES):
        if k < num_tiles:
            _copy_tile(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready.index(k), k,
                       rows, index, k * COPIES)
    return gl.minimum(num_tiles, STAGES)


@gluon.jit
def produce_tiles(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty, table_row,
                  lo, hi, first, num_tiles, base, PAGE: gl.constexpr, STAGES: gl.constexpr):
    """Producer warp: copy tile i (from `first` on: `copy_first_tiles` issued those
    before) into ring buffer (base + i) % STAGES once it is free, in TILE_N / CHUNK bulk
    copies of CHUNK rows (the descriptors' box), each inside a page; base: the tiles
    the ring took before this slice (earlier splits of a persistent program).

    The block-table entries of the next tile are loaded before waiting for a buffer, so
    their latency is not added to every copy's."""
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    CHUNK: gl.constexpr = latent_desc.block_type.shape[0]
    COPIES: gl.constexpr = TILE_N // CHUNK
    one_warp: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    index = gl.arange(0, COPIES, one_warp)
    last = gl.maximum(hi - 1, 0) // CHUNK * CHUNK
    rows = _copy_starts(table_row, lo + first * TILE_N, last, hi, COPIES, CHUNK, PAGE,
                        one_warp)
    for i in range(first, num_tiles):
        slot = (base + i) % STAGES
        start = lo + i * TILE_N
        rows_next = _copy_starts(table_row, start + TILE_N, last, hi, COPIES, CHUNK, PAGE,
                                 one_warp)
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(slot), (((base + i) // STAGES) & 1) ^ 1)
        _copy_tile(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready.index(slot), slot,
                   rows, index, 0)
        rows = rows_next


@gluon.jit
def _zero_rows(buf, start, hi, layout: gl.constexpr):
    """Set the rows of buf at positions >= hi to zero, in place."""
    TILE_N: gl.constexpr = buf.type.shape[0]
    x = buf.load(layout)
    pos = start + gl.arange(0, TILE_N, gl.SliceLayout(1, layout))
    buf.store(gl.where((pos < hi)[:, None], x, gl.zeros_like(x)))


@gluon.jit
def zero_tail(k_a, k_b, k_r, start, hi, layout: gl.constexpr):
    """Zero, in place, the rows at positions >= hi of a tile (its latent halves and rope
    part), then order the stores before the products' reads. Only the slice's last,
    partial tile has such rows: slots past seq_len may hold NaN, and 0 x NaN would reach
    the output."""
    _zero_rows(k_a, start, hi, layout)
    _zero_rows(k_b, start, hi, layout)
    _zero_rows(k_r, start, hi, layout)
    fence_async_shared()
    # The warps' stores before any warp's reads. Left to Triton, this barrier lands after
    # the caller's branch, on every tile's path (one bar.sync per tile, sm_90a SASS).
    gl.thread_barrier()


@gluon.jit
def _consume(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_smem, lo, hi, num_tiles,
             base, limit, qk_scale, STAGES: gl.constexpr, mma: gl.constexpr,
             rows: gl.constexpr):
    """Consumer warpgroup: online softmax over the slice's tiles, tile i in ring buffer
    (base + i) % STAGES (`produce_tiles`); the products read the ring buffer, which is
    released after them.

    Returns acc_a, acc_b [HALF_L, BLOCK_H] (O^T halves, unnormalised), m_i and l_i
    [BLOCK_H] (running max and sum, base 2)."""
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    HALF_L: gl.constexpr = ring_a.type.shape[2]
    ROWS: gl.constexpr = q_a.type.shape[0]
    acc_a = gl.zeros([HALF_L, ROWS], gl.float32, mma)
    acc_b = gl.zeros([HALF_L, ROWS], gl.float32, mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(0, mma))
    s_init = gl.zeros([TILE_N, ROWS], gl.float32, mma)
    for i in range(num_tiles):
        slot = (base + i) % STAGES
        mbarrier.wait(ready.index(slot), ((base + i) // STAGES) & 1)
        start = lo + i * TILE_N
        k_a = ring_a.index(slot)
        k_b = ring_b.index(slot)
        k_r = ring_r.index(slot)
        if start + TILE_N > hi:
            zero_tail(k_a, k_b, k_r, start, hi, rows)
        s = warpgroup_mma(k_a, q_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
        s = warpgroup_mma(k_b, q_b.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(k_r, q_r.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))

        pos = start + gl.arange(0, TILE_N, gl.SliceLayout(1, mma))
        visible = (pos < hi)[:, None] & (pos[:, None] < limit[None, :])
        s = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        # A row with nothing visible yet keeps m = -inf: shift by 0 so exp2 gives 0.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - m_safe[None, :])
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        p_smem.store(p.to(p_smem.dtype))
        fence_async_shared()
        acc_a = warpgroup_mma(k_a.permute((1, 0)), p_smem, acc_a * alpha[None, :],
                              is_async=True)
        acc_b = warpgroup_mma(k_b.permute((1, 0)), p_smem, acc_b * alpha[None, :],
                              is_async=True)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        mbarrier.arrive(empty.index(slot), count=1)
    return acc_a, acc_b, m_i, l_i


@gluon.jit
def _store_split(acc_a, acc_b, m_i, l_i, group, partial, splits, q_begin, num_rows, num_heads,
                 num_partials, out_ptr, lse_ptr, part_ptr, part_lse_ptr, stride_ot, stride_oh,
                 stride_lt, stride_lh, L: gl.constexpr, mma: gl.constexpr):
    """A split's result from `_consume`'s state: the final out and lse of a request in one
    split, else float32 partials at row (token x N + head) x num_partials + partial (the
    split's partial index; a partial with no visible key is never read: not stored).

    O^T [HALF_L, BLOCK_H] halves are stored straight from the accumulators' registers:
    each store instruction covers 8 adjacent columns (32 bytes of float32) of 4 rows, and
    no round trip through shared memory (into a row-contiguous layout, 16-byte stores)
    runs before them, which does not pay for itself at N = 16."""
    HALF_L: gl.constexpr = acc_a.type.shape[0]
    BLOCK_H: gl.constexpr = acc_a.type.shape[1]
    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    norm = 1.0 / gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key, (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # natural log
    out_a = acc_a * norm[None, :]
    out_b = acc_b * norm[None, :]
    r_st = group * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, mma))
    row_ok = r_st < num_rows
    l_idx = gl.arange(0, HALF_L, gl.SliceLayout(1, mma))
    if splits == 1:
        token = (q_begin + r_st // num_heads).to(gl.int64)
        head = (r_st % num_heads).to(gl.int64)
        out_cols = out_ptr + token * stride_ot + head * stride_oh
        gl.store(out_cols[None, :] + l_idx[:, None], out_a.to(out_ptr.dtype.element_ty),
                 mask=row_ok[None, :])
        gl.store(out_cols[None, :] + HALF_L + l_idx[:, None],
                 out_b.to(out_ptr.dtype.element_ty), mask=row_ok[None, :])
        gl.store(lse_ptr + token * stride_lt + head * stride_lh, lse, mask=row_ok)
    else:
        at = r_st.to(gl.int64) * num_partials + partial
        store_ok = row_ok & (lse > float("-inf"))
        gl.store(part_ptr + at[None, :] * L + l_idx[:, None], out_a, mask=store_ok[None, :])
        gl.store(part_ptr + at[None, :] * L + HALF_L + l_idx[:, None], out_b,
                 mask=store_ok[None, :])
        gl.store(part_lse_ptr + at, lse, mask=row_ok)


@gluon.jit
def _consume_run(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_smem, work_ptr,
                 run_begin, run_end, group, num_heads, num_partials, q_ptr, stride_qt,
                 stride_qh, softmax_scale, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
                 stride_ot, stride_oh, stride_lt, stride_lh, L: gl.constexpr,
                 R: gl.constexpr, STAGES: gl.constexpr, mma: gl.constexpr,
                 rows: gl.constexpr):
    """Consumer warpgroup of a program's run of splits run_begin .. run_end - 1: each
    split's tiles (`_consume`) and result (`_store_split`); q of the first split is in
    q_a, q_b, q_r already, each later split's is loaded over it (its tiles meanwhile
    arrive: the producer runs ahead across splits)."""
    BLOCK_H: gl.constexpr = q_a.type.shape[0]
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    HALF_L: gl.constexpr = ring_a.type.shape[2]
    qk_scale = softmax_scale * 1.4426950408889634  # scores in base 2
    base = 0
    for split in range(run_begin, run_end):
        splits, _, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles, partial = split_slice(
            work_ptr, split, group, num_heads, BLOCK_H, TILE_N)
        if split > run_begin:
            x_a, x_b, x_r = load_q(q_ptr, q_begin, group, num_heads, num_rows, stride_qt,
                                   stride_qh, BLOCK_H, L, HALF_L, R, rows)
            q_a.store(x_a)
            q_b.store(x_b)
            q_r.store(x_r)
            fence_async_shared()
            gl.thread_barrier()
        # Bottom-right causal: token t of q_len sees positions < seq_len - q_len + t + 1.
        r_mma = group * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, mma))
        limit = seq_len - q_len + r_mma // num_heads + 1
        acc_a, acc_b, m_i, l_i = _consume(ring_a, ring_b, ring_r, ready, empty, q_a, q_b,
                                          q_r, p_smem, lo, hi, num_tiles, base, limit,
                                          qk_scale, STAGES, mma, rows)
        base += num_tiles
        if split == run_end - 1:
            gdc_launch_dependents()  # the combine may launch now; it waits for this grid
        _store_split(acc_a, acc_b, m_i, l_i, group, partial, splits, q_begin, num_rows,
                     num_heads, num_partials, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
                     stride_ot, stride_oh, stride_lt, stride_lh, L, mma)


@gluon.jit
def _produce_run(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty, table_row,
                 lo, hi, first, num_tiles, work_ptr, block_table_ptr, stride_bt, run_begin,
                 run_end, group, num_heads, PAGE: gl.constexpr, STAGES: gl.constexpr,
                 BLOCK_H: gl.constexpr):
    """Producer warp of a program's run of splits: the first split's tiles (table_row,
    lo, hi, num_tiles; `first` of them issued from the prologue), then each later
    split's, the ring's count going on across splits."""
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    produce_tiles(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty, table_row,
                  lo, hi, first, num_tiles, 0, PAGE, STAGES)
    base = num_tiles
    for split in range(run_begin + 1, run_end):
        _, req, _, _, _, _, lo, hi, num_tiles, _ = split_slice(work_ptr, split, group,
                                                               num_heads, BLOCK_H, TILE_N)
        produce_tiles(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty,
                      block_table_ptr + req.to(gl.int64) * stride_bt, lo, hi, 0, num_tiles,
                      base, PAGE, STAGES)
        base += num_tiles


@gluon.jit(do_not_specialize=["stride_bt", "stride_lh", "num_partials"],  # batch-dependent:
           do_not_specialize_on_alignment=["block_table_ptr"])  # engine/warmup.py
def _decode_partial_ws_kernel(
    q_ptr, latent_desc, rope_desc, scale_ptr, block_table_ptr, work_ptr, starts_ptr,
    out_ptr, lse_ptr, part_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_heads, num_partials, softmax_scale,
    L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
    TILE_N: gl.constexpr, STAGES: gl.constexpr, RUNS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The splits starts[p] .. starts[p + 1] - 1 (RUNS: a persistent plan; else split p)
    of the split plan's work [num_partials, WORK], p = program_id(1), one after the
    other, each as `decode_triton._decode_partial_kernel` takes it with a 16-bit cache
    (unscaled: scale_ptr is not read); the TILE_N-position tiles come through
    latent_desc ([rows, L / 2] boxes) and rope_desc ([rows, R] boxes, rows =
    `copy_rows(PAGE)`) over the cache viewed as [pages x PAGE, L + R] rows. The ring
    runs on across splits, so a split's first tiles are copied while the one before
    ends."""
    HALF_L: gl.constexpr = latent_desc.block_type.shape[1]
    group = gl.program_id(0)
    run_begin = gl.program_id(1)
    if RUNS:
        run_end = gl.load(starts_ptr + run_begin + 1)
        run_begin = gl.load(starts_ptr + run_begin)
    else:
        run_end = run_begin + 1
    splits, req, _, q_begin, _, num_rows, lo, hi, num_tiles, _ = split_slice(
        work_ptr, run_begin, group, num_heads, BLOCK_H, TILE_N)
    if run_begin == run_end or splits == 0:  # an idle program: exit before any set-up
        return

    compute: gl.constexpr = q_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 16])
    # 8 elements (16 bytes of a 16-bit type) per thread along the row.
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    ring_a, ring_b, ring_r, ready, empty = copy_ring(latent_desc, rope_desc, STAGES, TILE_N)
    table_row = block_table_ptr + req.to(gl.int64) * stride_bt
    x_a, x_b, x_r = load_q(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh,
                           BLOCK_H, L, HALF_L, R, rows)
    first = copy_first_tiles(latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, table_row,
                             lo, hi, num_tiles, PAGE)
    q_a, q_b, q_r = q_operands(x_a, x_b, x_r)
    p_smem = gl.allocate_shared_memory(
        compute, [TILE_N, BLOCK_H],
        gl.NVMMASharedLayout.get_default_for([TILE_N, BLOCK_H], compute))
    fence_async_shared()

    gl.warp_specialize([
        (_consume_run, (ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_smem, work_ptr,
                        run_begin, run_end, group, num_heads, num_partials, q_ptr, stride_qt,
                        stride_qh, softmax_scale, out_ptr, lse_ptr, part_ptr, part_lse_ptr,
                        stride_ot, stride_oh, stride_lt, stride_lh, L, R, STAGES, mma,
                        rows)),
        (_produce_run, (latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty,
                        table_row, lo, hi, first, num_tiles, work_ptr, block_table_ptr,
                        stride_bt, run_begin, run_end, group, num_heads, PAGE, STAGES,
                        BLOCK_H)),
    ], [1], [24])


def page_descriptors(data: torch.Tensor, L: int) -> tuple[TensorDescriptor, TensorDescriptor]:
    """Bulk-copy descriptors over the cache `data` [num_blocks, page, L + R] viewed as
    [pages x page, L + R] rows: [rows, L / 2] boxes for the latent halves and [rows, R]
    boxes for the rope part, rows = `copy_rows(page)`, in the swizzled layouts wgmma
    reads (the same for any number of rows: tiles are assembled from the boxes)."""
    num_blocks, page, width = data.shape
    block_n = copy_rows(page)
    rows = [num_blocks * page, width]
    strides = [data.stride(1), 1]
    return (TensorDescriptor(data, rows, strides, [block_n, L // 2],
                             box_layout(block_n, L // 2, data.dtype)),
            TensorDescriptor(data, rows, strides, [block_n, width - L],
                             box_layout(block_n, width - L, data.dtype)))


@functools.cache  # building a layout costs more host time than the descriptor itself
def box_layout(rows: int, width: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a bulk copy's [rows, width] box of `dtype` (the
    decode and prefill kernels' descriptors)."""
    return gl.NVMMASharedLayout.get_default_for([rows, width], _GL_DTYPES[dtype])


def decode_partial(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
    part_lse: torch.Tensor, head_groups: int, softmax_scale: float, L: int,
) -> None:
    """Launch stage 1 for a batch `supported` accepted: grid (head_groups = 1,
    plan.programs), the splits of the plan, several per program in a persistent plan.
    The arguments are `decode_triton.decode_partial`'s (a 16-bit cache, `scale` unread).
    """
    latent_desc, rope_desc = page_descriptors(data, L)
    launch(_decode_partial_ws_kernel, q, data, scale, block_table, plan, out, lse, part_out,
           part_lse, head_groups, softmax_scale, L, latent_desc=latent_desc,
           rope_desc=rope_desc, starts_ptr=plan.starts, num_partials=plan.rows,
           BLOCK_H=BLOCK_H, TILE_N=BLOCK_N, STAGES=STAGES, RUNS=plan.rows > plan.programs,
           num_warps=4)


def launch(
    kernel: Any, q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
    block_table: torch.Tensor, plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, head_groups: int, softmax_scale: float,
    L: int, **kernel_args: Any,
) -> None:
    """Launch the Gluon stage-1 `kernel` (this module's or `decode_hopper_fp8`'s,
    `decode_hopper_heads`'s) on grid (head_groups, plan.programs): the arguments every
    such kernel takes (as `decode_partial` gets them), by name, and `kernel_args`, its
    own (descriptors, tile sizes, warps)."""
    kernel[(head_groups, plan.programs)](
        q_ptr=q, scale_ptr=scale, block_table_ptr=block_table, work_ptr=plan.work,
        out_ptr=out, lse_ptr=lse, part_ptr=part_out, part_lse_ptr=part_lse,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_bt=block_table.stride(0),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_lt=lse.stride(1),
        stride_lh=lse.stride(0), num_heads=q.shape[1], softmax_scale=float(softmax_scale),
        L=L, R=data.shape[-1] - L, PAGE=data.shape[1], **kernel_args,
    )
