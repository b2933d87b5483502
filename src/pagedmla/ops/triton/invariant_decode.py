"""Paged latent decode whose result for a query row depends on that row alone: the
Triton backend's `mla_decode` in batch-invariant mode (`ops/batch_invariant.py`).

The split-KV kernels (`decode.mla_decode`) cut requests into splits by a plan made for
the whole batch and fold them by log-sum-exp, so a row's reduction order follows its
neighbours. Here one program takes BLOCK_H heads of one query row and walks the row's
visible positions from 0 in tiles of BLOCK_N, with an online softmax in float32: the
order of every sum is fixed by the row's own length. The price is parallelism: a batch
of a few long requests runs on few multiprocessors (`docs/PERFORMANCE.md` has its cost
against the default mode). Rows are gathered through the block table one position at a
time (any page size); an fp8 cache is dequantized by its per-tensor scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.cache import FP8_DTYPE
from pagedmla.ops.triton._utils import (
    check_cache_rows,
    check_device,
    dot_precision,
    next_pow2,
)

BLOCK_H = 16  # heads per program (tl.dot's smallest M)
BLOCK_N = 32  # positions per tile


@triton.jit(do_not_specialize=["T", "stride_bt"],
            do_not_specialize_on_alignment=["block_table_ptr", "seq_lens_ptr",
                                            "token_req_ptr", "query_start_ptr"])
def _invariant_decode_kernel(
    q_ptr, data_ptr, scale_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    token_req_ptr, out_ptr, lse_ptr,
    T, stride_bt, softmax_scale,
    N: tl.constexpr, L: tl.constexpr, R: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    b = tl.load(token_req_ptr + t)
    first = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - first
    # Positions this row sees: its request's context up to and including itself.
    visible = tl.load(seq_lens_ptr + b) - q_len + (t - first) + 1
    cols_l = tl.arange(0, BLOCK_L)
    cols_r = tl.arange(0, BLOCK_R)
    head_ok = heads < N
    q_row = q_ptr + t * N * (L + R) + heads[:, None] * (L + R)
    q_l = tl.load(q_row + cols_l[None, :], mask=head_ok[:, None] & (cols_l[None, :] < L),
                  other=0.0)
    q_r = tl.load(q_row + L + cols_r[None, :], mask=head_ok[:, None] & (cols_r[None, :] < R),
                  other=0.0)
    dtype = q_l.dtype
    scale = tl.load(scale_ptr) if FP8 else 1.0
    qk_scale = softmax_scale * 1.4426950408889634  # base-2 exponentials
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(0, visible, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < visible
        page = tl.load(block_table_ptr + b * stride_bt + pos // PAGE, mask=ok, other=0)
        rows = data_ptr + (page.to(tl.int64) * PAGE + pos % PAGE) * (L + R)
        k_l = tl.load(rows[:, None] + cols_l[None, :], mask=ok[:, None] & (cols_l[None, :] < L),
                      other=0.0)
        k_r = tl.load(rows[:, None] + L + cols_r[None, :],
                      mask=ok[:, None] & (cols_r[None, :] < R), other=0.0)
        if FP8:
            k_l = (k_l.to(tl.float32) * scale).to(dtype)
            k_r = (k_r.to(tl.float32) * scale).to(dtype)
        scores = tl.dot(q_l, tl.trans(k_l), input_precision=PRECISION)
        scores += tl.dot(q_r, tl.trans(k_r), input_precision=PRECISION)
        scores = tl.where(ok[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), k_l, input_precision=PRECISION)
        m = m_new
    out = acc / denom[:, None]  # 0 / 0: a row that sees nothing (NaN until masked below)
    out = tl.where(visible > 0, out, 0.0)
    lse = tl.where(visible > 0, (m + tl.log2(denom)) / 1.4426950408889634, float("-inf"))
    tl.store(out_ptr + t * N * L + heads[:, None] * L + cols_l[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & (cols_l[None, :] < L))
    tl.store(lse_ptr + heads * T + t, lse, mask=head_ok)


def invariant_decode(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
    max_seq_len: int, kv_lora_rank: int, softmax_scale: float, *, plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `reference.mla_decode` (q [T, N, L + R], the cache data [num_blocks, page,
    L + R] in q's dtype or fp8 with its per-tensor `scale`) -> (out [T, N, L] in q's
    dtype, lse [N, T] float32), each row computed on its own. Neither synchronises nor
    allocates by device values (CUDA graphs capture it); `plans` is not used."""
    T, N, width = q.shape
    L = kv_lora_rank
    check_device(q, data, block_table, seq_lens, query_start_loc)
    check_cache_rows(data, L, width)
    out = q.new_empty(T, N, L)
    lse = torch.empty(N, T, dtype=torch.float32, device=q.device)
    if T == 0:
        return out, lse
    steps = torch.arange(T, device=q.device, dtype=query_start_loc.dtype)
    token_req = (torch.searchsorted(query_start_loc[1:], steps, right=True)).to(torch.int32)
    _invariant_decode_kernel[(T, triton.cdiv(N, BLOCK_H))](
        q.contiguous(), data, scale, block_table, seq_lens, query_start_loc, token_req, out,
        lse, T, block_table.stride(0), softmax_scale,
        # tl.dot takes K >= 16 on the GPU: narrower widths are padded (masked).
        N=N, L=L, R=width - L, PAGE=data.shape[1], BLOCK_L=max(16, next_pow2(L)),
        BLOCK_R=max(16, next_pow2(width - L)), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        FP8=data.dtype == FP8_DTYPE, PRECISION=dot_precision(q.dtype), num_warps=4,
    )
    return out, lse
