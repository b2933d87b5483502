"""Variable-length attention with log-sum-exp on Hopper: a warp-specialized Gluon kernel.

Same contract as `prefill_triton._varlen_attention_kernel` (one program per query block
of 128 rows, head and sequence; bottom-right causal; out and lse), for 16-bit inputs
whose rows the bulk tensor copy engine (TMA) can read. Why a second kernel: the Triton
one loads K and V with pointer arithmetic in the instruction stream that also runs the
products and the softmax, and both of its warpgroups reach the softmax together, when
the tensor cores have nothing to do. Here the roles are split:

* a producer warp copies the program's q tile once, then each key tile's K and V into
  a ring of STAGES buffers, K and V with their own `ready` mbarriers (the scores need
  only K) and one `empty` mbarrier per buffer (both consumers let go of it);
* two consumer warpgroups, 64 query rows each, run the products with wgmma, S = Q K^T
  from shared memory and O += P V with P in registers, and the online softmax (base 2).
  Their turns to issue products alternate through a pair of mbarriers ("ping-pong"),
  so one warpgroup's softmax runs while the other's products keep the tensor cores
  busy; and within a warpgroup tile j + 1's scores are issued before tile j's P V, so
  that product runs during tile j + 1's softmax.

The programs running together must find their keys and values in L2, or the producer
waits on HBM: they are launched in head groups (`_program_tile`).

A query block's q rows past its sequence belong to the next sequence (or lie past the
tensor, where the copy reads zeros): they are computed and not stored. Key rows past
the sequence are masked out of the scores, and their V rows are zeroed in shared memory
before P V (they belong to the next sequence and need not be finite).

Its speed against PyTorch's cuDNN attention and the Triton kernel is in
docs/PERFORMANCE.md.
"""

from __future__ import annotations

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

from pagedmla.ops.triton._utils import l2_cache_bytes, next_pow2
from pagedmla.ops.triton.decode_hopper import box_layout
from pagedmla.ops.triton.prefill_triton import SEQ_CHUNK, packed_blocks

BLOCK_M = 128  # query rows per program: two consumer warpgroups of 64
STAGES = 2  # key tiles in flight
# Registers per thread of the second consumer (a worker partition; the first is the
# default partition and gets what the producer's 24 leave). ptxas still compiles the
# worker within the launch's cap, 168 at 12 warps: 52 bytes of spill stores at
# 192 / 128, none at 128 / 128 (sm_90a builds with Triton 3.6).
CONSUMER_REGS = gl.constexpr(240)
SMEM_BUDGET = 220 * 1024  # of the 227 KB a block may use, leaving room for barriers
_DTYPES = (torch.bfloat16, torch.float16)  # the 16-bit inputs the kernel takes


def _qk_parts(qk_dim: int) -> tuple[int, int]:
    """qk columns as two copy boxes: 192 = 128 + 64, 128 = 128 + 0, 256 = 256 + 0."""
    if qk_dim in (64, 128, 256):
        return qk_dim, 0
    return 128, qk_dim - 128


def block_n(qk_dim: int, v_dim: int) -> int:
    """Keys per tile: 128 where q and STAGES tiles of K and V fit shared memory, else 64."""
    for n in (128, 64):
        if 2 * (BLOCK_M * qk_dim + STAGES * n * (qk_dim + v_dim)) <= SMEM_BUDGET:
            return n
    return 0


def _copyable(t: torch.Tensor) -> bool:
    """[T, N, D] rows the copy engine reads as a [T, (N - 1) x stride_h + D] matrix:
    unit last stride, 16-byte aligned base and token / head strides, a token's heads
    within its row stride (tokens outer, as projections lay them out), int32
    coordinates."""
    tokens, heads, dim = t.shape
    elt = t.element_size()
    width = (heads - 1) * t.stride(1) + dim
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * elt) % 16 == 0 and (t.stride(1) * elt) % 16 == 0
            and t.stride(1) >= dim and t.stride(0) >= width
            and tokens < 2**31 and width < 2**31)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              ) -> bool:
    """Whether this kernel takes the call (on a Hopper GPU: the prefill table in
    `selection` checks the device): 16-bit q, k and v of one dtype; qk head dim 64, 128,
    192 or 256 and v head dim 64, 128 or 256 within the shared memory budget; copyable
    rows; a positive softmax scale (the running max is kept in scaled units: max(s) x
    scale is the max of the scaled scores only for a positive scale)."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    return (softmax_scale > 0
            and q.dtype in _DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and qk_dim in (64, 128, 192, 256) and v_dim in (64, 128, 256)
            and block_n(qk_dim, v_dim) > 0 and all(_copyable(t) for t in (q, k, v)))


@gluon.jit
def _produce(q_desc1, q_desc2, k_desc1, k_desc2, v_desc, q_smem1, q_smem2, k_ring1, k_ring2,
             v_ring, q_ready, k_ready, v_ready, empty, q_row, k_row, col_q, col_k, col_v,
             num_tiles, D2: gl.constexpr):
    """Producer warp: the q tile once, then tile j's K and V into buffer j % STAGES once
    the consumers have let go of it."""
    STAGES: gl.constexpr = k_ring1.type.shape[0]
    BLOCK_N: gl.constexpr = k_ring1.type.shape[1]
    D1: gl.constexpr = k_ring1.type.shape[2]
    # The second boxes have D2 columns of the same dtype (none when D2 = 0).
    q_bytes: gl.constexpr = q_desc1.block_type.nbytes * (D1 + D2) // D1
    k_bytes: gl.constexpr = k_desc1.block_type.nbytes * (D1 + D2) // D1
    mbarrier.expect(q_ready, q_bytes)
    tma.async_copy_global_to_shared(q_desc1, [q_row, col_q], q_ready, q_smem1)
    if D2:
        tma.async_copy_global_to_shared(q_desc2, [q_row, col_q + D1], q_ready, q_smem2)
    for j in range(num_tiles):
        slot = j % STAGES
        row = k_row + j * BLOCK_N
        # A fresh mbarrier counts as having completed the phase before phase 0.
        mbarrier.wait(empty.index(slot), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(slot), k_bytes)
        tma.async_copy_global_to_shared(k_desc1, [row, col_k], k_ready.index(slot),
                                        k_ring1.index(slot))
        if D2:
            tma.async_copy_global_to_shared(k_desc2, [row, col_k + D1], k_ready.index(slot),
                                            k_ring2.index(slot))
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [row, col_v], v_ready.index(slot),
                                        v_ring.index(slot))


@gluon.jit
def _scores(q_smem1, q_smem2, k_ring1, k_ring2, k_ready, j, s_init, D2: gl.constexpr):
    """Issue S = Q K_j^T for tile j (asynchronous: the caller waits)."""
    STAGES: gl.constexpr = k_ring1.type.shape[0]
    slot = j % STAGES
    mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
    s = warpgroup_mma(q_smem1, k_ring1.index(slot).permute((1, 0)), s_init, use_acc=False,
                      is_async=True)
    if D2:
        s = warpgroup_mma(q_smem2, k_ring2.index(slot).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax(s, m_i, l_i, start, full_end, k_len, q_shift, rows, qk_scale,
             CAUSAL: gl.constexpr):
    """Online softmax (base 2) of one tile's raw scores s [BLOCK_M, BLOCK_N] (keys from
    `start`); m_i is kept in scaled units, so the scale and the shift are one fused
    multiply-add per score. Tiles past full_end cross the sequence end or the causal
    diagonal and are masked. Returns p (float32), alpha, and the new m_i and l_i."""
    BLOCK_N: gl.constexpr = s.type.shape[1]
    if start + BLOCK_N > full_end:
        keys = start + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s.type.layout))
        visible = (keys < k_len)[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + q_shift)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    # A row that has seen no key keeps m = -inf: shift by 0 so exp2 gives 0, not NaN.
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(s * qk_scale - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _ready_v(v_ring, v_ready, j, k_len, rows: gl.constexpr):
    """Tile j's V buffer once copied, rows at keys >= k_len zeroed (they belong to the
    next sequence, or lie past the tensor; P is 0 there, and 0 x inf would be NaN)."""
    STAGES: gl.constexpr = v_ring.type.shape[0]
    BLOCK_N: gl.constexpr = v_ring.type.shape[1]
    slot = j % STAGES
    mbarrier.wait(v_ready.index(slot), (j // STAGES) & 1)
    v = v_ring.index(slot)
    if (j + 1) * BLOCK_N > k_len:
        x = v.load(rows)
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, rows))
        v.store(gl.where((keys < k_len)[:, None], x, gl.zeros_like(x)))
        fence_async_shared()
    return v


@gluon.jit
def _turn(turn, wg: gl.constexpr, r):
    """Wait for warpgroup wg's round r of issuing products: warpgroup 0 starts, then
    each round of one warpgroup follows the other's (`turn[wg]` completes a phase each
    time the other warpgroup has issued its round)."""
    mbarrier.wait(turn.index(wg), (r & 1) ^ (1 - wg))


@gluon.jit
def _consume(q_smem1, q_smem2, k_ring1, k_ring2, v_ring, q_ready, k_ready, v_ready, empty,
             turn, num_tiles, full_end, k_len, q_shift, m_start, q_begin, q_len, head,
             out_ptr, lse_ptr, stride_ot, stride_oh, stride_lh, stride_lt, qk_scale,
             WG: gl.constexpr, D2: gl.constexpr, CAUSAL: gl.constexpr):
    """Consumer warpgroup WG: rows [64 WG, 64 WG + 64) of the query block, the online
    softmax over the program's key tiles, then its out [64, DV] and lse [64].

    Rounds of issuing products: S_0; then S_{j+1} with P_j V_j, for each tile j; then
    the last P V. Each round waits for this warpgroup's turn and hands the turn over.
    After a round the loop waits for S_{j+1} only and runs its softmax while P_j V_j
    is still on the tensor cores; O is rescaled by the new alpha once that is done."""
    ROWS: gl.constexpr = q_smem1.type.shape[0] // 2
    BLOCK_N: gl.constexpr = k_ring1.type.shape[1]
    DV: gl.constexpr = v_ring.type.shape[2]
    STAGES: gl.constexpr = k_ring1.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # 8 elements (16 bytes) per thread along a V row, for zeroing the rows past k_len.
    v_rows: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_a = q_smem1.slice(WG * ROWS, ROWS)
    q_b = q_smem2.slice(WG * ROWS, ROWS)
    row0 = m_start + WG * ROWS
    rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, s_layout))
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, DV], gl.float32, o_layout)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(q_ready, 0)
    if num_tiles > 0:
        _turn(turn, WG, 0)
        s = _scores(q_a, q_b, k_ring1, k_ring2, k_ready, 0, s_init, D2)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        s = warpgroup_mma_wait(0, deps=(s,))
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, 0, full_end, k_len, q_shift, rows,
                                      qk_scale, CAUSAL)
        for j in range(num_tiles - 1):
            p_op = gl.convert_layout(p.to(q_smem1.dtype), p_layout)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            v = _ready_v(v_ring, v_ready, j, k_len, v_rows)
            _turn(turn, WG, j + 1)
            s = _scores(q_a, q_b, k_ring1, k_ring2, k_ready, j + 1, s_init, D2)
            acc = warpgroup_mma(p_op, v, acc, is_async=True)
            mbarrier.arrive(turn.index(1 - WG), count=1)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, (j + 1) * BLOCK_N, full_end, k_len,
                                          q_shift, rows, qk_scale, CAUSAL)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(empty.index(j % STAGES), count=1)
        last = num_tiles - 1
        p_op = gl.convert_layout(p.to(q_smem1.dtype), p_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        v = _ready_v(v_ring, v_ready, last, k_len, v_rows)
        _turn(turn, WG, num_tiles)
        acc = warpgroup_mma(p_op, v, acc, is_async=True)
        mbarrier.arrive(turn.index(1 - WG), count=1)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(empty.index(last % STAGES), count=1)

    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    norm = gl.convert_layout(1.0 / gl.where(has_key, l_i, 1.0), gl.SliceLayout(1, o_layout))
    lse = gl.where(has_key, (m_i + gl.log2(gl.where(has_key, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # natural log
    out_rows = row0 + gl.arange(0, ROWS, gl.SliceLayout(1, o_layout))
    tok = (q_begin + out_rows).to(gl.int64)
    cols = gl.arange(0, DV, gl.SliceLayout(0, o_layout))
    out_at = out_ptr + tok[:, None] * stride_ot + head.to(gl.int64) * stride_oh + cols[None, :]
    gl.store(out_at, (acc * norm[:, None]).to(out_ptr.dtype.element_ty),
             mask=(out_rows < q_len)[:, None])
    lse_at = lse_ptr + head.to(gl.int64) * stride_lh + (q_begin + rows).to(gl.int64) * stride_lt
    gl.store(lse_at, lse, mask=rows < q_len)


@gluon.jit
def _program_tile(num_heads, num_blocks, GROUP: gl.constexpr):
    """(head, i) of this program: heads in groups of GROUP, and within a group every
    head's i-th block (`_packed_block`: from the last packed block back, so the largest
    causal jobs start first and the tail is short), for i = 0, 1, .. . The group's heads
    are read by the programs running together, so their keys and values are still in L2
    (with all heads at once they would not be: 128 heads x 8k tokens of K and V is 670
    MB)."""
    pid = gl.program_id(0)
    per_group = GROUP * num_blocks
    first = pid // per_group * GROUP
    rest = pid % per_group
    heads = gl.minimum(GROUP, num_heads - first)
    return first + rest % heads, rest // heads


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _query_blocks(cu_q_ptr, s, num_seqs, BLOCK_M: gl.constexpr):
    """As `prefill_triton._query_blocks`: query blocks in sequences s, and which of s
    exist."""
    ok = s < num_seqs
    lo = gl.load(cu_q_ptr + s, mask=ok, other=0)
    hi = gl.load(cu_q_ptr + s + 1, mask=ok, other=0)
    return (hi - lo + BLOCK_M - 1) // BLOCK_M, ok


@gluon.jit
def _packed_block(cu_q_ptr, num_seqs, i, BLOCK_M: gl.constexpr):
    """(sequence, query block) of the program launched i-th, as
    `prefill_triton._packed_block` (Gluon needs the chunk's layout): past the first
    block, (num_seqs, 0)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, SEQ_CHUNK, layout)
    total = gl.to_tensor(0)
    for c in range(0, num_seqs, SEQ_CHUNK):
        total += gl.sum(_query_blocks(cu_q_ptr, c + offs, num_seqs, BLOCK_M)[0], 0)
    w = total - 1 - i  # the packed block, counted from the first
    seq = gl.to_tensor(0)
    start = gl.to_tensor(0)
    base = gl.to_tensor(0)
    for c in range(0, num_seqs, SEQ_CHUNK):
        blocks, ok = _query_blocks(cu_q_ptr, c + offs, num_seqs, BLOCK_M)
        ends = base + gl.associative_scan(blocks, 0, _add)
        done = ok & (ends <= w)
        seq += gl.sum(done.to(gl.int32), 0)
        start = gl.maximum(start, gl.max(gl.where(done, ends, 0), 0))
        base = gl.max(gl.where(ok, ends, 0), 0)
    return gl.where(w < 0, num_seqs, seq), gl.maximum(w - start, 0)


@gluon.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_lh", "num_blocks", "num_seqs"],
    do_not_specialize_on_alignment=["cu_q_ptr", "cu_k_ptr"])
def _varlen_hopper_kernel(
    q_desc1, q_desc2, k_desc1, k_desc2, v_desc, cu_q_ptr, cu_k_ptr, out_ptr, lse_ptr,
    stride_qh, stride_kh, stride_vh, stride_ot, stride_oh, stride_lh, stride_lt,
    num_heads, num_blocks, num_seqs, softmax_scale,
    DV: gl.constexpr, D2: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
):
    """out [BLOCK_M, DV] and lse [BLOCK_M] of one query block of one (head, sequence);
    grid (num_heads x num_blocks,): the sequences' query blocks packed one after another
    (`_packed_block`), so a ragged batch, or one whose tokens are mostly padding, launches
    about as many programs as it has blocks. q_desc1 / k_desc1 copy the first D1 qk
    columns, q_desc2 / k_desc2 the D2 after them (D2 = 0: unused), v_desc the DV v
    columns; all over [T, N x D] row views."""
    BLOCK_M: gl.constexpr = q_desc1.block_type.shape[0]
    D1: gl.constexpr = q_desc1.block_type.shape[1]
    BLOCK_N: gl.constexpr = k_desc1.block_type.shape[0]
    STAGES: gl.constexpr = 2
    head, packed = _program_tile(num_heads, num_blocks, GROUP)
    seq, m_block = _packed_block(cu_q_ptr, num_seqs, packed, BLOCK_M)
    if seq >= num_seqs:
        # Past the last sequence's last block (the grid is a bound): nothing to do, so
        # leave before the shared memory, the barriers and the partitions are set up.
        return
    q_begin = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_begin
    k_begin = gl.load(cu_k_ptr + seq)
    k_len = gl.load(cu_k_ptr + seq + 1) - k_begin
    m_start = m_block * BLOCK_M
    if CAUSAL:
        q_shift = k_len - q_len  # query i sees keys <= i + q_shift
        # Keys every query of the block sees, and keys any of its queries sees.
        full_end = gl.maximum(gl.minimum(m_start + 1 + q_shift, k_len), 0)
        end = gl.maximum(gl.minimum(m_start + BLOCK_M + q_shift, k_len), 0)
    else:
        q_shift = 0
        full_end = k_len
        end = k_len
    full_end = gl.minimum(full_end, end) // BLOCK_N * BLOCK_N
    num_tiles = gl.cdiv(end, BLOCK_N)

    dtype: gl.constexpr = q_desc1.dtype
    q_smem1 = gl.allocate_shared_memory(dtype, [BLOCK_M, D1], q_desc1.layout)
    k_ring1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], k_desc1.layout)
    if D2:
        q_smem2 = gl.allocate_shared_memory(dtype, [BLOCK_M, D2], q_desc2.layout)
        k_ring2 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D2], k_desc2.layout)
    else:  # unused
        q_smem2 = q_smem1
        k_ring2 = k_ring1
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    fence_async_shared()

    qk_scale = softmax_scale * 1.4426950408889634
    # (Argument tuples written out in each entry: a tuple held in a variable would turn
    # the constexprs into tensors.)
    gl.warp_specialize([
        (_consume, (q_smem1, q_smem2, k_ring1, k_ring2, v_ring, q_ready, k_ready, v_ready,
                    empty, turn, num_tiles, full_end, k_len, q_shift, m_start, q_begin, q_len,
                    head, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lh, stride_lt,
                    qk_scale, 0, D2, CAUSAL)),
        (_consume, (q_smem1, q_smem2, k_ring1, k_ring2, v_ring, q_ready, k_ready, v_ready,
                    empty, turn, num_tiles, full_end, k_len, q_shift, m_start, q_begin, q_len,
                    head, out_ptr, lse_ptr, stride_ot, stride_oh, stride_lh, stride_lt,
                    qk_scale, 1, D2, CAUSAL)),
        (_produce, (q_desc1, q_desc2, k_desc1, k_desc2, v_desc, q_smem1, q_smem2, k_ring1,
                    k_ring2, v_ring, q_ready, k_ready, v_ready, empty, q_begin + m_start,
                    k_begin, head * stride_qh, head * stride_kh, head * stride_vh, num_tiles,
                    D2)),
    ], [4, 1], [CONSUMER_REGS, 24])


def _row_descriptor(t: torch.Tensor, block_rows: int, width: int) -> TensorDescriptor:
    """Copy boxes [block_rows, width] over t [T, N, D] viewed as [T, (N - 1) x stride_h
    + D] rows (head h starts at column h x stride_h), in the swizzled layout wgmma
    reads."""
    tokens, heads, dim = t.shape
    shape = [tokens, (heads - 1) * t.stride(1) + dim]
    return TensorDescriptor(t, shape, [t.stride(0), 1], [block_rows, width],
                            box_layout(block_rows, width, t.dtype))


def head_group(num_heads: int, max_seqlen_k: int, width: int, q: torch.Tensor) -> int:
    """Heads whose programs run together (see `_program_tile`): as many as keep one
    sequence's K and V rows (width = qk + v columns) within half the L2 cache, a power
    of two so that few values compile."""
    row_bytes = max(1, max_seqlen_k) * width * q.element_size()
    fit = max(1, l2_cache_bytes(q.device) // 2 // row_bytes)
    return min(next_pow2(num_heads), 1 << (fit.bit_length() - 1))


def varlen_attention_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    causal: bool, out: torch.Tensor, lse: torch.Tensor,
) -> None:
    """Run the kernel for a call `supported` accepted: q [Tq, N, Dqk], k [Tk, N, Dqk],
    v [Tk, N, Dv]; writes out [Tq, N, Dv] and lse [N, Tq] float32."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    d1, d2 = _qk_parts(qk_dim)
    n = block_n(qk_dim, v_dim)
    q1 = _row_descriptor(q, BLOCK_M, d1)
    k1 = _row_descriptor(k, n, d1)
    q2 = _row_descriptor(q, BLOCK_M, d2) if d2 else q1
    k2 = _row_descriptor(k, n, d2) if d2 else k1
    vd = _row_descriptor(v, n, v_dim)
    num_heads = q.shape[1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    num_blocks = packed_blocks(q.shape[0], num_seqs, max_seqlen_q, BLOCK_M)
    _varlen_hopper_kernel[(num_heads * num_blocks,)](
        q1, q2, k1, k2, vd, cu_seqlens_q, cu_seqlens_k, out, lse,
        q.stride(1), k.stride(1), v.stride(1), out.stride(0), out.stride(1),
        lse.stride(0), lse.stride(1), num_heads, num_blocks, num_seqs, float(softmax_scale),
        DV=v_dim, D2=d2, GROUP=head_group(num_heads, max_seqlen_k, qk_dim + v_dim, q),
        CAUSAL=bool(causal), num_warps=4,
    )
