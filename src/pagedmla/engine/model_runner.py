"""Runs one scheduled step through the model: inputs, metadata, forward, logits."""

from __future__ import annotations

import numpy as np
import torch

from pagedmla.cache import LatentKVCache
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.cuda_graph import DecodeGraphs
from pagedmla.engine.scheduler import ScheduledBatch
from pagedmla.metadata import BatchSpec, MLAMetadataBuilder


class ModelRunner:
    """Owns the model's per-layer latent caches and turns a ScheduledBatch into logits.

    The model is any module with `forward(input_ids [T], positions [T], caches, meta)
    -> hidden [T, H]`, `compute_logits(hidden [B, H]) -> [B, vocab]` and `dims`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        caches: list[LatentKVCache],
        block_manager: BlockManager,
        builder: MLAMetadataBuilder,
    ) -> None:
        self.model = model
        self.caches = caches
        self.block_manager = block_manager
        self.builder = builder
        self.device = builder.device
        # Set by the engine when decode steps replay CUDA graphs (None: always eager).
        self.graphs: DecodeGraphs | None = None

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchSpec]:
        """Host-side inputs of a step: token ids [T], positions [T] and the BatchSpec.

        Runs every step for every sequence, so it sticks to list and numpy operations
        (a torch tensor per row would cost more than the rest of the step's bookkeeping).
        """
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        block_size = self.block_manager.block_size
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            end = start + num_new
            token_ids += seq.token_ids[start:end]
            span = range(start, end)
            positions += span
            blocks = seq.block_table
            slots += [blocks[p // block_size] * block_size + p % block_size for p in span]
            seq_lens.append(end)
        width = max(len(seq.block_table) for seq in batch.seqs)
        # Block 0 is the null block: padding entries point at it and are never read.
        table = np.zeros((len(batch.seqs), width), dtype=np.int32)
        for row, seq in enumerate(batch.seqs):
            table[row, : len(seq.block_table)] = seq.block_table
        spec = BatchSpec(
            query_lens=list(batch.num_new_tokens),
            seq_lens=seq_lens,
            block_table=torch.from_numpy(table),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
        )
        return (
            torch.tensor(token_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            spec,
        )

    @staticmethod
    def sample_rows(batch: ScheduledBatch) -> list[int]:
        """Token rows whose logits are sampled: the last row of each entry that needs one."""
        last_rows = []
        end = 0
        for num_new, needs_sample in zip(batch.num_new_tokens, batch.needs_sample, strict=True):
            end += num_new
            if needs_sample:
                last_rows.append(end - 1)
        return last_rows

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward one step; returns logits [S, vocab] float32 for the S sequences to sample."""
        token_ids, positions, spec = self.prepare(batch)
        return self.execute(token_ids, positions, spec, self.sample_rows(batch))

    @torch.inference_mode()
    def execute(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Forward prepared host inputs (token_ids [T], positions [T], spec); returns the
        logits [S, vocab] float32 of the S token rows in sample_rows."""
        graphs = self.graphs
        if (
            graphs is not None
            and len(spec.query_lens) <= graphs.max_batch
            and all(q == 1 for q in spec.query_lens)
        ):
            return graphs.run(token_ids, positions, spec, sample_rows)
        meta = self.builder.build(spec)
        hidden = self.model(
            token_ids.to(self.device, non_blocking=True),
            positions.to(self.device, non_blocking=True),
            self.caches,
            meta,
        )
        index = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()
