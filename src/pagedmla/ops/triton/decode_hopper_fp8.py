"""Stage 1 of paged latent decode on Hopper for an fp8 cache and at most 32 query rows
(16 per program: a request's rows in one or two head groups): both products run on the
tensor cores' e4m3 path, so the tile is never widened.

Same contract as `decode_hopper` (one program per head group and split of a request;
final output or float32 partials plus lse), whose producer warp, ring and slice it
shares. Widening every e4m3 tile into a 16-bit copy before its products would make that
work, not the copy, the bound, and an fp8 cache would gain little over bf16 for half the
bytes. Here two consumer warpgroups take alternate tiles of the slice (one alone would
leave the copies waiting on its chain of products and softmax), and each multiplies
the e4m3 codes as they arrive:

* S^T = K Q^T: K is the ring buffer itself (wgmma's A operand from shared memory), Q is
  e4m3 too. A single e4m3 copy of q would keep 4 significant bits, so q is stored as two
  e4m3 terms, q_hi = e4m3(q s) and q_lo = e4m3(q s - q_hi) with s a per-row power of two
  putting the row's largest entry near 224: q_hi + q_lo is within 2^-8 of q s relative
  to each entry (bf16's own rounding is 2^-9). The terms are stacked as one operand of
  2 x 16 rows, so each k-step is one product that reads K once, and the two halves of
  the result add in registers. The scores, and so lse, are then within ~2^-8 of their
  size, where the widening kernels' products are exact; an e4m3 cache entry is itself
  only within 2^-4 of what it stores.
* O^T += V^T P^T: P is split the same way (scaled by 2^P_EXP, two terms) and its terms
  stacked as q's, so this product too runs on 32 columns, whose halves are added after
  the last tile (16 products per tile instead of 32: each product's latency, not the
  tensor cores' rate, is what a consumer's chain of work per tile pays). e4m3 wgmma
  wants both operands K-major, and V^T's K (the positions) is the cache's row index, so
  V^T comes from registers. `ldmatrix.trans` reads the tile as 16-bit pairs of adjacent
  columns and hands each thread, per register, one pair for two adjacent positions; two
  byte permutes per two registers (`_DEINTERLEAVE`) then give words of 4 positions of
  one column, as wgmma's A fragment wants them (a quarter of the load instructions and
  half the permutes of 4-byte loads and 4 x 4 transposes). The
  product's row index l' is a bit permutation of the latent column (`_sigma`), a
  relabelling of the loaded tensor, undone when O is stored.

The kernel forks into its partitions before q is loaded: the producer's first copies
then fly while the two consumers load q and store its terms, half each. The second
consumer leaves its O^T, m and l in shared memory; the first folds them into its own
before the store. The first takes the odd tiles: in a slice of an even count the second
then ends first and leaves its state while the first runs the last tile. Rows
at or past the slice end may hold NaN codes (0 x NaN would reach the output): the
slice's last, partial tile is zeroed there in place, as `decode_hopper` does for 16-bit
caches.

With 17-32 query rows (N = 32, or N = 16 and two tokens per request) a split runs as two
programs of 16 rows. They read the same tiles and are neighbours in the grid's order, so
the second read can come from L2, which beats the 64-row kernel's widening of every tile
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.extra.cuda import gdc_launch_dependents

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.triton.decode_hopper import (
    BLOCK_H,
    BLOCK_N,
    copy_ring,
    deepseek_call,
    launch,
    load_q,
    page_descriptors,
    pages_copyable,
    produce_tiles,
    program_slice,
    zero_tail,
)
from pagedmla.ops.triton.e4m3 import e4m3_bits_to, float_to_e4m3
from pagedmla.ops.triton.split_plan import SplitPlan

__all__ = ["BLOCK_H", "BLOCK_N", "MAX_ROWS", "decode_partial", "supported"]

MAX_ROWS = 2 * BLOCK_H  # query rows per request: two head groups (the module docstring)
# Ring buffers of 36 KB: with q's terms, P and the second consumer's state, 204 KB, one
# program per SM.
STAGES = 4
# q's rows are scaled to put their largest entry in (Q_TOP / 2, Q_TOP] (e4m3's largest
# value is 448), P to 2^P_EXP at most (its two terms keep entries down to ~2^-16 of that).
Q_TOP = gl.constexpr(224.0)
P_EXP = gl.constexpr(7)
CONSUMERS = gl.constexpr(2)  # consumer warpgroups (_consume, _consume_kept): alternate tiles
# The second consumer's registers per thread: with the first's 256 and the producer
# warp's warpgroup's 24, all 64K of the register file.
CONSUMER_REGS = gl.constexpr(232)

# V^T's A operand, one 128-column block of a tile: the block's bytes read as 16-bit
# pairs of adjacent columns, [TILE_N positions, 64 pairs], in a layout that Triton loads
# with `ldmatrix.trans` (four instructions per thread for the block). Bases: registers
# take positions 1, 2, 16, 32 and pair 32 (a 32-bit register holds positions p and
# p + 1 of one pair), lanes positions 4, 8 and pairs 1, 2, 4, warps pairs 8, 16.
_V_PAIRS = gl.constexpr(gl.DistributedLinearLayout(
    [[1, 0], [2, 0], [16, 0], [32, 0], [0, 32]], [[4, 0], [8, 0], [0, 1], [0, 2], [0, 4]],
    [[0, 8], [0, 16]], [], [64, 64]))
# Four pairs (4 positions, one pair of columns) in two words -> the even columns' four
# bytes and the odd columns' (positions along each word, as wgmma's fragment wants).
_DEINTERLEAVE = gl.constexpr("""{
prmt.b32 $0, $2, $3, 0x6420;
prmt.b32 $1, $2, $3, 0x7531;
}""")


def supported(q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int) -> bool:
    """Whether this kernel takes the call (on a Hopper GPU): an fp8 cache of DeepSeek
    widths (L = 512, R = 64), 16-bit q, at most MAX_ROWS query rows per request, and
    pages the copy engine can read (`decode_hopper.pages_copyable`)."""
    return (deepseek_call(q, data, L) and num_rows <= MAX_ROWS and data.dtype == FP8_DTYPE
            and pages_copyable(data))


@gluon.jit
def _sigma(row):
    """Latent column (within a 128-column block) of row l' of O^T: bits (l'3, l'0, l'1,
    l'2, l'4, l'5, l'6) become the column's bits 0-6."""
    return ((row >> 3) & 1) | ((row & 7) << 1) | (row & 0x70)


@gluon.jit
def _two_terms(x):
    """x (float32) as hi + lo, both e4m3 (round to nearest): hi = e4m3(x), lo = e4m3(x -
    hi); |x - hi - lo| <= 2^-8 |x| (plus 2^-10 below e4m3's normal range)."""
    hi = float_to_e4m3(x)
    lo = float_to_e4m3(x - e4m3_bits_to(hi, gl.float16).to(gl.float32))
    return hi.to(gl.float8e4nv, bitcast=True), lo.to(gl.float8e4nv, bitcast=True)


@gluon.jit
def _q_terms(x, scale):
    """q columns x [BLOCK_H, W] times the rows' scale, as two e4m3 terms stacked as
    wgmma's B operand wants them in shared memory ([2 BLOCK_H, W]: the hi terms' rows,
    then the lo terms')."""
    hi, lo = _two_terms(x * scale[:, None])
    ROWS: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    return gl.join(hi, lo).permute((2, 0, 1)).reshape([2 * ROWS, W])


@gluon.jit
def _q_prologue(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh, q_a, q_b,
                q_r, qk_scales, qk_base, q_ready, c: gl.constexpr, rows: gl.constexpr):
    """Consumer c's part of q, from its own partition: the kernel forks before q is
    loaded, so the producer's first copies fly while both consumers load q's rows (row
    r: token r // N, head r % N; zero past num_rows) and scale each by the power of two
    that puts its largest entry in (Q_TOP / 2, Q_TOP]. The first consumer stores the
    first latent half's terms (q_a), the second the rest (q_b, q_r); each stores its
    own qk_scales row (qk_base / the rows' scale: S^T's columns to base-2 logits), then
    both wait at q_ready (count 2) for all of it."""
    BLOCK_H: gl.constexpr = q_a.type.shape[0] // 2
    HALF_L: gl.constexpr = q_a.type.shape[1]
    R: gl.constexpr = q_r.type.shape[1]
    x_a, x_b, x_r = load_q(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh,
                           BLOCK_H, 2 * HALF_L, HALF_L, R, rows)
    x_a = x_a.to(gl.float32)
    x_b = x_b.to(gl.float32)
    x_r = x_r.to(gl.float32)
    q_scale = _row_scale(gl.maximum(gl.maximum(gl.max(gl.abs(x_a), 1),
                                               gl.max(gl.abs(x_b), 1)),
                                    gl.max(gl.abs(x_r), 1)))
    if c == 0:
        q_a.store(_q_terms(x_a, q_scale))
    else:
        q_b.store(_q_terms(x_b, q_scale))
        q_r.store(_q_terms(x_r, q_scale))
    qk_scales.index(c).store(qk_base / q_scale)
    fence_async_shared()  # the terms (generic proxy) before wgmma reads them (async)
    mbarrier.arrive(q_ready, count=1)
    mbarrier.wait(q_ready, 0)


@gluon.jit
def _row_scale(amax):
    """The power of two that puts a row's largest entry amax in (Q_TOP / 2, Q_TOP]."""
    return gl.exp2(gl.floor(gl.log2(Q_TOP / gl.where(amax > 0.0, amax, 1.0))))


@gluon.jit
def _v_operand(block, a_regs: gl.constexpr):
    """V^T of one 128-column block of a tile ([128 l', TILE_N] e4m3, rows in _sigma
    order) as wgmma's register operand."""
    TILE_N: gl.constexpr = block.type.shape[0]
    pairs = block._reinterpret(gl.int16, [TILE_N, 64], gl.NVMMASharedLayout(128, 16)).load(
        _V_PAIRS)
    even, odd = gl.inline_asm_elementwise(_DEINTERLEAVE, "=r,=r,r,r", [pairs],
                                          dtype=(gl.uint8, gl.uint8), is_pure=True, pack=4)
    v_t = gl.join(even, odd).reshape([TILE_N, 128]).permute((1, 0))  # [column, position]
    # Rows from columns to l' = _sigma^-1(column): a relabelling, no data moves.
    bits = v_t.reshape([2, 2, 2, 2, 2, 2, 2, TILE_N]).permute((0, 1, 2, 6, 3, 4, 5, 7))
    v = bits.reshape([128, TILE_N])
    return gl.convert_layout(v.to(gl.float8e4nv, bitcast=True), a_regs)


@gluon.jit
def _halves_sum(x, layout: gl.constexpr):
    """x[:, :ROWS] + x[:, ROWS:] of x [M, 2 ROWS] in a wide layout (columns r and ROWS + r
    in one thread), in `layout`, without moving data."""
    M: gl.constexpr = x.shape[0]
    ROWS: gl.constexpr = x.shape[1] // 2
    a, b = gl.split(x.reshape([M, 2, ROWS]).permute((0, 2, 1)))
    return gl.convert_layout(a + b, layout, assert_trivial=True)


@gluon.jit
def _twice(x, layout: gl.constexpr):
    """x [ROWS] twice over, [2 ROWS] in `layout` (a slice of a wide layout)."""
    ROWS: gl.constexpr = x.shape[0]
    y = gl.join(x, x).permute((1, 0)).reshape([2 * ROWS])
    return gl.convert_layout(y, layout, assert_trivial=True)


@gluon.jit
def _col_max(s, scratch, mma: gl.constexpr):
    """The largest entry of each column of s ([TILE_N, 16] in `mma`, S^T's layout, its
    positions across the 4 warps), in SliceLayout(0, mma): each warp's own through
    shuffles, then the four warps' through shared memory (scratch, [4, 16] float32) and
    one barrier, where `gl.max(s, 0)` takes two barriers and a second round of shared
    memory."""
    TILE_N: gl.constexpr = s.shape[0]
    ROWS: gl.constexpr = s.shape[1]
    scratch.store(gl.max(s.reshape([4, TILE_N // 4, ROWS]), 1))
    # A column's four maxima in one thread, the columns placed as in SliceLayout(0, mma)
    # (registers: columns 1 and 8; lanes 0-1: columns 2 and 4).
    warps_in_regs: gl.constexpr = gl.DistributedLinearLayout(
        [[1, 0], [2, 0], [0, 1], [0, 8]], [[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
        [[0, 0], [0, 0]], [], [4, ROWS])
    return gl.convert_layout(gl.max(scratch.load(warps_in_regs), 0),
                             gl.SliceLayout(0, mma), assert_trivial=True)


@gluon.jit
def _consume(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_terms, lo, hi,
             num_tiles, limit_0, group, num_heads, qk_scales, first, scratch,
             mma: gl.constexpr, rows: gl.constexpr):
    """Consumer warpgroup: online softmax over tiles first, first + CONSUMERS, ... of
    the slice. q_a, q_b, q_r: q's stacked terms ([2 BLOCK_H, W], `_q_terms`); p_terms:
    this consumer's buffer for P's terms, stacked the same way ([2 BLOCK_H, TILE_N]);
    limit_0: seq_len - q_len + 1; qk_scales [BLOCK_H] (in shared memory: a worker
    partition takes no tensors) takes a column of S^T to base-2 logits; scratch: this
    consumer's [4, BLOCK_H] float32 for `_col_max`. P and l come out 2^P_EXP times
    theirs.

    Returns the four 128-column blocks of O^T [128 l', BLOCK_H] (unnormalised, rows in
    _sigma order), m_i and l_i [BLOCK_H] (running max and sum, base 2)."""
    NUM_STAGES: gl.constexpr = ring_a.type.shape[0]
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    ROWS: gl.constexpr = q_a.type.shape[0] // 2
    # O^T against both P terms at once ([128, 2 ROWS] per block, a column per term, the
    # halves added after the loop): one product per k-step, as for S^T.
    wide: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=mma.warps_per_cta, instr_shape=[16, 2 * ROWS, 32])
    a_regs: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=wide, k_width=4)
    # A latent half's ring buffer is two [TILE_N, 128] column blocks (how the 128-byte
    # swizzle stores it).
    blocks: gl.constexpr = gl.NVMMASharedLayout(128, 8)
    blocks_a = ring_a._reinterpret(gl.uint8, [2 * NUM_STAGES, TILE_N, 128], blocks)
    blocks_b = ring_b._reinterpret(gl.uint8, [2 * NUM_STAGES, TILE_N, 128], blocks)
    acc0 = gl.zeros([128, 2 * ROWS], gl.float32, wide)
    acc1 = gl.zeros([128, 2 * ROWS], gl.float32, wide)
    acc2 = gl.zeros([128, 2 * ROWS], gl.float32, wide)
    acc3 = gl.zeros([128, 2 * ROWS], gl.float32, wide)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(0, mma))
    # l's terms summed per thread over the positions it holds, added up once after the
    # loop: a sum across the warps every tile would cost three barriers.
    l_part = gl.zeros([TILE_N, ROWS], gl.float32, mma)
    # S^T against both q terms at once ([TILE_N, 2 ROWS], a column per term): one
    # product per k-step that reads K from shared memory once.
    s_init = gl.zeros([TILE_N, 2 * ROWS], gl.float32, wide)
    qk_scale = qk_scales.load(gl.SliceLayout(0, mma))
    # Bottom-right causal: token t of q_len sees positions < seq_len - q_len + t + 1.
    r_mma = group * ROWS + gl.arange(0, ROWS, gl.SliceLayout(0, mma))
    limit = limit_0 + r_mma // num_heads
    # ready's parity below names tile i only once the buffer's previous tile, i -
    # NUM_STAGES, has landed. With CONSUMERS dividing NUM_STAGES that tile was this
    # consumer's own; otherwise a copy can land after a later one and the wait passes
    # on the old phase (three consumers on four buffers fault so).
    gl.static_assert(NUM_STAGES % CONSUMERS == 0)
    for i in range(first, num_tiles, CONSUMERS):
        slot = i % NUM_STAGES
        start = lo + i * TILE_N
        mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
        k_a = ring_a.index(slot)
        k_b = ring_b.index(slot)
        k_r = ring_r.index(slot)
        if start + TILE_N > hi:
            zero_tail(k_a, k_b, k_r, start, hi, rows)
        s = warpgroup_mma(k_a, q_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
        s = warpgroup_mma(k_b, q_b.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(k_r, q_r.permute((1, 0)), s, is_async=True)
        # Half of V^T's loads and transposes run while S's products do, the other half
        # while the first half's products do (registers for all four do not fit).
        v0 = _v_operand(blocks_a.index(2 * slot), a_regs)
        v1 = _v_operand(blocks_a.index(2 * slot + 1), a_regs)
        s = warpgroup_mma_wait(0, deps=(s,))
        s = _halves_sum(s, mma)

        pos = start + gl.arange(0, TILE_N, gl.SliceLayout(1, mma))
        visible = (pos < hi)[:, None] & (pos[:, None] < limit[None, :])
        s = gl.where(visible, s * qk_scale[None, :], float("-inf"))
        m_new = gl.maximum(m_i, _col_max(s, scratch, mma))
        # A row with nothing visible yet keeps m = -inf: shift by 0 so exp2 gives 0.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(s - (m_safe - P_EXP)[None, :])
        l_part = l_part * alpha[None, :] + p
        m_i = m_new
        hi_p, lo_p = _two_terms(p)
        p_terms.slice(0, ROWS).store(gl.permute(hi_p, (1, 0)))
        p_terms.slice(ROWS, ROWS).store(gl.permute(lo_p, (1, 0)))
        fence_async_shared()
        alpha_2 = _twice(alpha, gl.SliceLayout(0, wide))[None, :]
        p_t = p_terms.permute((1, 0))
        acc0 = warpgroup_mma(v0, p_t, acc0 * alpha_2, is_async=True)
        acc1 = warpgroup_mma(v1, p_t, acc1 * alpha_2, is_async=True)
        v2 = _v_operand(blocks_b.index(2 * slot), a_regs)
        v3 = _v_operand(blocks_b.index(2 * slot + 1), a_regs)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        acc2 = warpgroup_mma(v2, p_t, acc2 * alpha_2, is_async=True)
        acc3 = warpgroup_mma(v3, p_t, acc3 * alpha_2, is_async=True)
        acc2, acc3 = warpgroup_mma_wait(0, deps=(acc2, acc3))
        # The buffer's loads (generic proxy) before the producer's next copy (async).
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
    return (_halves_sum(acc0, mma), _halves_sum(acc1, mma), _halves_sum(acc2, mma),
            _halves_sum(acc3, mma), m_i, gl.sum(l_part, 0))


@gluon.jit
def _consume_first(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_terms, lo, hi,
                   num_tiles, limit_0, group, num_heads, qk_scales, scratch, q_ptr, q_begin,
                   num_rows, stride_qt, stride_qh, qk_base, q_ready, mma: gl.constexpr,
                   rows: gl.constexpr):
    """The first consumer warpgroup: its part of q (`_q_prologue`), then tiles 1, 3, 5,
    ... of the slice (`_consume`)."""
    _q_prologue(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh, q_a, q_b,
                q_r, qk_scales, qk_base, q_ready, 0, rows)
    return _consume(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_terms, lo, hi,
                    num_tiles, limit_0, group, num_heads, qk_scales.index(0), 1, scratch,
                    mma, rows)


@gluon.jit
def _consume_kept(ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_terms, lo, hi,
                  num_tiles, limit_0, group, num_heads, qk_scales, kept, kept_ml, scratch,
                  q_ptr, q_begin, num_rows, stride_qt, stride_qh, qk_base, q_ready,
                  mma: gl.constexpr, rows: gl.constexpr):
    """The second consumer warpgroup: its part of q (`_q_prologue`), then tiles 0, 2, 4,
    ... of the slice (`_consume`), its O^T blocks, m_i and l_i left in kept [4, 128,
    BLOCK_H] and kept_ml [2, BLOCK_H]."""
    _q_prologue(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh, q_a, q_b,
                q_r, qk_scales, qk_base, q_ready, 1, rows)
    acc0, acc1, acc2, acc3, m_i, l_i = _consume(
        ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r, p_terms, lo, hi, num_tiles,
        limit_0, group, num_heads, qk_scales.index(1), 0, scratch, mma, rows)
    kept.index(0).store(acc0)
    kept.index(1).store(acc1)
    kept.index(2).store(acc2)
    kept.index(3).store(acc3)
    kept_ml.index(0).store(m_i)
    kept_ml.index(1).store(l_i)


@gluon.jit
def _fold(acc0, acc1, acc2, acc3, m_i, l_i, kept, kept_ml, mma: gl.constexpr):
    """The first consumer's O^T blocks, m_i and l_i merged with the second's (kept,
    kept_ml): both rescaled to the larger running max."""
    m_1 = kept_ml.index(0).load(gl.SliceLayout(0, mma))
    l_1 = kept_ml.index(1).load(gl.SliceLayout(0, mma))
    m_new = gl.maximum(m_i, m_1)
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # no visible key in either
    a_0 = gl.exp2(m_i - m_safe)
    a_1 = gl.exp2(m_1 - m_safe)
    return (acc0 * a_0[None, :] + kept.index(0).load(mma) * a_1[None, :],
            acc1 * a_0[None, :] + kept.index(1).load(mma) * a_1[None, :],
            acc2 * a_0[None, :] + kept.index(2).load(mma) * a_1[None, :],
            acc3 * a_0[None, :] + kept.index(3).load(mma) * a_1[None, :],
            m_new, l_i * a_0 + l_1 * a_1)


@gluon.jit
def _store_block(acc, norm, block: gl.constexpr, out_cols, part_cols, row_ok, store_ok,
                 splits, store: gl.constexpr):
    """Store one 128-column block of O^T [128 l', BLOCK_H] times norm, at latent columns
    128 * block + _sigma(l'): to out (out_cols: each row's first column) for a request
    in one split, else to the float32 partials (part_cols)."""
    o = gl.convert_layout(acc * norm[None, :], store)
    col = 128 * block + _sigma(gl.arange(0, 128, gl.SliceLayout(1, store)))
    if splits == 1:
        gl.store(out_cols[None, :] + col[:, None], o.to(out_cols.dtype.element_ty),
                 mask=row_ok[None, :])
    else:
        gl.store(part_cols[None, :] + col[:, None], o, mask=store_ok[None, :])


@gluon.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "stride_lh"],
    do_not_specialize_on_alignment=["block_table_ptr"])
def _decode_fp8_kernel(
    q_ptr, latent_desc, rope_desc, scale_ptr, block_table_ptr, work_ptr, out_ptr, lse_ptr,
    part_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_heads, softmax_scale,
    L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
    TILE_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """One split, as `decode_hopper._decode_partial_ws_kernel` with an fp8 cache."""
    HALF_L: gl.constexpr = latent_desc.block_type.shape[1]
    kv_scale = gl.load(scale_ptr)  # first: its round trip overlaps the work row's
    (group, splits, req, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles,
     partial) = program_slice(work_ptr, num_heads, BLOCK_H, TILE_N)
    if splits == 0:  # past the plan's splits: exit before any set-up (`split_plan`)
        return

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_H, 32])
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    ring_a, ring_b, ring_r, ready, empty = copy_ring(latent_desc, rope_desc, STAGES, TILE_N)

    latent_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, HALF_L],
                                                                  gl.float8e4nv)
    rope_q: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, R],
                                                                gl.float8e4nv)
    q_a = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, HALF_L], latent_q)
    q_b = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, HALF_L], latent_q)
    q_r = gl.allocate_shared_memory(gl.float8e4nv, [2 * BLOCK_H, R], rope_q)
    # Each consumer's P terms and `_col_max` scratch, and the second consumer's state for
    # `_fold`.
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * BLOCK_H, TILE_N],
                                                                  gl.float8e4nv)
    p_terms = gl.allocate_shared_memory(gl.float8e4nv, [CONSUMERS, 2 * BLOCK_H, TILE_N],
                                        p_layout)
    max_scratch = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 4, BLOCK_H],
                                        gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    kept = gl.allocate_shared_memory(gl.float32, [4, 128, BLOCK_H],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    vector: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    kept_ml = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], vector)
    # Each consumer's copy of S^T's column scales (`_q_prologue`): through shared memory,
    # where `_consume` loads them in S^T's column layout (a layout conversion of q's
    # scale gave wrong values in some columns, Triton 3.6).
    qk_scales = gl.allocate_shared_memory(gl.float32, [CONSUMERS, BLOCK_H], vector)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=CONSUMERS)
    fence_async_shared()

    # Scores in base 2: the cache stores x / scale, and q is q_scale times its value.
    qk_base = softmax_scale * 1.4426950408889634 * kv_scale
    table_row = block_table_ptr + req.to(gl.int64) * stride_bt

    limit_0 = seq_len - q_len + 1
    acc0, acc1, acc2, acc3, m_i, l_i = gl.warp_specialize([
        (_consume_first, (ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r,
                          p_terms.index(0), lo, hi, num_tiles, limit_0, group, num_heads,
                          qk_scales, max_scratch.index(0), q_ptr, q_begin, num_rows,
                          stride_qt, stride_qh, qk_base, q_ready, mma, rows)),
        (_consume_kept, (ring_a, ring_b, ring_r, ready, empty, q_a, q_b, q_r,
                         p_terms.index(1), lo, hi, num_tiles, limit_0, group, num_heads,
                         qk_scales, kept, kept_ml, max_scratch.index(1), q_ptr, q_begin,
                         num_rows, stride_qt, stride_qh, qk_base, q_ready, mma, rows)),
        (produce_tiles, (latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty,
                         table_row, lo, hi, 0, num_tiles, 0, PAGE, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
    acc0, acc1, acc2, acc3, m_i, l_i = _fold(acc0, acc1, acc2, acc3, m_i, l_i, kept,
                                             kept_ml, mma)

    gdc_launch_dependents()  # the combine may launch now; it waits for this grid
    # O and l are 2^P_EXP times theirs.
    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    norm = kv_scale / gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key,
                   (m_i + gl.log2(gl.where(has_key, l_i, 1.0)) - P_EXP) * 0.6931471805599453,
                   float("-inf"))  # natural log
    store: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, num_warps], [0, 1])
    r_st = group * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(0, store))
    lse = gl.convert_layout(lse, gl.SliceLayout(0, store))
    row_ok = r_st < num_rows
    token = (q_begin + r_st // num_heads).to(gl.int64)
    head = (r_st % num_heads).to(gl.int64)
    out_cols = out_ptr + token * stride_ot + head * stride_oh
    at = r_st.to(gl.int64) * gl.num_programs(1) + partial
    part_cols = part_ptr + at * L
    store_ok = row_ok & (lse > float("-inf"))  # a partial with no visible key is never read
    _store_block(acc0, norm, 0, out_cols, part_cols, row_ok, store_ok, splits, store)
    _store_block(acc1, norm, 1, out_cols, part_cols, row_ok, store_ok, splits, store)
    _store_block(acc2, norm, 2, out_cols, part_cols, row_ok, store_ok, splits, store)
    _store_block(acc3, norm, 3, out_cols, part_cols, row_ok, store_ok, splits, store)
    if splits == 1:
        gl.store(lse_ptr + token * stride_lt + head * stride_lh, lse, mask=row_ok)
    else:
        gl.store(part_lse_ptr + at, lse, mask=row_ok)


def decode_partial(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
    part_lse: torch.Tensor, head_groups: int, softmax_scale: float, L: int,
) -> None:
    """Launch stage 1 for a batch `supported` accepted (as `decode_hopper.decode_partial`,
    one split per program)."""
    latent_desc, rope_desc = page_descriptors(data, L)
    launch(_decode_fp8_kernel, q, data, scale, block_table, plan, out, lse, part_out,
           part_lse, head_groups, softmax_scale, L, latent_desc=latent_desc,
           rope_desc=rope_desc, BLOCK_H=BLOCK_H, TILE_N=BLOCK_N, STAGES=STAGES,
           num_warps=4)
