"""The attention-time collectives of decode context parallelism (DCP).

Decode: every rank of a DCP group holds all heads' queries of the group after an
all-gather, attends over its own cache rows only, and the partials (output, lse) are
exchanged with an all-to-all so that each rank merges, for its own heads, the D
partials by log-sum-exp. Chunked-context prefill: each rank gathers the chunk's rows
it holds, the group all-gathers them and one index_select puts them back in request
and position order; the MHA context path then runs as on one rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.distributed.state import ParallelState
from pagedmla.metadata import ContextChunk, Workspace
from pagedmla.ops import Backend


class DCPDecode:
    """Query all-gather and partial combine around the absorbed decode kernel."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state

    def gather_queries(self, q: torch.Tensor) -> torch.Tensor:
        """q [Td, N, L + R] of this rank's heads -> [Td, D * N, L + R], the heads of the
        whole DCP group in rank order."""
        gathered = self.state.dcp_all_gather(q)  # [D, Td, N, L + R]
        return gathered.transpose(0, 1).reshape(q.shape[0], -1, q.shape[2])

    def combine(self, out: torch.Tensor, lse: torch.Tensor, ops: Backend) -> torch.Tensor:
        """Partials over this rank's rows, out [Td, D * N, L] and lse [D * N, Td] ->
        the exact result for this rank's N heads, [Td, N, L] in out's dtype (merged by
        the backend's `merge_partials`)."""
        D = self.state.dcp_size
        Td, _, L = out.shape
        # One message per peer: its heads' outputs with their lse as an extra column.
        packed = torch.cat([out.float(), lse.t().unsqueeze(-1)], dim=-1)  # [Td, D * N, L + 1]
        send = packed.view(Td, D, -1, L + 1).transpose(0, 1)  # [D, Td, N, L + 1]
        received = self.state.dcp_all_to_all(send)  # part k: rank k's rows, my heads
        return ops.merge_partials(received[..., :L], received[..., L], out.dtype)


@dataclass
class ChunkGatherPlan:
    """How one context chunk's rows are collected (tensors on the device, int32).

    This rank gathers num_local rows: request j of the chunk contributes its local rows
    [starts[j], starts[j] + n_j) to local rows [cu_seq_lens[j], cu_seq_lens[j + 1]).
    Every rank's block is padded to max_rows for the all-gather; reorg [rows] picks
    each chunk row, in request and position order, out of the gathered [D * max_rows].
    """

    num_local: int
    max_rows: int
    starts: torch.Tensor
    cu_seq_lens: torch.Tensor
    token_to_seq: torch.Tensor
    reorg: torch.Tensor


class DCPContextGather:
    """Collects the rows of each context chunk from the DCP group (one step's plan).

    buffers: scratch of at least rows_per_rank * (D + 1) rows, shared by every layer.
    """

    def __init__(
        self,
        state: ParallelState,
        plans: list[ChunkGatherPlan],
        buffers: Workspace,
        rows_per_rank: int,
    ) -> None:
        self.state = state
        self.plans = plans
        self.buffers = buffers
        self.rows_per_rank = rows_per_rank

    def gather(
        self,
        chunk: ContextChunk,
        cache: LatentKVCache,
        block_table: torch.Tensor,
        ops: Backend,
        out: torch.Tensor,
    ) -> None:
        """Fill out [chunk.num_context_tokens, L + R] (dequantized) with the chunk's rows.

        block_table: the prefills' table [Bp, max_blocks], as the single-rank gather gets.
        """
        plan = self.plans[chunk.index]
        scratch = self.buffers.get(out.shape[1], out.dtype)
        local = scratch[: plan.max_rows]
        if plan.num_local:
            ops.gather_cache(
                cache.data, cache.scale, block_table[chunk.request_slice], plan.starts,
                plan.cu_seq_lens, plan.token_to_seq, local[: plan.num_local],
            )
        # Rows past num_local are stale scratch: gathered along, never selected.
        first = self.rows_per_rank
        gathered = scratch[first : first + self.state.dcp_size * plan.max_rows]
        self.state.dcp_all_gather(local, out=gathered)
        torch.index_select(gathered, 0, plan.reorg, out=out)
