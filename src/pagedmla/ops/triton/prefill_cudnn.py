"""cuDNN's fused attention for prefill batches of equal-length sequences.

Why: PyTorch's cuDNN attention runs dense prefill (qk 192 / v 128) faster than our
kernels on Hopper (docs/PERFORMANCE.md) and returns the log-sum-exp that the
chunked-context merge needs. Its ragged entry point (`_cudnn_attention_forward` with
cumulative lengths) is correct but rebuilds its plan on every call, and gives wrong
results with int64 lengths; so only batches whose sequences all share one query length
and one key length take cuDNN, through the dense op on views of the packed tensors.
Which batches those are follows from host ints alone (B sequences of at most max_len
tokens filling T tokens means every one has max_len), so choosing never reads the
device. cuDNN's causal mask is top-left; it equals ours (bottom-right) only for square
attention, so causal batches need q_len == k_len.
"""

from __future__ import annotations

import torch

_CUDNN_DTYPES = (torch.float16, torch.bfloat16)
# Input kinds cuDNN refused once (see `_kind`): not asked again.
_REFUSED: set[tuple] = set()


def _kind(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What cuDNN's support depends on: dtype, head dims and layouts. For [T, N, D]
    tensors the strides do not depend on T, so one refusal covers every such call."""
    return (q.dtype, q.shape[-1], v.shape[-1], q.stride(), k.stride(), v.stride())


def supports(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool,
) -> bool:
    """Whether every sequence has max_seqlen_q queries and max_seqlen_k keys (and, for
    causal, as many of each), and the inputs are ones cuDNN takes (asked on a CUDA device
    with PyTorch's cuDNN: `Platform.cudnn`). Anything else (including invalid input,
    which the Triton path reports) goes to our kernels."""
    return (
        q.dtype in _CUDNN_DTYPES
        and num_seqs >= 1
        and max_seqlen_q >= 1
        and max_seqlen_k >= 1
        and num_seqs * max_seqlen_q == q.shape[0]
        and num_seqs * max_seqlen_k == k.shape[0]
        and (not causal or max_seqlen_q == max_seqlen_k)
        and softmax_scale > 0
        and _kind(q, k, v) not in _REFUSED
    )


def refuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Remember that cuDNN refused inputs of this kind (`supports` then declines them)."""
    _REFUSED.add(_kind(q, k, v))


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense cuDNN attention on [B, N, S, D] views of the packed [B * S, N, D] inputs."""
    def heads_first(x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(0, (num_seqs, -1)).transpose(1, 2)

    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        heads_first(q), heads_first(k), heads_first(v), None, True, 0.0, causal, False,
        scale=softmax_scale,
    )
    out, lse = result[0], result[1]
    num_heads = q.shape[1]
    out = out.transpose(1, 2).reshape(q.shape[0], num_heads, v.shape[-1])
    lse = lse.reshape(num_seqs, num_heads, -1).transpose(0, 1).reshape(num_heads, -1)
    return out, lse
