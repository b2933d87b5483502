"""Batch-invariant backends: a token's results do not depend on what shares its step.

A kernel's tiling, reduction order and even its vector/scalar split (a CPU elementwise
op computes a tensor's tail with scalar code, whose exp or sigmoid can differ from the
vector code's by an ulp) follow the shapes it is given, so the same token can come out
differently in a step of 5 tokens and in one of 500, enough to flip a later sample. A
batch-invariant engine (`LLM(batch_invariant=True)`) therefore runs every forward over
micro-batches of exactly ROW_TILE tokens, each token a request of one query row over its
sequence's cache (`engine/model_runner.py`), the last micro-batch padded: every op sees
one shape, and a row's result is a function of that row alone. What remains are the ops
whose work per row follows other rows, which `batch_invariant(backend)` replaces:

- `mla_decode`: the split-KV kernels cut requests by a plan made for the whole batch; here
  the reference attends request by request over the request's own positions, and the
  Triton backend runs `ops/triton/invariant_decode.py`, which walks each row's positions
  in order.
- `fused_experts` of the reference backend gathers each expert's tokens, so its matmuls'
  shapes follow the routing of the others: it runs token by token, as do block-fp8
  experts on GPUs without fp8 dots, where the Triton op falls back to the reference.
  (The Triton kernels' tiles treat rows independently and their configuration follows
  the token count, fixed.)

A prompt then attends the same way however it is chunked: its tokens read their keys
from the cache, in the same order, whatever step they run in.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedmla.ops import Backend, reference

ROW_TILE = 64
"""Tokens per forward of a batch-invariant engine."""


def reference_decode(
    q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
    max_seq_len: int, kv_lora_rank: int, softmax_scale: float, *, plans: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.mla_decode`, one request at a time over its own seq_len positions (not
    padded to the batch's longest), so that the products' shapes follow the request
    alone. Reads the lengths on the host."""
    T, N, _ = q.shape
    out = q.new_empty(T, N, kv_lora_rank)
    lse = torch.empty(N, T, dtype=torch.float32, device=q.device)
    block_size = data.shape[1]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        Q = rows.stop - rows.start
        if Q == 0:
            continue
        position = torch.arange(seq_len, device=q.device)
        slots = block_table[b].long()[position // block_size] * block_size
        kv = reference._read_rows(data, slots + position % block_size, scale)  # [S, L + R]
        query_pos = seq_len - Q + torch.arange(Q, device=q.device)
        allowed = (position.view(1, -1) <= query_pos.view(-1, 1)).repeat_interleave(N, 0)
        o, s = reference._attend(q[rows].float().reshape(Q * N, -1), kv,
                                 kv[:, :kv_lora_rank], allowed, softmax_scale)
        out[rows] = o.view(Q, N, -1).to(q.dtype)
        lse[:, rows] = s.view(Q, N).transpose(0, 1)
    return out, lse


def reference_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor, **fp8: object) -> torch.Tensor:
    """`reference.fused_experts` token by token: each token's matmuls have one shape."""
    return torch.cat([reference.fused_experts(x[t : t + 1], w13, w2, weights[t : t + 1],
                                              ids[t : t + 1], **fp8)
                      for t in range(x.shape[0])]) if x.shape[0] else x.clone()


def batch_invariant(backend: Backend) -> Backend:
    """`backend` with the ops whose work per row follows other rows replaced (see the
    module doc)."""
    if backend.name == "reference":
        return replace(backend, name="reference+invariant", mla_decode=reference_decode,
                       fused_experts=reference_experts)
    from pagedmla.ops.triton.fp8_quant import fp8_dot_runs
    from pagedmla.ops.triton.invariant_decode import invariant_decode

    def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor, **fp8: object) -> torch.Tensor:
        if fp8.get("w13_scale_inv") is not None and not fp8_dot_runs(x.device):
            return reference_experts(x, w13, w2, weights, ids, **fp8)
        return backend.fused_experts(x, w13, w2, weights, ids, **fp8)

    return replace(backend, name=f"{backend.name}+invariant", mla_decode=invariant_decode,
                   fused_experts=fused_experts)
