"""Runs one scheduled step through the model: inputs, metadata, forward, logits.

`ModelRunner` runs a step on this rank; under tensor parallelism the driver's
`DriverRunner` first sends the step to the other ranks, which run it with their
`ModelRunner.execute` (`ParallelRuntime.serve`).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedmla.cache import LatentKVCache
from pagedmla.distributed.channel import StepInputs
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.cuda_graph import DecodeGraphs
from pagedmla.engine.piecewise import PiecewiseGraphs
from pagedmla.engine.scheduler import ScheduledBatch
from pagedmla.metadata import BatchSpec, MLAMetadataBuilder
from pagedmla.ops.batch_invariant import ROW_TILE

if TYPE_CHECKING:
    from pagedmla.distributed.pcp import PCPStep, PrefillContextParallel
    from pagedmla.distributed.runtime import ParallelRuntime


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
        # Set by the engine when decode steps replay CUDA graphs (None: always eager),
        # and when other steps of up to pieces.max_tokens tokens replay their pieces.
        self.graphs: DecodeGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        # Set by a batch-invariant engine: every token a request of its own (`prepare`).
        self.batch_invariant = False
        # Set under prefill context parallelism: steps with prompts split over the ranks.
        self.pcp: PrefillContextParallel | None = None

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, BatchSpec]:
        """Host-side inputs of a step: token ids [T], positions [T] and the BatchSpec.

        Runs every step for every sequence, so the only per-sequence Python is reading
        its counters and token ids; the block table comes from the block manager's
        int32 mirror and positions and slots are computed with numpy over all T tokens.
        The token that an ``ahead`` batch's entry reads from the step before's samples
        (``sources``) is not known yet: it is 0 here and comes from the device
        (``device_token_ids``). In batch-invariant mode every token is a request of
        one query row over its sequence's cache up to itself, so that its attention
        is the same whatever else its step holds (`ops/batch_invariant.py`).
        """
        seqs = batch.seqs
        num_new = batch.num_new_tokens
        starts = batch.first_positions()
        num_seqs = len(seqs)
        if len(num_new) != num_seqs:
            raise ValueError(f"{num_seqs} sequences but {len(num_new)} num_new_tokens")
        sources = batch.sources or [-1] * num_seqs
        # Block 0 is the null block: padding entries point at it and are never read.
        table = self.block_manager.block_tables(seqs)
        num_tokens = sum(num_new)
        if num_tokens == num_seqs:  # one token each (decodes): no ranges to expand
            token_ids = [0 if source >= 0 else seq.token_ids[start]
                         for seq, start, source in zip(seqs, starts, sources)]
            positions = np.array(starts, dtype=np.int64)
            token_rows = np.arange(num_seqs)
        else:
            token_ids = []
            for seq, start, n, source in zip(seqs, starts, num_new, sources):
                token_ids += [0] if source >= 0 else seq.token_ids[start : start + n]
            counts = np.array(num_new, dtype=np.int64)
            token_rows = np.repeat(np.arange(num_seqs), counts)
            # Entry b's tokens sit at batch offsets first[b] .. and positions starts[b] ..
            first = np.cumsum(counts) - counts
            offsets = np.array(starts, dtype=np.int64) - first
            positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(offsets, counts)
        block_size = self.block_manager.block_size
        blocks = table[token_rows, positions // block_size].astype(np.int64)
        slots = torch.from_numpy(blocks * block_size + positions % block_size)
        if self.batch_invariant:
            spec = BatchSpec(query_lens=[1] * num_tokens, seq_lens=(positions + 1).tolist(),
                             block_table=torch.from_numpy(table[token_rows]),
                             slot_mapping=slots)
        else:
            spec = BatchSpec(query_lens=list(num_new),
                             seq_lens=[start + n for start, n in zip(starts, num_new)],
                             block_table=torch.from_numpy(table), slot_mapping=slots)
        return (
            torch.from_numpy(np.array(token_ids, dtype=np.int64)),
            torch.from_numpy(positions),
            spec,
        )

    @staticmethod
    def sample_rows(batch: ScheduledBatch) -> list[int]:
        """Token rows whose logits are sampled: the last row of each entry that needs one."""
        ends = itertools.accumulate(batch.num_new_tokens)
        return [end - 1 for end, needs in zip(ends, batch.needs_sample, strict=True) if needs]

    def run(self, batch: ScheduledBatch, drawn: torch.Tensor | None = None) -> torch.Tensor:
        """Forward one step; returns logits [S, vocab] float32 for the S sequences to
        sample. drawn [S'] int64 on the device: the samples of the step before, which an
        ``ahead`` batch's ``sources`` index."""
        token_ids, positions, spec = self.prepare(batch)
        return self.execute(token_ids, positions, spec, self.sample_rows(batch),
                            self.device_token_ids(batch, token_ids, drawn))

    def device_token_ids(
        self, batch: ScheduledBatch, token_ids: torch.Tensor, drawn: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The step's token ids [T] on the device when some are there only: the host's
        token_ids [T] (``prepare``'s) with each ``sources`` row taken from drawn [S'] (the
        samples of the step before). None when the host knows them all."""
        sources = batch.sources
        if sources is None or max(sources) < 0:
            return None
        if drawn is None:
            raise ValueError("an ahead batch reading the step before's samples needs drawn")
        pinned = self.device.type == "cuda"

        def upload(values: list[int]) -> torch.Tensor:
            # Pinned, so that the copy does not wait for the step still running.
            host = torch.tensor(values, dtype=torch.int64, pin_memory=pinned)
            return host.to(self.device, non_blocking=True)

        if len(sources) == token_ids.shape[0] and min(sources) >= 0:  # every row a sample
            if sources == list(range(len(sources))):
                return drawn[: len(sources)]
            return drawn.index_select(0, upload(sources))
        offsets = itertools.accumulate(batch.num_new_tokens, initial=0)
        rows = [row for row, source in zip(offsets, sources) if source >= 0]
        index = upload(rows + [source for source in sources if source >= 0])
        ids = (token_ids.pin_memory() if pinned else token_ids).to(self.device, non_blocking=True)
        return ids.index_copy_(0, index[: len(rows)], drawn.index_select(0, index[len(rows) :]))

    @torch.inference_mode()
    def execute(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
        device_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Forward prepared host inputs (token_ids [T], positions [T], spec); returns the
        logits [S, vocab] float32 of the S token rows in sample_rows. device_token_ids
        [T] int64 on the device, when given, is fed instead of token_ids."""
        if self.batch_invariant:
            return self._execute_invariant(token_ids, positions, spec, sample_rows,
                                           device_token_ids)
        graphs = self.graphs
        if (
            graphs is not None
            and len(spec.query_lens) <= graphs.max_batch
            and all(q == 1 for q in spec.query_lens)
        ):
            return graphs.run(token_ids, positions, self.builder.decode_spec(spec), sample_rows,
                              device_token_ids)
        if self.pcp is not None:
            split = self.pcp.plan(spec, sample_rows)
            if split is not None:
                return self._execute_split(split, token_ids, positions, device_token_ids)
        meta = self.builder.build(spec, validate=False)  # prepare() derives the slots
        pieces = self.pieces
        if pieces is not None and token_ids.shape[0] <= pieces.max_tokens:
            return pieces.run(token_ids, positions, meta, sample_rows, device_token_ids)
        if device_token_ids is None:
            device_token_ids = token_ids.to(self.device, non_blocking=True)
        hidden = self.model(
            device_token_ids,
            positions.to(self.device, non_blocking=True),
            self.caches,
            meta,
        )
        index = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    def _execute_split(
        self,
        step: PCPStep,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        device_token_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """`execute` for this rank's part of a step split by prefill context parallelism
        (`distributed/pcp.py`): its rows only, eagerly; the logits of every sample row."""
        meta = self.builder.build(step.spec, validate=False)
        meta.pcp = step.latents
        if device_token_ids is None:
            ids = token_ids[step.rows].to(self.device, non_blocking=True)
        else:
            ids = device_token_ids.index_select(0, step.rows.to(self.device))
        hidden = self.model(ids, positions[step.rows].to(self.device, non_blocking=True),
                            self.caches, meta)
        return self.model.compute_logits(self.pcp.gather_samples(hidden, step)).float()

    def _execute_invariant(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
        device_token_ids: torch.Tensor | None,
    ) -> torch.Tensor:
        """`execute` for a batch-invariant engine: the step's T tokens (each a request of
        one row, `prepare`) in forwards of exactly ROW_TILE tokens, their logits too, so
        that every op always sees the same shapes (`ops/batch_invariant.py`). The last
        forward is padded with rows that write nothing (slot -1) and read one position
        of the null block; a captured decode graph of ROW_TILE rows runs them where the
        engine has one. sample_rows ascending, as `sample_rows` gives them."""
        T = token_ids.shape[0]
        pad = -T % ROW_TILE
        ids = token_ids if device_token_ids is None else device_token_ids
        ids = torch.cat([ids.to(self.device), ids.new_zeros(pad, device=self.device)])
        host_ids = torch.cat([token_ids, token_ids.new_zeros(pad)])
        positions = torch.cat([positions, positions.new_zeros(pad)])
        table = spec.block_table
        table = torch.cat([table, table.new_zeros(pad, table.shape[1])])
        slots = torch.cat([spec.slot_mapping, spec.slot_mapping.new_full((pad,), -1)])
        seq_lens = [*spec.seq_lens, *[1] * pad]
        logits = []
        for start in range(0, T + pad, ROW_TILE):
            rows = slice(start, start + ROW_TILE)
            chunk = BatchSpec(query_lens=[1] * ROW_TILE, seq_lens=seq_lens[rows],
                              block_table=table[rows], slot_mapping=slots[rows])
            # Logits of all ROW_TILE rows (one shape), kept for the rows sampled only.
            keep = [row - start for row in sample_rows if start <= row < start + ROW_TILE]
            if self.graphs is not None:
                every = self.graphs.run(host_ids[rows], positions[rows],
                                        self.builder.decode_spec(chunk),
                                        list(range(ROW_TILE)), ids[rows])
            else:
                meta = self.builder.build(chunk, validate=False)
                hidden = self.model(ids[rows], positions[rows].to(self.device), self.caches,
                                    meta)
                every = self.model.compute_logits(hidden).float()
            # A copy (index_select): a replayed graph's logits live in its own buffer.
            index = torch.tensor(keep, dtype=torch.int64).to(self.device, non_blocking=True)
            logits.append(every.index_select(0, index))
        return torch.cat(logits)


class DriverRunner(ModelRunner):
    """Rank 0's runner: sends each step's inputs to the other ranks, then runs its own
    share."""

    def __init__(self, runtime: ParallelRuntime, *args: Any) -> None:
        super().__init__(*args)
        self.runtime = runtime

    def run(self, batch: ScheduledBatch, drawn: torch.Tensor | None = None) -> torch.Tensor:
        token_ids, positions, spec = self.prepare(batch)
        device_token_ids = self.device_token_ids(batch, token_ids, drawn)
        step = StepInputs(token_ids, positions, spec, self.sample_rows(batch),
                          device_tokens=device_token_ids is not None)
        with self.runtime.watching_workers():
            device_token_ids = self.runtime.send_step(step, device_token_ids)
            return self.execute(step.token_ids, step.positions, step.spec, step.sample_rows,
                                device_token_ids)
