"""Sparse MLA attention for one layer (DeepSeek Sparse Attention).

Each query token attends only to the cache positions its indexer selected (at most
top-k of them), by absorbed MQA over the latent cache: the query is absorbed as on the
decode path (`absorb_query`), the op attends over the selected latent rows
(`ops/reference_sparse.py` states the index contract) and W_UV turns the latent result
into the heads' values. Decode and prefill rows take the same path, since every query
has its own list of positions, and every key is read from the cache: the step's new
latents must be written first.

Where every query of a batch sees at most top-k keys, the indexer selects all of them
and sparse attention is dense MLA (`fits_in_topk`): the dense paths may run instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedmla.attention.layer import _expect_tensor
from pagedmla.cache import MODEL_DTYPES, LatentKVCache
from pagedmla.ops.reference_sparse import sparse_mla_attention
from pagedmla.validation import positive_finite


def fits_in_topk(seq_lens: Sequence[int], topk: int) -> bool:
    """Whether every query of a batch sees at most `topk` keys, so that its selection is
    its whole causal context and the dense paths give the sparse result. A request's
    last token sees its seq_len positions, the most of its queries. Host ints, O(B)."""
    return all(seq_len <= topk for seq_len in seq_lens)


def sparse_mla(
    q_mqa: torch.Tensor,
    indices: torch.Tensor,
    cache: LatentKVCache,
    W_UV: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's sparse MLA: q_mqa [T, N, L + R] absorbed queries (`absorb_query`),
    indices [T, topk] int32 positions per query (-1 unused), W_UV [N, L, V] -> [T, N * V]
    in q's dtype: `out` when given (contiguous, q's dtype and device), else a new one.

    block_table [B, max_blocks] int32, seq_lens [B] int32 and query_start_loc [B + 1]
    int32 describe the batch's requests (decodes and prefills alike) on q's device.
    The shapes, dtypes and devices are checked here; the indices' values are not (that
    would read them back): `pagedmla.ops.reference_sparse.check_sparse_indices` does.
    """
    _validate(q_mqa, indices, cache, W_UV, block_table, seq_lens, query_start_loc)
    softmax_scale = positive_finite("softmax_scale", softmax_scale)
    T, N = q_mqa.shape[:2]
    V = W_UV.shape[2]
    if out is None:
        out = torch.empty(T, N * V, dtype=q_mqa.dtype, device=q_mqa.device)
    else:
        _expect_tensor("out", out, (T, N * V))
        if out.dtype != q_mqa.dtype or out.device != q_mqa.device or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {q_mqa.dtype} tensor on {q_mqa.device}, got "
                f"{'a contiguous' if out.is_contiguous() else 'a strided'} {out.dtype} "
                f"tensor on {out.device}"
            )
    latent_out, _ = sparse_mla_attention(
        q_mqa, cache.data, cache.scale, block_table, seq_lens, query_start_loc, indices,
        cache.kv_lora_rank, softmax_scale,
    )
    torch.bmm(latent_out.transpose(0, 1), W_UV, out=out.view(T, N, V).transpose(0, 1))
    return out


def _validate(
    q_mqa: torch.Tensor,
    indices: torch.Tensor,
    cache: LatentKVCache,
    W_UV: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """TypeError/ValueError naming the first argument whose type, shape, dtype or device
    does not fit the others. O(1): reads no tensor's values."""
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache must be a LatentKVCache, got {type(cache).__name__}")
    if not isinstance(q_mqa, torch.Tensor) or q_mqa.dim() != 3:
        raise ValueError(f"q_mqa must be a [T, N, L + R] tensor, got {_describe(q_mqa)}")
    T, N = q_mqa.shape[:2]
    _expect_tensor("q_mqa", q_mqa, (T, N, cache.width))
    if q_mqa.dtype not in MODEL_DTYPES:
        raise TypeError(f"q_mqa must have a dtype in {MODEL_DTYPES}, got {q_mqa.dtype}")
    if cache.dtype != q_mqa.dtype or cache.device != q_mqa.device:
        raise ValueError(
            f"the cache serves a {cache.dtype} model on {cache.device}; q_mqa is "
            f"{q_mqa.dtype} on {q_mqa.device}"
        )
    if not isinstance(W_UV, torch.Tensor) or W_UV.dim() != 3:
        raise ValueError(f"W_UV must be a [N, L, V] tensor, got {_describe(W_UV)}")
    _expect_tensor("W_UV", W_UV, (N, cache.kv_lora_rank, W_UV.shape[2]))
    if W_UV.dtype != q_mqa.dtype or W_UV.device != q_mqa.device:
        raise ValueError(
            f"W_UV is {W_UV.dtype} on {W_UV.device}; q_mqa is {q_mqa.dtype} on {q_mqa.device}"
        )
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        raise ValueError(f"indices must be a [T, topk] tensor, got {_describe(indices)}")
    _expect_tensor("indices", indices, (T, indices.shape[1]))
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be a [B, max_blocks] tensor, got {_describe(block_table)}"
        )
    B = block_table.shape[0]
    _expect_tensor("seq_lens", seq_lens, (B,))
    _expect_tensor("query_start_loc", query_start_loc, (B + 1,))
    for name, tensor in (("indices", indices), ("block_table", block_table),
                         ("seq_lens", seq_lens), ("query_start_loc", query_start_loc)):
        if tensor.dtype != torch.int32 or tensor.device != q_mqa.device:
            raise ValueError(
                f"{name} must be int32 on {q_mqa.device}, got {tensor.dtype} on {tensor.device}"
            )


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return type(value).__name__
