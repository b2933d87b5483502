"""Stage 1 of paged latent decode on Hopper for many query rows: 64 heads per program.

Same contract as `decode_triton._decode_partial_kernel` (one program per head group and
split of a request; final output or float32 partials plus lse), for the compute-bound
regime: more than 16 query rows per request (N = 128 is DeepSeek-V3 on one GPU or with
data-parallel attention), page size a multiple of 8 (16-bit cache) or any (fp8; with
pages the copy engine reads, `decode_hopper_fp8` takes up to 32 rows first).

With 64 query rows the products are the direct ones, S = Q K^T [64, 64] over all L + R
columns and O += P V [64, L], and they do not fit one warpgroup: O alone is 128 KB of
float32. The program splits the work by role, as a warp-specialized kernel:

* a producer warp streams the 64-position tiles into a ring of two buffers with bulk
  tensor copies (`decode_hopper.produce_tiles`, shared with the 16-row kernel);
* the score warpgroup computes S for tile i, the online softmax (base 2), and hands P
  (16-bit, in shared memory) with the rescale factor alpha to
* two output warpgroups, each owning one half of O ([64, L / 2] float32, 128
  registers per thread): O_half = alpha O_half + P V_half.

The score warpgroup starts on tile i + 1 while the output warpgroups multiply tile i,
so the tensor cores always hold both kinds of product. With a 16-bit cache the score
warpgroup holds q's first latent half in registers as the A operand of S's first
product: S reads both operands from shared memory otherwise, and at N = 64 that takes
all of shared memory's bandwidth. q (72 KB), the ring (2 x 72 KB) and P (8 KB) fill 224
of the 227 KB of shared memory; P has one buffer, guarded by a `p_ready` / `p_free`
mbarrier pair.

An fp8 cache needs its tiles widened to 16 bits before either product (Hopper's 8-bit
wgmma takes only K-major operands, and V is not). There is no room for an e4m3 staging
ring beside the 16-bit one, so a widening warpgroup replaces the producer and fills the
same ring of two 64-position 16-bit tiles from registers:
* it loads tile i's e4m3 rows from global memory (16 bytes per load, rows found
  through the block table, rows past the slice end read as zero);
* it waits for the ring buffer, widens the codes and stores them;
* it asks L2 (`cp.async.bulk.prefetch`) for the tile FP8_PREFETCH ahead, so that those
  loads hit L2 rather than HBM.
The score and output warpgroups are the 16-bit kernel's, unchanged.
"""

from __future__ import annotations

import math

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
    BLOCK_N,
    STAGES,
    allocate_ring,
    deepseek_call,
    launch,
    load_q,
    page_descriptors,
    pages_copyable,
    produce_tiles,
    program_slice,
    q_operands,
    query_rows,
    zero_tail,
)
from pagedmla.ops.triton.e4m3 import RAW_EXP_BF16, RAW_EXP_F16, e4m3_bits_to
from pagedmla.ops.triton.split_plan import SplitPlan

BLOCK_H = 64  # query rows per program: the wgmma's M
MIN_ROWS = 17  # fewer rows go to `decode_hopper` (swapped products, 16 rows)
FP8_PREFETCH = gl.constexpr(2)  # tiles ahead that the fp8 widener asks L2 for
# Registers per thread of the fp8 kernel's two worker warpgroups (score, widening), so
# that the output warpgroups get 160 (the default partition takes what is left).
FP8_WORKER_REGS = gl.constexpr(96)
# Registers per thread of the 16-bit kernel's score warpgroup: its S accumulator plus
# q's first latent half as the first product's register operand (no spills at 152;
# the output warpgroups keep 168).
SCORE_REGS = gl.constexpr(152)


# fp8: q is scaled by 2^Q_EXP_BF16 (bf16) so that the products of the widener's raw
# values (2^-120 of the codes' in bf16, which saves its multiply) stay in float32's
# normal range: S comes out 2^(Q_EXP - 120) times its value, P is made 2^Q_EXP times
# its value (the exponent's offset), so O comes out 2^(Q_EXP - 120) and l 2^Q_EXP
# times theirs, all undone in the scales. 32 keeps |q| up to 2^96 finite and loses
# only S and O values below 2^-38 to float32's subnormals. fp16 values come out 2^-8
# of the codes', and q and P are left alone.
Q_EXP_BF16 = 32


def _fp8_exponents(dtype: torch.dtype | None) -> dict[str, int]:
    """The kernel's Q_EXP and RAW_EXP for an fp8 cache and q of `dtype` (None: a
    16-bit cache, no scaling)."""
    if dtype is None:
        return {"Q_EXP": 0, "RAW_EXP": 0}
    if dtype == torch.bfloat16:
        return {"Q_EXP": Q_EXP_BF16, "RAW_EXP": RAW_EXP_BF16}
    return {"Q_EXP": 0, "RAW_EXP": RAW_EXP_F16}


def supported(q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int) -> bool:
    """Whether this kernel takes the call (on a Hopper GPU: the decode table in `selection`
    checks the device): DeepSeek widths (L = 512, R = 64), more than 16 query rows per
    request, a bf16/fp16 q with a cache of the same dtype or fp8, and a cache layout the
    tiles can come from: pages the copy engine reads (16-bit,
    `decode_hopper.pages_copyable`), or for fp8 any page size with 16-byte aligned pages
    and rows (the widener loads rows of 16-byte vectors)."""
    if not (deepseek_call(q, data, L) and num_rows >= MIN_ROWS
            and data.dtype in (q.dtype, FP8_DTYPE)):
        return False
    if data.dtype != FP8_DTYPE:
        return pages_copyable(data)
    return (data.stride(-1) == 1 and data.stride(1) > 0 and data.stride(1) % 16 == 0
            and data.stride(0) % data.stride(1) == 0 and data.data_ptr() % 16 == 0)


def _prefetch_rows(page: int) -> int:
    """Rows per L2 request of the fp8 widener: the largest power of two up to 32 that
    divides the page (a request stays inside its page), 0 (none) below 8 rows."""
    rows = math.gcd(page, 32)
    return rows if rows >= 8 else 0


@gluon.jit
def _cache_row(page, pos, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr):
    """Row (int64, in units of the row stride) of position `pos`'s slot in `page` (its
    block-table entry), pages PAGE_ROWS rows apart (PAGE where they are adjacent)."""
    return page.to(gl.int64) * PAGE_ROWS + pos % PAGE


@gluon.jit
def _load_codes(data_ptr, table_row, stride_row, start, hi, COL0: gl.constexpr,
                TILE_N: gl.constexpr, WIDTH: gl.constexpr, PAGE: gl.constexpr,
                PAGE_ROWS: gl.constexpr, layout: gl.constexpr):
    """e4m3 codes (uint8) of cache rows [start, start + TILE_N), columns [COL0, COL0 +
    WIDTH), each row found through the block table; rows at positions >= hi read as 0
    (their slots may hold NaN)."""
    pos = start + gl.arange(0, TILE_N, gl.SliceLayout(1, layout))
    ok = pos < hi
    if PAGE % TILE_N == 0:  # tiles start at multiples of TILE_N: one page per tile
        page = gl.load(table_row + start // PAGE)
    else:
        page = gl.load(table_row + pos // PAGE, mask=ok, other=0)
    row = _cache_row(page, pos, PAGE, PAGE_ROWS)
    cols = COL0 + gl.arange(0, WIDTH, gl.SliceLayout(0, layout))
    return gl.load(data_ptr + row[:, None] * stride_row + cols[None, :], mask=ok[:, None],
                   other=0)


@gluon.jit
def _prefetch_tile(data_ptr, table_row, stride_row, start, hi, TILE_N: gl.constexpr,
                   WIDTH: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr,
                   PF_ROWS: gl.constexpr):
    """Ask L2 for the cache rows of the tile at `start`, one bulk request per PF_ROWS
    rows (a power of two dividing the page, 8 to 32: a request never leaves its page;
    0: no requests). Lane 0 of each warp issues them; a hint, never needed for
    correctness. A request spans from its first row to the end of its last row's WIDTH
    codes (rows stride_row bytes apart, both multiples of 16, as the instruction asks)."""
    if PF_ROWS > 0:
        for h in gl.static_range(TILE_N // PF_ROWS):
            pos = start + PF_ROWS * h
            if pos < hi:
                row = _cache_row(gl.load(table_row + pos // PAGE), pos, PAGE, PAGE_ROWS)
                gl.inline_asm_elementwise(
                    "{ .reg .pred p; .reg .u32 l; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
                    "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                    "=r,l,r", [data_ptr + row * stride_row, (PF_ROWS - 1) * stride_row + WIDTH],
                    dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _widen(data_ptr, table_row, stride_row, ring_a, ring_b, ring_r, ready, empty, lo, hi,
           num_tiles, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, PF_ROWS: gl.constexpr):
    """Widening warpgroup (fp8 cache), also the producer: tile i's e4m3 rows are loaded
    into registers before ring buffer i % STAGES is free, then widened into it (rows at
    positions >= hi zero). L2 is asked for tile i + FP8_PREFETCH first."""
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    HALF_L: gl.constexpr = ring_a.type.shape[2]
    R: gl.constexpr = ring_r.type.shape[2]
    STAGES: gl.constexpr = ring_a.type.shape[0]
    # 16 codes (one 16-byte load) per thread and row.
    latent: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])
    rope: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    for k in gl.static_range(1, FP8_PREFETCH):
        _prefetch_tile(data_ptr, table_row, stride_row, lo + k * TILE_N, hi, TILE_N,
                       2 * HALF_L + R, PAGE, PAGE_ROWS, PF_ROWS)
    for i in range(num_tiles):
        slot = i % STAGES
        start = lo + i * TILE_N
        _prefetch_tile(data_ptr, table_row, stride_row, start + FP8_PREFETCH * TILE_N, hi,
                       TILE_N, 2 * HALF_L + R, PAGE, PAGE_ROWS, PF_ROWS)
        codes_a = _load_codes(data_ptr, table_row, stride_row, start, hi, 0, TILE_N, HALF_L,
                              PAGE, PAGE_ROWS, latent)
        codes_b = _load_codes(data_ptr, table_row, stride_row, start, hi, HALF_L, TILE_N,
                              HALF_L, PAGE, PAGE_ROWS, latent)
        codes_r = _load_codes(data_ptr, table_row, stride_row, start, hi, 2 * HALF_L, TILE_N,
                              R, PAGE, PAGE_ROWS, rope)
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
        ring_a.index(slot).store(e4m3_bits_to(codes_a, ring_a.dtype, True, True))
        ring_b.index(slot).store(e4m3_bits_to(codes_b, ring_a.dtype, True, True))
        ring_r.index(slot).store(e4m3_bits_to(codes_r, ring_a.dtype, True, True))
        # Order the stores before the products' reads (through the async proxy).
        fence_async_shared()
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _score(ring_a, ring_b, ring_r, ready, q_a, q_b, q_r, p_smem, alpha_smem, m_smem,
           l_smem, p_ready, p_free, done, lo, hi, num_tiles, seq_len, q_len, num_heads, group,
           qk_scale, q_ptr, q_begin, num_rows, stride_qt, stride_qh, ZERO_TAIL: gl.constexpr,
           P_EXP: gl.constexpr):
    """Score warpgroup: S = Q K^T per tile, online softmax (base 2), P and alpha to the
    output warpgroups. Tile i is in buffer i % NBUF of ring_a / ring_b / ring_r (copied
    there, or with fp8 widened into it), signalled by `ready`. ZERO_TAIL: the
    slice's last, partial tile is zeroed in place first (its slots past seq_len may hold
    NaN, and the output warpgroups read it as V; the fp8 widener zeroes them itself).
    qk_scale (> 0: it scales row maxima, not each score) takes S to base-2 logits; P and
    the sum come out 2^P_EXP times their values (fp8, see Q_EXP_BF16). At the end the
    running max and sum go to m_smem and l_smem."""
    TILE_N: gl.constexpr = ring_a.type.shape[1]
    NBUF: gl.constexpr = ring_a.type.shape[0]
    ROWS: gl.constexpr = q_a.type.shape[0]
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TILE_N, 16])
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # Bottom-right causal: token t of q_len sees positions < seq_len - q_len + t + 1.
    r_idx = group * ROWS + gl.arange(0, ROWS, gl.SliceLayout(1, mma))
    limit = seq_len - q_len + r_idx // num_heads + 1
    # Positions below full_hi are visible to every row of the group: no mask there.
    full_hi = gl.minimum(hi, seq_len - q_len + (group * ROWS) // num_heads + 1)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, mma))
    s_init = gl.zeros([ROWS, TILE_N], gl.float32, mma)
    if ZERO_TAIL:  # 16-bit cache: the first latent half of q from registers
        a_regs: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        HALF_L: gl.constexpr = q_a.type.shape[1]
        q_rows, r_ok = query_rows(q_ptr, q_begin, group, num_heads, num_rows, stride_qt,
                                  stride_qh, ROWS, gl.SliceLayout(1, a_regs))
        cq = gl.arange(0, HALF_L, gl.SliceLayout(0, a_regs))
        q_first = gl.load(q_rows[:, None] + cq[None, :], mask=r_ok[:, None], other=0.0)
    for i in range(num_tiles):
        slot = i % NBUF
        mbarrier.wait(ready.index(slot), (i // NBUF) & 1)
        start = lo + i * TILE_N
        k_a = ring_a.index(slot)
        k_b = ring_b.index(slot)
        k_r = ring_r.index(slot)
        if ZERO_TAIL and start + TILE_N > hi:
            zero_tail(k_a, k_b, k_r, start, hi, rows)
        if ZERO_TAIL:
            s = warpgroup_mma(q_first, k_a.permute((1, 0)), s_init, use_acc=False,
                              is_async=True)
        else:
            s = warpgroup_mma(q_a, k_a.permute((1, 0)), s_init, use_acc=False, is_async=True)
        s = warpgroup_mma(q_b, k_b.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(q_r, k_r.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))

        if start + TILE_N > full_hi:  # the slice's end or a row's causal limit inside
            pos = start + gl.arange(0, TILE_N, gl.SliceLayout(0, mma))
            visible = (pos < hi)[None, :] & (pos[None, :] < limit[:, None])
            s = gl.where(visible, s, float("-inf"))
        # The scale (positive) is applied to the row max and, in one multiply-add, to
        # the exponent: max(s) * c = max(s * c).
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        # A row with nothing visible yet keeps m = -inf: shift by 0 so exp2 gives 0.
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        # P and l: 2^P_EXP times their values
        p = gl.exp2(s * qk_scale - (m_safe - P_EXP)[:, None])
        l_i = l_i * alpha + gl.sum(p, 1)
        m_i = m_new
        # P(i - 1) and alpha(i - 1) are free once the output warpgroups multiplied.
        mbarrier.wait(p_free, (i & 1) ^ 1)
        p_smem.store(p.to(p_smem.dtype))
        alpha_smem.store(alpha)
        fence_async_shared()
        mbarrier.arrive(p_ready, count=1)
    m_smem.store(m_i)
    l_smem.store(l_i)
    mbarrier.arrive(done, count=1)


@gluon.jit
def _accumulate(ring_a, ring_b, ready, empty, p_smem, alpha_smem, p_ready, p_free,
                num_tiles, mma: gl.constexpr):
    """Output warpgroups (the default partition, two warpgroups splitting the columns):
    O = alpha O + P V per tile, V being the latent halves in buffer i % NBUF of ring_a /
    ring_b, released through `empty` after the products.

    Returns acc_a, acc_b [ROWS, L / 2] (unnormalised)."""
    ROWS: gl.constexpr = p_smem.type.shape[0]
    HALF_L: gl.constexpr = ring_a.type.shape[2]
    NBUF: gl.constexpr = ring_a.type.shape[0]
    acc_a = gl.zeros([ROWS, HALF_L], gl.float32, mma)
    acc_b = gl.zeros([ROWS, HALF_L], gl.float32, mma)
    for i in range(num_tiles):
        slot = i % NBUF
        # The score warpgroup saw the copy complete too; this wait is what orders
        # these warps' reads after it.
        mbarrier.wait(ready.index(slot), (i // NBUF) & 1)
        mbarrier.wait(p_ready, i & 1)
        alpha = alpha_smem.load(gl.SliceLayout(1, mma))[:, None]
        acc_a = warpgroup_mma(p_smem, ring_a.index(slot), acc_a * alpha, is_async=True)
        acc_b = warpgroup_mma(p_smem, ring_b.index(slot), acc_b * alpha, is_async=True)
        acc_a, acc_b = warpgroup_mma_wait(0, deps=(acc_a, acc_b))
        mbarrier.arrive(p_free, count=1)
        mbarrier.arrive(empty.index(slot), count=1)
    return acc_a, acc_b


@gluon.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_bt", "stride_lh"],
    do_not_specialize_on_alignment=["block_table_ptr"])
def _decode_heads_kernel(
    q_ptr, latent_desc, rope_desc, codes_ptr, scale_ptr, block_table_ptr, work_ptr,
    out_ptr, lse_ptr, part_ptr, part_lse_ptr,
    stride_qt, stride_qh,
    stride_cp,
    stride_bt,
    stride_ot, stride_oh,
    stride_lt, stride_lh,
    num_heads, softmax_scale,
    L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, BLOCK_H: gl.constexpr,
    TILE_N: gl.constexpr, STAGES: gl.constexpr, IS_FP8: gl.constexpr,
    PAGE_ROWS: gl.constexpr, PF_ROWS: gl.constexpr, Q_EXP: gl.constexpr,
    RAW_EXP: gl.constexpr, num_warps: gl.constexpr,
):
    """One (head group of BLOCK_H rows, split), as `decode_triton._decode_partial_kernel`.
    A 16-bit cache's tiles are copied through latent_desc ([TILE_N, L / 2] boxes) and
    rope_desc ([TILE_N, R] boxes) over the cache viewed as [pages x PAGE, L + R] rows;
    an fp8 cache is read as uint8 codes through codes_ptr (row stride stride_cp, pages
    PAGE_ROWS rows apart), the descriptors None, and PF_ROWS rows per L2 request
    (`_prefetch_rows`). Splits start at multiples of TILE_N (the split plan's tile).
    num_warps = 8: the two output warpgroups."""
    HALF_L: gl.constexpr = L // 2
    (group, splits, req, seq_len, q_begin, q_len, num_rows, lo, hi, num_tiles,
     partial) = program_slice(work_ptr, num_heads, BLOCK_H, TILE_N)
    if splits == 0:  # past the plan's splits: exit before any set-up (`split_plan`)
        return

    compute: gl.constexpr = q_ptr.dtype.element_ty
    # The output accumulators: each warpgroup owns half of every [BLOCK_H, L / 2] half.
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, num_warps // 4],
        instr_shape=[16, HALF_L // (num_warps // 4), 16])
    rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    if IS_FP8:  # a ring of 16-bit tiles, filled by the widening warpgroup
        ring_dtype: gl.constexpr = compute
        latent_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, HALF_L],
                                                                           compute)
        rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE_N, R], compute)
    else:  # the bulk copies' ring
        ring_dtype: gl.constexpr = latent_desc.dtype
        latent_layout: gl.constexpr = latent_desc.layout
        rope_layout: gl.constexpr = rope_desc.layout
    ring_a, ring_b, ring_r, ready, empty = allocate_ring(
        ring_dtype, latent_layout, rope_layout, STAGES, TILE_N, HALF_L, R)
    handoff = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    p_ready = handoff.index(0)  # P and alpha of the next tile are written
    p_free = handoff.index(1)  # the output warpgroups are done with them
    done = handoff.index(2)  # the final m and l are in m_smem / l_smem
    for k in gl.static_range(3):
        mbarrier.init(handoff.index(k), count=1)

    x_a, x_b, x_r = load_q(q_ptr, q_begin, group, num_heads, num_rows, stride_qt, stride_qh,
                           BLOCK_H, L, HALF_L, R, rows)
    q_a, q_b, q_r = q_operands(x_a, x_b, x_r, 2.0 ** Q_EXP)
    p_smem = gl.allocate_shared_memory(
        compute, [BLOCK_H, TILE_N],
        gl.NVMMASharedLayout.get_default_for([BLOCK_H, TILE_N], compute))
    flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    m_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    l_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    fence_async_shared()

    # Scores in base 2; an fp8 cache stores x / scale, so the scale multiplies the
    # scores here and the output below.
    qk_scale = softmax_scale * 1.4426950408889634
    if IS_FP8:
        kv_scale = gl.load(scale_ptr)
        qk_scale = qk_scale * kv_scale * 2.0 ** (RAW_EXP - Q_EXP)
    table_row = block_table_ptr + req.to(gl.int64) * stride_bt
    # (Argument tuples written out in each call: a tuple held in a variable would turn
    # the constexpr layouts into tensors.)
    if IS_FP8:
        acc_a, acc_b = gl.warp_specialize([
            (_accumulate, (ring_a, ring_b, ready, empty, p_smem, alpha_smem, p_ready, p_free,
                           num_tiles, mma)),
            (_score, (ring_a, ring_b, ring_r, ready, q_a, q_b, q_r, p_smem, alpha_smem,
                      m_smem, l_smem, p_ready, p_free, done, lo, hi, num_tiles, seq_len,
                      q_len, num_heads, group, qk_scale, q_ptr, q_begin, num_rows, stride_qt,
                      stride_qh, False, Q_EXP)),
            (_widen, (codes_ptr, table_row, stride_cp, ring_a, ring_b, ring_r, ready, empty,
                      lo, hi, num_tiles, PAGE, PAGE_ROWS, PF_ROWS)),
        ], [4, 4], [FP8_WORKER_REGS, FP8_WORKER_REGS])
    else:
        acc_a, acc_b = gl.warp_specialize([
            (_accumulate, (ring_a, ring_b, ready, empty, p_smem, alpha_smem, p_ready, p_free,
                           num_tiles, mma)),
            (_score, (ring_a, ring_b, ring_r, ready, q_a, q_b, q_r, p_smem, alpha_smem,
                      m_smem, l_smem, p_ready, p_free, done, lo, hi, num_tiles, seq_len,
                      q_len, num_heads, group, qk_scale, q_ptr, q_begin, num_rows, stride_qt,
                      stride_qh, True, 0)),
            (produce_tiles, (latent_desc, rope_desc, ring_a, ring_b, ring_r, ready, empty,
                             table_row, lo, hi, 0, num_tiles, 0, PAGE, STAGES)),
        ], [4, 1], [SCORE_REGS, 24])

    mbarrier.wait(done, 0)
    gdc_launch_dependents()  # the combine may launch now; it waits for this grid
    m_i = m_smem.load(gl.SliceLayout(1, mma))
    l_i = l_smem.load(gl.SliceLayout(1, mma))
    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    if IS_FP8:  # O and l are 2^(Q_EXP - RAW_EXP) and 2^Q_EXP times their values
        norm = 2.0 ** RAW_EXP / gl.where(has_key, l_i, 1.0) * kv_scale
    else:
        norm = 1.0 / gl.where(has_key, l_i, 1.0)
    lse = gl.where(has_key,
                   (m_i + gl.log2(gl.where(has_key, l_i, 1.0)) - Q_EXP) * 0.6931471805599453,
                   float("-inf"))  # natural log
    # Stored from a row-contiguous layout (a warp's store covers 128 columns of one
    # row), through shared memory: straight from the mma layout each store would touch
    # eight rows, 32 bytes of each.
    store: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
    out_a = gl.convert_layout(acc_a * norm[:, None], store)
    out_b = gl.convert_layout(acc_b * norm[:, None], store)
    r_out = group * BLOCK_H + gl.arange(0, BLOCK_H, gl.SliceLayout(1, store))
    lse = gl.convert_layout(lse, gl.SliceLayout(1, store))
    row_ok = r_out < num_rows
    out_cols = gl.arange(0, HALF_L, gl.SliceLayout(0, store))
    if splits == 1:
        token = (q_begin + r_out // num_heads).to(gl.int64)
        head = (r_out % num_heads).to(gl.int64)
        out_rows = out_ptr + token * stride_ot + head * stride_oh
        gl.store(out_rows[:, None] + out_cols[None, :], out_a.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        gl.store(out_rows[:, None] + HALF_L + out_cols[None, :],
                 out_b.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        gl.store(lse_ptr + token * stride_lt + head * stride_lh, lse, mask=row_ok)
    else:  # a partial with no visible key is never read: not stored
        at = r_out.to(gl.int64) * gl.num_programs(1) + partial
        store_ok = row_ok & (lse > float("-inf"))
        gl.store(part_ptr + at[:, None] * L + out_cols[None, :], out_a,
                 mask=store_ok[:, None])
        gl.store(part_ptr + at[:, None] * L + HALF_L + out_cols[None, :], out_b,
                 mask=store_ok[:, None])
        gl.store(part_lse_ptr + at, lse, mask=row_ok)


def decode_partial(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    plan: SplitPlan, out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
    part_lse: torch.Tensor, head_groups: int, softmax_scale: float, L: int,
) -> None:
    """Launch stage 1 for a batch `supported` accepted: grid (head_groups, plan.programs),
    head_groups = ceil(N * max_query_len / BLOCK_H), a split of the plan per program. The
    arguments are `decode_triton.decode_partial`'s."""
    is_fp8 = data.dtype == FP8_DTYPE
    latent_desc, rope_desc = (None, None) if is_fp8 else page_descriptors(data, L)
    launch(_decode_heads_kernel, q, data, scale, block_table, plan, out, lse, part_out,
           part_lse, head_groups, softmax_scale, L, latent_desc=latent_desc,
           rope_desc=rope_desc, codes_ptr=data.view(torch.uint8) if is_fp8 else data,
           stride_cp=data.stride(1), BLOCK_H=BLOCK_H, TILE_N=BLOCK_N, STAGES=STAGES,
           IS_FP8=is_fp8, PAGE_ROWS=data.stride(0) // data.stride(1),
           PF_ROWS=_prefetch_rows(data.shape[1]) if is_fp8 else 0, num_warps=8,
           **_fp8_exponents(q.dtype if is_fp8 else None))
