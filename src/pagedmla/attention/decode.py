"""The absorbed MQA path: data-movement friendly, for requests with few new tokens.

W_UK is folded into the query so that attention runs over the latent cache directly
(one shared key/value row of L + R per token for all N heads); W_UV is applied to
the [T, N, L] result afterwards.
"""

from __future__ import annotations

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import DecodeMetadata
from pagedmla.ops import Backend
from pagedmla.ops.output_quant import QuantizedOutput


def absorb_query(q: torch.Tensor, W_UK: torch.Tensor) -> torch.Tensor:
    """q [T, N, P + R], W_UK [N, P, L] -> the absorbed query [T, N, L + R] in q's dtype:
    q_nope @ W_UK per head, then q's rope part."""
    P, L = W_UK.shape[1], W_UK.shape[2]
    q_nope, q_pe = q[..., :P], q[..., P:]
    q_mqa = torch.empty(q.shape[0], q.shape[1], L + q_pe.shape[-1], dtype=q.dtype, device=q.device)
    # [N, T, P] @ [N, P, L], written straight into the token-major query buffer.
    torch.bmm(q_nope.transpose(0, 1), W_UK, out=q_mqa[..., :L].transpose(0, 1))
    q_mqa[..., L:] = q_pe
    return q_mqa


def absorbed_decode(
    q: torch.Tensor,
    W_UK: torch.Tensor,
    W_UV: torch.Tensor,
    cache: LatentKVCache,
    meta: DecodeMetadata,
    softmax_scale: float,
    ops: Backend,
    out: torch.Tensor | QuantizedOutput,
) -> None:
    """q [Td, N, P + R], W_UK [N, P, L], W_UV [N, L, V] -> out [Td, N, V] (or quantized,
    [Td, N * V])."""
    L = W_UK.shape[2]
    q_mqa = absorb_query(q, W_UK)
    if meta.dcp is not None:
        # Decode context parallel: attend for the whole group's heads over this rank's rows.
        q_mqa = meta.dcp.gather_queries(q_mqa)
    latent_out, lse = ops.mla_decode(
        q_mqa,
        cache.data,
        cache.scale,
        meta.block_table,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        meta.max_seq_len,
        L,
        softmax_scale,
        plans=meta.plans,
    )
    if meta.dcp is not None:
        latent_out = meta.dcp.combine(latent_out, lse, ops)
    up_project_output(latent_out, W_UV, out, ops)


def up_project_output(latent_out: torch.Tensor, W_UV: torch.Tensor,
                      out: torch.Tensor | QuantizedOutput, ops: Backend) -> None:
    """latent_out [T, N, L] @ W_UV [N, L, V] per head -> out [T, N, V], or quantized for
    o_proj by the backend's up-projection (its epilogue)."""
    if isinstance(out, QuantizedOutput):
        ops.v_up_proj_quant(latent_out, W_UV, out)
    else:
        torch.bmm(latent_out.transpose(0, 1), W_UV, out=out.transpose(0, 1))
