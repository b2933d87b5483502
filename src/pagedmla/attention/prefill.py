"""The MHA path: compute friendly, for requests with many new tokens.

New tokens attend to each other causally after up-projection. Cached context is
gathered chunk by chunk into a bounded workspace, up-projected, attended without a
mask, and folded in by log-sum-exp, so memory stays bounded however long the context.
"""

from __future__ import annotations

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import ChunkedContext, ContextChunk, PrefillMetadata
from pagedmla.ops import Backend
from pagedmla.ops.output_quant import QuantizedOutput


def up_project(
    kv_c: torch.Tensor, k_pe: torch.Tensor, kv_b_proj: torch.Tensor, num_heads: int, P: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_c [S, L], k_pe [S, R] -> k [S, N, P + R], v [S, N, V]."""
    kv = torch.matmul(kv_c, kv_b_proj.t()).view(kv_c.shape[0], num_heads, -1)
    k_nope, v = kv[..., :P], kv[..., P:]
    if k_pe.shape[-1] == 0:
        return k_nope, v
    k = torch.empty(*k_nope.shape[:2], P + k_pe.shape[-1], dtype=kv.dtype, device=kv.device)
    k[..., :P] = k_nope
    k[..., P:] = k_pe.unsqueeze(1)
    return k, v


def mha_prefill(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_b_proj: torch.Tensor,
    cache: LatentKVCache,
    meta: PrefillMetadata,
    softmax_scale: float,
    ops: Backend,
    out: torch.Tensor | QuantizedOutput,
) -> None:
    """q [Tp, N, P + R], kv_c [Tp, L], k_pe [Tp, R]; writes out [Tp, N, V] (or quantized
    for o_proj, [Tp, N * V]: by the merge's epilogue, or in place of the copy)."""
    N = q.shape[1]
    P = q.shape[2] - k_pe.shape[-1]
    k, v = up_project(kv_c, k_pe, kv_b_proj, N, P)
    new_out, new_lse = ops.varlen_attention(
        q, k, v, meta.query_start_loc, meta.query_start_loc, meta.max_query_len,
        meta.max_query_len, softmax_scale, True,
    )
    quantized = isinstance(out, QuantizedOutput)
    if meta.context is None:
        if quantized:
            ops.quantize_output(new_out.view(new_out.shape[0], -1), out)
        else:
            out.copy_(new_out)
        return
    ctx_out, ctx_lse = _context_attention(q, kv_b_proj, cache, meta, softmax_scale, ops)
    if quantized:
        ops.merge_attn_states_quant(ctx_out, ctx_lse, new_out, new_lse, out)
    else:
        ops.merge_attn_states(ctx_out, ctx_lse, new_out, new_lse, out, None)


def _context_attention(
    q: torch.Tensor,
    kv_b_proj: torch.Tensor,
    cache: LatentKVCache,
    meta: PrefillMetadata,
    softmax_scale: float,
    ops: Backend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of the prefill queries over their cached context, chunk by chunk.

    Returns out [Tp, N, V] (q's dtype for a single chunk, else float32) and lse
    [N, Tp]; prefills without context get (0, -inf).
    """
    context = meta.context
    assert context is not None
    L = cache.kv_lora_rank
    N = q.shape[1]
    P = q.shape[2] - cache.rope_dim
    workspace = context.workspace.get(cache.width, q.dtype)
    out = lse = None
    for chunk in context.chunks:
        rows = workspace[: chunk.num_context_tokens]
        if context.dcp is None:
            ops.gather_cache(
                cache.data, cache.scale, meta.block_table[chunk.request_slice], chunk.starts,
                chunk.cu_seq_lens, chunk.token_to_seq, rows,
            )
        else:
            # The rows are spread over the decode context parallel group: collect them.
            context.dcp.gather(chunk, cache, meta.block_table, ops, rows)
        k, v = up_project(rows[:, :L], rows[:, L:], kv_b_proj, N, P)
        chunk_out, chunk_lse = ops.varlen_attention(
            q[chunk.token_slice], k, v, chunk.query_start_loc, chunk.cu_seq_lens,
            chunk.max_query_len, chunk.max_seq_len, softmax_scale, False,
        )
        if out is None:
            if len(context.chunks) == 1 and not context.empty_token_slices:
                return chunk_out, chunk_lse
            out, lse = _empty_partial(context, chunk_out, q.shape[0])
        _accumulate(chunk, chunk_out, chunk_lse, out, lse, ops)
    assert out is not None and lse is not None
    return out, lse


def _empty_partial(
    context: ChunkedContext, like: torch.Tensor, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A running partial over all prefill tokens; rows of context-free prefills are empty.

    Every other row is written by the first chunk that covers its request. It is held
    in float32: merged in the chunks' 16-bit dtype, a context of C chunks would lose
    about sqrt(C) roundings (5% of a row at 1000 chunks); in float32 the error does not
    grow with the chunk count.
    """
    out = torch.empty(num_tokens, *like.shape[1:], dtype=torch.float32, device=like.device)
    lse = torch.empty(like.shape[1], num_tokens, dtype=torch.float32, device=like.device)
    for rows in context.empty_token_slices:
        out[rows] = 0
        lse[:, rows] = float("-inf")
    return out, lse


def _accumulate(
    chunk: ContextChunk,
    chunk_out: torch.Tensor,
    chunk_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    ops: Backend,
) -> None:
    """Fold one chunk into the running partial.

    Only the chunk's first request can continue a request begun in an earlier chunk:
    its rows are merged; every other row is seen for the first time and copied.
    """
    start, stop = chunk.token_slice.start, chunk.token_slice.stop
    first_new = start
    if chunk.is_continuation:
        first_new = chunk.continuation_token_end
        merged = first_new - start
        ops.merge_attn_states(
            out[start:first_new], lse[:, start:first_new], chunk_out[:merged],
            chunk_lse[:, :merged], out[start:first_new], lse[:, start:first_new],
        )
    if first_new < stop:
        out[first_new:stop] = chunk_out[first_new - start :]
        lse[:, first_new:stop] = chunk_lse[:, first_new - start :]
