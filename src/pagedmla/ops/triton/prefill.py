"""Variable-length prefill attention with log-sum-exp: the dispatch.

`prefill_attention`, the backend's op, runs the first entry of the prefill table
(`selection`) that supports the call: cuDNN for batches of equal-length sequences
(`prefill_cudnn`), else our kernels. `varlen_attention` is ours alone: the Gluon kernel
of `prefill_hopper` on Hopper GPUs where it supports the call, else the portable Triton
kernel (`prefill_triton`).
"""

from __future__ import annotations

import torch

from pagedmla.ops.triton import prefill_cudnn
from pagedmla.ops.triton._utils import check_device, last_dim_contiguous
from pagedmla.ops.triton.prefill_triton import PrefillConfig
from pagedmla.ops.triton.selection import cudnn_takes, prefill_kernel, triton_prefill_kernel


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    *,
    config: PrefillConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length MHA with log-sum-exp (as `reference.varlen_attention`).

    q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] (any strides but the last);
    cu_seqlens_q / cu_seqlens_k int32 [B + 1]; causal is bottom-right. max_seqlen_q
    (host int, >= every q_len) sizes the grid. Returns out [Tq, N, Dv] in q's dtype
    and lse [N, Tq] float32; a query that sees no key gets out 0 and lse -inf.
    `config` runs the portable Triton kernel with those launch parameters (tuning,
    tests); without it the prefill table's first kernel entry that supports the call
    runs (`selection`: `prefill_hopper` on Hopper GPUs, else the Triton kernel).
    """
    check_device(q, k, v)
    num_tokens, num_heads, _ = q.shape
    v_dim = v.shape[-1]
    num_seqs = cu_seqlens_q.shape[0] - 1
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    # No key at all (k and v empty): every query sees none. The copy engine cannot
    # describe an empty tensor, so no kernel runs.
    if num_tokens == 0 or num_seqs <= 0 or max_seqlen_q <= 0 or k.shape[0] == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    kernel = (triton_prefill_kernel(config) if config is not None else prefill_kernel(
        q, k, v, num_seqs, max_seqlen_q, max_seqlen_k, softmax_scale, causal, cudnn=False))
    kernel.launch(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, out, lse)
    return out, lse


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `varlen_attention` (q [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv]; returns out
    [Tq, N, Dv] and lse [N, Tq] float32), on the prefill table's first entry that takes
    the call: cuDNN when every sequence has the same lengths (`prefill_cudnn`; asked
    about the tensors as given), else our kernels. A call cuDNN refuses (a head dim or
    layout its build does not take) goes to our kernels, and so do later calls of its
    kind."""
    num_seqs = cu_seqlens_q.shape[0] - 1
    if cudnn_takes(q, k, v, num_seqs, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        try:
            return prefill_cudnn.dense_attention(q, k, v, num_seqs, softmax_scale, causal)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:
            prefill_cudnn.refuse(q, k, v)
    return varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal)
