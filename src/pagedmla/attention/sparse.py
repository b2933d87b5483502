"""Sparse MLA attention for one layer (DeepSeek Sparse Attention).

Each query token attends only to the cache positions its indexer selected (at most
top-k of them), by absorbed MQA over the latent cache: the query is absorbed as on the
decode path (`absorb_query`), the op attends over the selected latent rows
(`ops/reference_sparse.py` states the index contract) and W_UV turns the latent result
into the heads' values. Decode and prefill rows take the same path, since every query
has its own list of positions, and every key is read from the cache: the step's new
latents must be written first.

Where every query of a batch sees at most top-k keys, the indexer selects all of them
and sparse attention is dense MLA (`SparseMetadata.dense`): the dense paths run instead.
"""

from __future__ import annotations

import torch

from pagedmla.attention.checks import expect_tensor, output_buffer
from pagedmla.attention.decode import up_project_output
from pagedmla.cache import MODEL_DTYPES, LatentKVCache
from pagedmla.metadata import SparseMetadata
from pagedmla.ops import Backend
from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.validation import positive_finite


def sparse_mla(
    q_mqa: torch.Tensor,
    indices: torch.Tensor,
    cache: LatentKVCache,
    W_UV: torch.Tensor,
    sparse: SparseMetadata,
    softmax_scale: float,
    ops: Backend,
    out: torch.Tensor | QuantizedOutput | None = None,
) -> torch.Tensor | QuantizedOutput:
    """One layer's sparse MLA: q_mqa [T, N, L + R] absorbed queries (`absorb_query`),
    indices [T, topk] int32 positions per query (-1 unused), W_UV [N, L, V] -> [T, N * V]
    in q's dtype: `out` when given (contiguous, q's dtype and device; or quantized for
    o_proj, `ops/output_quant.py`), else a new one.

    `sparse` describes the batch's requests (decodes and prefills alike) on q's device;
    `ops` is the backend whose `sparse_attention` runs. The shapes, dtypes and devices
    are checked here; the indices' values are not (that would read them back):
    `pagedmla.ops.reference_sparse.check_sparse_indices` does.
    """
    _validate(q_mqa, indices, cache, W_UV, sparse)
    softmax_scale = positive_finite("softmax_scale", softmax_scale)
    T, N = q_mqa.shape[:2]
    V = W_UV.shape[2]
    out = output_buffer(out, (T, N * V), q_mqa)
    latent_out, _ = ops.sparse_attention(
        q_mqa, cache.data, cache.scale, sparse.block_table, sparse.seq_lens,
        sparse.query_start_loc, indices, cache.kv_lora_rank, softmax_scale,
    )
    up_project_output(latent_out, W_UV,
                      out if isinstance(out, QuantizedOutput) else out.view(T, N, V), ops)
    return out


def _validate(
    q_mqa: torch.Tensor,
    indices: torch.Tensor,
    cache: LatentKVCache,
    W_UV: torch.Tensor,
    sparse: SparseMetadata,
) -> None:
    """TypeError/ValueError naming the first argument whose type, shape, dtype or device
    does not fit the others. O(1): reads no tensor's values."""
    if not isinstance(cache, LatentKVCache):
        raise TypeError(f"cache must be a LatentKVCache, got {type(cache).__name__}")
    if not isinstance(q_mqa, torch.Tensor) or q_mqa.dim() != 3:
        raise ValueError(f"q_mqa must be a [T, N, L + R] tensor, got {_describe(q_mqa)}")
    T, N = q_mqa.shape[:2]
    expect_tensor("q_mqa", q_mqa, (T, N, cache.width))
    if q_mqa.dtype not in MODEL_DTYPES:
        raise TypeError(f"q_mqa must have a dtype in {MODEL_DTYPES}, got {q_mqa.dtype}")
    if cache.dtype != q_mqa.dtype or cache.device != q_mqa.device:
        raise ValueError(
            f"the cache serves a {cache.dtype} model on {cache.device}; q_mqa is "
            f"{q_mqa.dtype} on {q_mqa.device}"
        )
    if not isinstance(W_UV, torch.Tensor) or W_UV.dim() != 3:
        raise ValueError(f"W_UV must be a [N, L, V] tensor, got {_describe(W_UV)}")
    expect_tensor("W_UV", W_UV, (N, cache.kv_lora_rank, W_UV.shape[2]))
    if W_UV.dtype != q_mqa.dtype or W_UV.device != q_mqa.device:
        raise ValueError(
            f"W_UV is {W_UV.dtype} on {W_UV.device}; q_mqa is {q_mqa.dtype} on {q_mqa.device}"
        )
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        raise ValueError(f"indices must be a [T, topk] tensor, got {_describe(indices)}")
    expect_tensor("indices", indices, (T, indices.shape[1]))
    if not isinstance(sparse, SparseMetadata):
        raise TypeError(f"sparse must be SparseMetadata, got {type(sparse).__name__}")
    block_table, seq_lens, query_start_loc = (
        sparse.block_table, sparse.seq_lens, sparse.query_start_loc)
    if not isinstance(block_table, torch.Tensor) or block_table.dim() != 2:
        raise ValueError(
            f"block_table must be a [B, max_blocks] tensor, got {_describe(block_table)}"
        )
    B = block_table.shape[0]
    expect_tensor("seq_lens", seq_lens, (B,))
    expect_tensor("query_start_loc", query_start_loc, (B + 1,))
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
