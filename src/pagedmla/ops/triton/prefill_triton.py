"""Variable-length attention with log-sum-exp, FlashAttention-2 style, in Triton.

Grid (query blocks, heads): a program owns BLOCK_M queries of one head of one sequence
and streams that sequence's keys and values in BLOCK_N tiles with an online softmax
(base 2). The query blocks are the sequences' blocks packed one after another
(`_packed_block`): a ragged batch launches about as many programs as it has blocks,
not its longest sequence's blocks for every sequence, and a CUDA graph captured for T
tokens covers any cut of them into at most B sequences. The qk head dim need not be a
power of two: it is split into a power-of-two part and the rest (192 = 128 + 64), each
a tl.dot, summed. The v head dim may differ from the qk one (192 / 128).

Causal is bottom-right (query i of q_len sees keys < k_len - q_len + i + 1): key
tiles wholly visible to every query of the block run without masks, the few on the
diagonal with masks, and tiles wholly above it are never visited. Query blocks are
launched heaviest first (the last block of a causal sequence has the most keys). The
grid comes from host ints (T, B, max_seqlen_q): no device value is read on the host.

It runs on any GPU Triton supports and under the interpreter; on Hopper GPUs the Gluon
kernel of `prefill_hopper` takes the calls it supports (`selection`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedmla.ops.triton._utils import cdiv, dot_precision, next_pow2, split_pow2


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# Keyed by the padded widths of one q row plus one v row (16-bit inputs); float32 uses
# "fp32". Tuned with `python -m benchmarks.bench_kernels --sweep-configs prefill` (8k
# causal tokens): 128 queries x 128 keys with 8 warps (two warpgroups of wgmma) where
# its shared memory fits (q + stages x (k + v) tiles under ~227 KB): 3 stages at
# 128/128, 2 at 192/128; 256/256 fits only 64 keys x 2 stages.
PREFILL_CONFIGS: dict[str, PrefillConfig] = {
    "w<=256": PrefillConfig(128, 128, 8, 3),  # NoPE 128 / 128
    "w<=320": PrefillConfig(128, 128, 8, 2),  # DeepSeek 192 / 128
    "w>320": PrefillConfig(128, 64, 8, 2),  # 256 / 256
    "fp32": PrefillConfig(32, 32, 4, 1),  # exact IEEE dots on CUDA cores (tests)
}


def pick_config(qk_dim: int, v_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The config for q rows of qk_dim and v rows of v_dim columns of `dtype`."""
    if dtype == torch.float32:
        return PREFILL_CONFIGS["fp32"]
    d1, d2 = split_pow2(qk_dim)
    width = max(d1, 16) + (max(16, next_pow2(d2)) if d2 else 0) + max(16, next_pow2(v_dim))
    if width <= 256:
        return PREFILL_CONFIGS["w<=256"]
    if width <= 320:
        return PREFILL_CONFIGS["w<=320"]
    return PREFILL_CONFIGS["w>320"]


# Sequences per step of `_packed_block`'s lookup (one vector of their lengths).
SEQ_CHUNK = tl.constexpr(128)


def packed_blocks(num_tokens: int, num_seqs: int, max_seqlen_q: int, block_m: int) -> int:
    """Query blocks of block_m rows that num_seqs sequences of at most max_seqlen_q of
    num_tokens queries can have, at most: each sequence adds at most one partial block
    to cdiv(num_tokens, block_m), and none has more than cdiv(max_seqlen_q, block_m)."""
    return max(0, min(cdiv(num_tokens, block_m) + num_seqs - 1,
                      num_seqs * cdiv(max_seqlen_q, block_m)))


@triton.jit
def _query_blocks(cu_q_ptr, s, num_seqs, BLOCK_M: tl.constexpr):
    """Query blocks of BLOCK_M rows in sequences s (0 past the last one), and which of
    s are sequences."""
    ok = s < num_seqs
    lo = tl.load(cu_q_ptr + s, mask=ok, other=0)
    hi = tl.load(cu_q_ptr + s + 1, mask=ok, other=0)
    return tl.cdiv(hi - lo, BLOCK_M), ok


@triton.jit
def _packed_block(cu_q_ptr, num_seqs, i, BLOCK_M: tl.constexpr):
    """(sequence, query block) of the program launched i-th: the sequences' blocks of
    BLOCK_M queries counted one after another, from their lengths in cu_q_ptr (read in
    chunks of SEQ_CHUNK sequences), taken from the last: the heaviest causal blocks
    start first, and programs past the first block (the grid is a bound) come last and
    get (num_seqs, 0)."""
    offs = tl.arange(0, SEQ_CHUNK)
    total = tl.zeros([], tl.int32)
    for c in range(0, num_seqs, SEQ_CHUNK):
        total += tl.sum(_query_blocks(cu_q_ptr, c + offs, num_seqs, BLOCK_M)[0], 0)
    w = total - 1 - i  # the packed block, counted from the first
    seq = tl.zeros([], tl.int32)
    start = tl.zeros([], tl.int32)
    base = tl.zeros([], tl.int32)
    for c in range(0, num_seqs, SEQ_CHUNK):
        blocks, ok = _query_blocks(cu_q_ptr, c + offs, num_seqs, BLOCK_M)
        ends = base + tl.cumsum(blocks, 0)  # blocks through each
        done = ok & (ends <= w)  # sequences wholly before block w
        seq += tl.sum(done.to(tl.int32), 0)
        start = tl.maximum(start, tl.max(tl.where(done, ends, 0), 0))
        base = tl.max(tl.where(ok, ends, 0), 0)
    return tl.where(w < 0, num_seqs, seq), tl.maximum(w - start, 0)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q1, q2, k_base, v_base, start, k_len, rows, q_shift,
    stride_kt, stride_vt, qk_scale,
    QK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """Fold keys [start, start + BLOCK_N) into the running (acc, m, l).

    MASKED: the tile crosses k_len or the causal diagonal, so positions are checked
    (and loads masked); otherwise every key of the tile is visible to every query.
    """
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < k_len
    k_rows = keys.to(tl.int64) * stride_kt
    v_rows = keys.to(tl.int64) * stride_vt
    cols1 = tl.arange(0, D1)
    cols_v = tl.arange(0, BLOCK_DV)
    k1_ptrs = k_base + k_rows[:, None] + cols1[None, :]
    if MASKED:
        k1 = tl.load(k1_ptrs, mask=key_ok[:, None] & (cols1[None, :] < QK), other=0.0)
    elif D1 > QK:
        k1 = tl.load(k1_ptrs, mask=cols1[None, :] < QK, other=0.0)
    else:  # the common case: whole tile in range, unmasked (vectorized) loads
        k1 = tl.load(k1_ptrs)
    scores = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
    if D2 > 0:
        cols2 = tl.arange(0, BLOCK_D2)
        mask2 = cols2[None, :] < D2
        if MASKED:
            mask2 = mask2 & key_ok[:, None]
        k2 = tl.load(k_base + k_rows[:, None] + D1 + cols2[None, :], mask=mask2, other=0.0)
        scores += tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
    scores = scores * qk_scale
    if MASKED:
        visible = key_ok[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None] + q_shift)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Rows that have seen no key keep m = -inf: shift by 0 so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = m_new
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_ptrs = v_base + v_rows[:, None] + cols_v[None, :]
    if MASKED:
        v = tl.load(v_ptrs, mask=key_ok[:, None] & (cols_v[None, :] < DV), other=0.0)
    elif BLOCK_DV > DV:
        v = tl.load(v_ptrs, mask=cols_v[None, :] < DV, other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_lh", "num_seqs"],
    do_not_specialize_on_alignment=["cu_q_ptr", "cu_k_ptr"])
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, cu_q_ptr, cu_k_ptr, out_ptr, lse_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_lh, stride_lt,
    num_seqs, softmax_scale,
    QK: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BLOCK_D2: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
):
    """out [BLOCK_M, DV] and lse [BLOCK_M] for one query block of one (head, sequence);
    grid (packed query blocks, heads) (`_packed_block`)."""
    seq, m_block = _packed_block(cu_q_ptr, num_seqs, tl.program_id(0), BLOCK_M)
    head = tl.program_id(1).to(tl.int64)
    past = seq >= num_seqs  # past the last block (the grid is a bound): no work
    seq = tl.minimum(seq, num_seqs - 1)
    q_begin = tl.load(cu_q_ptr + seq)
    q_len = tl.where(past, 0, tl.load(cu_q_ptr + seq + 1) - q_begin)
    k_begin = tl.load(cu_k_ptr + seq)
    k_len = tl.load(cu_k_ptr + seq + 1) - k_begin
    m_start = m_block * BLOCK_M
    rows = m_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len

    if CAUSAL:
        q_shift = k_len - q_len  # query i sees keys <= i + q_shift
        # Keys every query of the block sees, and keys any of its queries sees.
        full_end = tl.maximum(tl.minimum(m_start + 1 + q_shift, k_len), 0)
        end = tl.maximum(tl.minimum(m_start + BLOCK_M + q_shift, k_len), 0)
    else:
        q_shift = 0
        full_end = k_len
        end = k_len
    end = tl.where(m_start < q_len, end, 0)  # blocks past this sequence: no work
    full_end = tl.minimum(full_end, end) // BLOCK_N * BLOCK_N

    tok = (q_begin + rows).to(tl.int64)
    q_rows = q_ptr + tok * stride_qt + head * stride_qh
    cols1 = tl.arange(0, D1)
    q1 = tl.load(q_rows[:, None] + cols1[None, :],
                 mask=row_ok[:, None] & (cols1[None, :] < QK), other=0.0)
    if D2 > 0:
        cols2 = tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_rows[:, None] + D1 + cols2[None, :],
                     mask=row_ok[:, None] & (cols2[None, :] < D2), other=0.0)
    else:
        q2 = q1  # unused
    k_base = k_ptr + k_begin.to(tl.int64) * stride_kt + head * stride_kh
    v_base = v_ptr + k_begin.to(tl.int64) * stride_vt + head * stride_vh
    qk_scale = softmax_scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q1, q2, k_base, v_base, start, k_len, rows, q_shift,
            stride_kt, stride_vt, qk_scale, QK, D1, D2, BLOCK_D2, DV, BLOCK_DV, BLOCK_N,
            False, CAUSAL, PRECISION,
        )
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q1, q2, k_base, v_base, start, k_len, rows, q_shift,
            stride_kt, stride_vt, qk_scale, QK, D1, D2, BLOCK_D2, DV, BLOCK_DV, BLOCK_N,
            True, CAUSAL, PRECISION,
        )

    # No key: l = 0. A NaN l (a NaN input) is not "no key": it reaches out and lse.
    has_key = l_i != 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]
    log_l = tl.math.log2(tl.where(has_key, l_i, 1.0))
    lse = tl.where(has_key, (m_i + log_l) * 0.6931471805599453, float("-inf"))  # natural log
    cols_v = tl.arange(0, BLOCK_DV)
    tl.store(out_ptr + tok[:, None] * stride_ot + head * stride_oh + cols_v[None, :],
             out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols_v[None, :] < DV))
    tl.store(lse_ptr + head * stride_lh + tok * stride_lt, lse, mask=row_ok)


def varlen_attention_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    causal: bool, out: torch.Tensor, lse: torch.Tensor, config: PrefillConfig | None = None,
) -> None:
    """Run the kernel with `config` (default: `pick_config`'s) on q [Tq, N, Dqk], k [Tk, N,
    Dqk], v [Tk, N, Dv] (unit last stride); writes out [Tq, N, Dv] and lse [N, Tq]
    float32."""
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = v.shape[-1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    cfg = config or pick_config(qk_dim, v_dim, q.dtype)
    d1, d2 = split_pow2(qk_dim)
    if d1 < 16:  # tl.dot needs K >= 16: pad a tiny head dim with masked columns
        d1, d2 = 16, 0
    num_blocks = packed_blocks(num_tokens, num_seqs, max_seqlen_q, cfg.block_m)
    _varlen_attention_kernel[(num_blocks, num_heads)](
        q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_seqs, float(softmax_scale),
        QK=qk_dim, D1=d1, D2=d2, BLOCK_D2=max(16, next_pow2(d2)) if d2 else 16, DV=v_dim,
        BLOCK_DV=max(16, next_pow2(v_dim)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        CAUSAL=bool(causal), PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
