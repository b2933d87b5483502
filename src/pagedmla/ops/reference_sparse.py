"""Sparse MLA attention (DeepSeek Sparse Attention), the executable specification.

Each query token attends only to the cache positions its indexer selected: absorbed MQA
of q [T, N, L + R] over the selected latent rows [topk, L + R] of its own request (keys:
whole rows as read, values: their first L columns), output in latent space [T, N, L].
Decode and prefill rows are the same computation, since every query has its own list.

The index contract, `indices` [T, topk] int32:

* an entry is a token POSITION within the query's request (0 = its first token), not a
  cache slot: the block table maps it to a slot, so the indexer needs no block table and
  its output survives a request's blocks moving (prefix caching, preemption);
* -1 marks an unused entry; a query whose entries are all unused sees no key (out 0,
  lse -inf);
* a position past the query's causal limit (query i of a request of q_len tokens and
  seq_len positions sees positions < seq_len - q_len + i + 1, `docs/design.md`) is
  masked like -1, never read: top-k over a causally masked score row picks such
  positions when fewer than topk are visible, and the causal mask drops them, as in the
  Hugging Face DeepSeek-V3.2 model. An indexer should emit -1 there;
* the positions of one query are distinct (top-k gives distinct positions). A repeated
  position is attended once per occurrence here, as gather-based kernels do, so it
  would weigh twice.

`check_sparse_indices` checks all of it on the host (for tests and debugging: it reads
the indices back). The op itself reads no device value on the host: its query chunks
(`SPARSE_CHUNK_ELEMENTS`) follow from shapes alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedmla.ops.reference import _attend, _read_rows, token_requests

# float32 elements the temporaries of one query chunk may hold (256 MiB), whatever T and
# the context length.
SPARSE_CHUNK_ELEMENTS = 1 << 26


def sparse_query_rows(num_heads: int, width: int, topk: int, chunk_elements: int) -> int:
    """Query rows per chunk, at least one: as many as keep a chunk's temporaries within
    chunk_elements float32 values. A query row holds three [N, topk] arrays (scores,
    masked scores, probabilities) and two [topk, width] ones (rows as read, then
    zeroed where unselected)."""
    per_row = topk * (3 * num_heads + 2 * width)
    return max(1, chunk_elements // max(1, per_row))


def sparse_mla_attention(
    q: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    indices: torch.Tensor,
    kv_lora_rank: int,
    softmax_scale: float,
    *,
    chunk_elements: int = SPARSE_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA of each query over its selected positions of the paged latent cache.

    q [T, N, L + R] absorbed queries; data, scale: a cache of any dtype ("auto", fp8,
    fp8_ds_mla; rows dequantized as read); block_table [B, max_blocks] int32; seq_lens
    [B] int32; query_start_loc [B + 1] int32 (request b owns query rows
    query_start_loc[b]:query_start_loc[b + 1], the last positions of its seq_len);
    indices [T, topk] int32 positions (the module docstring gives the contract).
    Returns out [T, N, L] in q's dtype and lse [N, T] float32 (natural log); a query
    with no selected position gets out 0 and lse -inf. Computed in float32, in chunks of
    `sparse_query_rows(...)` queries, so memory stays bounded however large T is.
    """
    num_tokens, num_heads, width = q.shape
    topk = indices.shape[1]
    out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
    lse = torch.empty(num_heads, num_tokens, dtype=torch.float32, device=q.device)
    if num_tokens == 0:
        return out, lse
    token_req, index_in_req = token_requests(query_start_loc, num_tokens)
    # Query i of request b (q_len_b new tokens) is at position seq_len_b - q_len_b + i.
    q_lens = query_start_loc.long().diff()
    token_pos = seq_lens.long()[token_req] - q_lens[token_req] + index_in_req
    block_size = data.shape[1]
    step = sparse_query_rows(num_heads, width, topk, chunk_elements)
    for r0 in range(0, num_tokens, step):
        rows = slice(r0, min(num_tokens, r0 + step))
        position = indices[rows].long()
        selected = (position >= 0) & (position <= token_pos[rows].unsqueeze(1))
        # Unselected entries read position 0 of their request (always a real block) and
        # are then zeroed and masked: whatever that row holds, NaN included, is not seen.
        position = torch.where(selected, position, 0)
        blocks = block_table.long()[token_req[rows].unsqueeze(1), position // block_size]
        kv = _read_rows(data, blocks * block_size + position % block_size, scale)
        kv = torch.where(selected.unsqueeze(-1), kv, 0.0)  # [rows, topk, L + R]
        chunk_out, chunk_lse = _attend(
            q[rows].float(), kv, kv[..., :kv_lora_rank], selected.unsqueeze(1), softmax_scale
        )  # [rows, N, L], [rows, N]
        out[rows] = chunk_out.to(out.dtype)
        lse[:, rows] = chunk_lse.transpose(0, 1)
    return out, lse


def check_sparse_indices(
    indices: torch.Tensor, query_lens: Sequence[int], seq_lens: Sequence[int]
) -> None:
    """ValueError (TypeError for a wrong type) naming the first query whose indices break
    the contract of this module: an int32 [sum(query_lens), topk] tensor whose entries
    are -1 or positions the query may see, distinct within each query. Reads the indices
    on the host: for tests and debugging, not for a step's path."""
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    if len(query_lens) != len(seq_lens):
        raise ValueError(
            f"query_lens has {len(query_lens)} entries, seq_lens {len(seq_lens)}"
        )
    num_tokens = sum(query_lens)
    if indices.dim() != 2 or indices.shape[0] != num_tokens:
        raise ValueError(
            f"indices must have shape [{num_tokens}, topk] (one row per query token), got "
            f"{list(indices.shape)}"
        )
    # The position of every query token, from the requests' lengths.
    limit = torch.tensor(
        [s - q + i for q, s in zip(query_lens, seq_lens) for i in range(q)], dtype=torch.long
    ).view(-1, 1)
    values = indices.cpu().long()
    bad = (values < -1) | (values > limit)
    ordered = values.sort(dim=1).values
    repeated = torch.zeros_like(bad)
    repeated[:, 1:] = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    for problem, found in (("outside [-1, its position]", bad), ("repeated", repeated)):
        if found.any():
            token, slot = (int(i) for i in found.nonzero()[0])
            source = values if problem != "repeated" else ordered
            raise ValueError(
                f"indices of query token {token} (position {int(limit[token])}) must be -1 "
                f"or distinct positions in [0, {int(limit[token])}]: entry "
                f"{source[token, slot].item()} is {problem}"
            )
