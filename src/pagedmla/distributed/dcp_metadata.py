"""Per-rank attention metadata under decode context parallelism (host planning only).

The BatchSpec comes from the engine in virtual blocks (DCPLayout): block table and
slot mapping are the same on every rank. `DCPMetadataBuilder` turns it into this
rank's MLAMetadata: slot -1 for tokens another rank holds, decode lengths counted in
this rank's rows, context chunks planned as in the seed (a chunk costs each rank its
padded share of rows, row budget W // D, splits aligned to lcm(block_size, I * D)),
and the collectives that DCP adds (dcp_attention) attached to the metadata.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedmla.dims import MLADims
from pagedmla.distributed.dcp_attention import ChunkGatherPlan, DCPContextGather, DCPDecode
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.state import ParallelState
from pagedmla.host_arrays import Int32Upload, check_host_tensor, int_list
from pagedmla.metadata import (
    BatchSpec,
    MLAMetadata,
    MLAMetadataBuilder,
    PrefillMetadata,
    Workspace,
)
from pagedmla.planner import ContextChunkPlan, determine_workspace_rows, plan_context_chunks
from pagedmla.routing import PathCostModel


class DCPMetadataBuilder(MLAMetadataBuilder):
    """MLAMetadataBuilder for one rank of a DCP group.

    block_size is the physical page of this rank's cache (the engine's blocks hold
    block_size * D tokens). workspace_rows W is rounded up to a multiple of the chunk
    alignment; a chunk gathers at most W // D rows per rank and W rows in all.
    Multi-token decodes (decode_threshold > 1) are split into one row per token, each
    with its own length: the local rows that token i of q sees are the rank's rows of
    positions < S - q + i + 1, which a bottom-right rule on local lengths does not give.
    """

    def __init__(
        self,
        dims: MLADims,
        layout: DCPLayout,
        state: ParallelState,
        device: str | torch.device = "cpu",
        workspace_rows: int | None = None,
        decode_threshold: int = 1,
        max_model_len: int = 8192,
        max_num_seqs: int = 256,
        router: PathCostModel | None = None,
    ) -> None:
        if layout.size != state.dcp_size or layout.rank != state.dcp_rank:
            raise ValueError(
                f"layout is for DCP rank {layout.rank} of {layout.size}, the process is "
                f"rank {state.dcp_rank} of {state.dcp_size}"
            )
        if workspace_rows is None:
            workspace_rows = determine_workspace_rows(
                max_model_len, max_num_seqs, layout.block_size
            )
        align = layout.chunk_alignment
        workspace_rows = -(-max(workspace_rows, align) // align) * align
        super().__init__(
            dims, layout.block_size, device, workspace_rows, decode_threshold, max_model_len,
            max_num_seqs, router,
        )
        self.layout = layout
        self.state = state
        self.table_block_size = layout.virtual_block_size
        self.rows_per_rank = workspace_rows // layout.size
        # A rank's own gathered rows, then the whole group's after the all-gather.
        self.gather_buffers = Workspace(self.rows_per_rank * (layout.size + 1), self.device)
        self.decode_hook = DCPDecode(state)

    def build(self, spec: BatchSpec, validate: bool = True) -> MLAMetadata:
        if validate:  # the virtual slots, before they become this rank's
            self._checked(spec, slots=True)
        meta = super().build(self._rank_spec(spec), validate=False)
        if meta.decode is not None:
            meta.decode.dcp = self.decode_hook
        if meta.prefill is not None and meta.prefill.context is not None:
            meta.prefill.context.dcp = self._context_gather(meta.prefill)
        return meta

    def _rank_spec(self, spec: BatchSpec) -> BatchSpec:
        """This rank's slots; multi-token decodes split into single-token rows."""
        query_lens = int_list("query_lens", spec.query_lens)
        seq_lens = int_list("seq_lens", spec.seq_lens)
        table = check_host_tensor("block_table", spec.block_table, torch.int32, 2)
        slots = self.layout.local_slots(
            check_host_tensor("slot_mapping", spec.slot_mapping, torch.int64, 1)
        )
        if (self.decode_threshold == 1 and self.router is None) or table.shape[0] != len(
            query_lens
        ):
            return BatchSpec(query_lens, seq_lens, table, slots)  # (the base reports a bad table)
        rows, new_query_lens, new_seq_lens = [], [], []
        for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
            split = q > 1 and self.uses_mqa(q, s - q)
            rows += [b] * q if split else [b]
            new_query_lens += [1] * q if split else [q]
            new_seq_lens += range(s - q + 1, s + 1) if split else [s]
        return BatchSpec(new_query_lens, new_seq_lens, table[torch.tensor(rows)], slots)

    def _decode_seq_lens(self, seq_lens: list[int]) -> list[int]:
        return [self.layout.local_count(s) for s in seq_lens]

    def decode_spec(self, spec: BatchSpec) -> BatchSpec:
        """This rank's slots (-1 for another rank's tokens) and cache rows per request."""
        local = self._rank_spec(spec)
        return BatchSpec(local.query_lens, self._decode_seq_lens(local.seq_lens),
                         local.block_table, local.slot_mapping)

    def _plan_context(self, context_lens: list[int]) -> list[ContextChunkPlan]:
        return plan_context_chunks(
            context_lens,
            row_budget=self.rows_per_rank,
            max_context_chunk=self.workspace.rows,
            split_alignment=self.layout.chunk_alignment,
            padded_rows=self.layout.padded_rows,
        )

    def _context_gather(self, prefill: PrefillMetadata) -> DCPContextGather:
        assert prefill.context is not None
        upload = Int32Upload()
        pending = [self._chunk_plan(upload, chunk.starts_list, chunk.seq_lens_list)
                   for chunk in prefill.context.chunks]
        packed = upload.upload(self.device)

        def view(handle: tuple[int, int]) -> torch.Tensor:
            return packed[handle[0] : handle[0] + handle[1]]

        plans = [
            ChunkGatherPlan(num_local, max_rows, *(view(h) for h in handles))
            for num_local, max_rows, handles in pending
        ]
        return DCPContextGather(self.state, plans, self.gather_buffers, self.rows_per_rank)

    def _chunk_plan(
        self, upload: Int32Upload, starts: tuple[int, ...], lengths: tuple[int, ...]
    ) -> tuple[int, int, tuple[tuple[int, int], ...]]:
        """(rows here, rows of the fullest rank, upload handles of the ChunkGatherPlan
        tensors) for a chunk covering context positions [starts[j], starts[j] + lengths[j])
        of its requests j."""
        layout = self.layout
        ranks = np.arange(layout.size)
        first = np.asarray(starts)[:, None]
        lengths_arr = np.asarray(lengths)
        # [J, D]: each rank's local rows before the chunk, and inside it.
        before = layout.local_counts(first, ranks)
        counts = layout.local_counts(first + lengths_arr[:, None], ranks) - before
        cu = np.concatenate([np.zeros((1, layout.size), np.int64), counts.cumsum(axis=0)])
        max_rows = int(cu[-1].max())
        me = layout.rank
        # Chunk row r of request j is position p; its owner k has it at gathered row
        # k * max_rows + cu[j, k] + (local_index(p) - before[j, k]).
        request = np.repeat(np.arange(len(lengths)), lengths)
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        owner = layout.owner(positions)
        reorg = (owner * max_rows + cu[request, owner] + layout.local_index(positions)
                 - before[request, owner])
        handles = (
            upload.add(before[:, me]),
            upload.add(cu[:, me]),
            upload.add(np.repeat(np.arange(len(lengths)), counts[:, me])),
            upload.add(reorg),
        )
        return int(cu[-1, me]), max_rows, handles

