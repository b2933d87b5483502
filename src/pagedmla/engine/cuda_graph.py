"""CUDA graphs of decode-only steps: capture once per batch size, replay every step.

A decode step launches hundreds of small kernels; replaying a captured graph removes
their launch cost. Inputs live in static buffers that each step overwrites (padding
rows: token 0, slot -1 so nothing is written, the null block 0 and seq_len 0 so they
attend to nothing). The decode metadata is captured with max_seq_len = max_model_len,
so the kernels' split plan covers any context the engine can hold: a graph captured
with short contexts stays correct and fast when replayed with long ones.
"""

from __future__ import annotations

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import BatchSpec, DecodeMetadata, MLAMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class GraphInputs:
    """The static input buffers of captured decode steps and their per-step staging.

    Buffers for up to `max_rows` rows on `device`: token_ids, positions and slot_mapping
    int64 [max_rows], seq_lens int32 [max_rows], block_table int32 [max_rows, max_blocks]
    and query_start_loc int32 [max_rows + 1] (0, 1, .., max_rows: one token per row).
    `stage` writes a step's host inputs into the first rows of a graph's size; slots and
    block ids are checked against a cache of `num_slots` slots in `num_blocks` blocks,
    since a replayed graph writes and reads wherever they point. On the CPU (no graphs)
    it runs the same bookkeeping, which is what the host benchmark times.
    """

    def __init__(
        self, max_rows: int, max_blocks: int, num_slots: int, num_blocks: int,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.device = device
        self.token_ids = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.block_table = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)

    def stage(
        self,
        rows: int,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Write B <= rows single-token requests (host token_ids [B], positions [B], spec)
        into the first `rows` rows, padding the rest; returns sample_rows as an int64
        index [S] on the device."""
        batch = token_ids.shape[0]
        table = spec.block_table
        if table.shape[1] > self.block_table.shape[1]:
            raise ValueError(
                f"block_table has {table.shape[1]} columns, the graphs hold "
                f"{self.block_table.shape[1]}"
            )
        if int(spec.slot_mapping.max()) >= self.num_slots:
            raise ValueError(f"slot_mapping exceeds the cache's {self.num_slots} slots")
        if int(table.max()) >= self.num_blocks:
            raise ValueError(f"block_table exceeds the cache's {self.num_blocks} blocks")
        self.token_ids[:batch].copy_(token_ids, non_blocking=True)
        self.positions[:batch].copy_(positions, non_blocking=True)
        self.slot_mapping[:batch].copy_(spec.slot_mapping, non_blocking=True)
        self.slot_mapping[batch:rows].fill_(-1)
        self.block_table[:batch, : table.shape[1]].copy_(table, non_blocking=True)
        self.block_table[:batch, table.shape[1] :].zero_()
        self.block_table[batch:rows].zero_()
        seq_lens = torch.tensor(spec.seq_lens, dtype=torch.int32)
        self.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        self.seq_lens[batch:rows].zero_()
        return torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)


class DecodeGraphs:
    """Captured decode steps of `model` over `caches` for each size in `sizes`.

    `run(token_ids [B], positions [B], spec, sample_rows)` replays the smallest graph
    with at least B rows and returns the logits [len(sample_rows), vocab] float32.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        caches: list[LatentKVCache],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        cache = caches[0]
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, cache.num_slots,
                                  cache.num_blocks, cache.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _metadata(self, rows: int) -> MLAMetadata:
        cache = self.caches[0]
        inputs = self.inputs
        return MLAMetadata(
            num_tokens=rows,
            num_decodes=rows,
            num_decode_tokens=rows,
            num_prefills=0,
            num_prefill_tokens=0,
            block_size=cache.block_size,
            kv_lora_rank=cache.kv_lora_rank,
            rope_dim=cache.rope_dim,
            slot_mapping=inputs.slot_mapping[:rows],
            max_slot=-1,  # the replayed slots are validated on the host in GraphInputs.stage
            max_block=0,
            device=cache.device,
            decode=DecodeMetadata(
                block_table=inputs.block_table[:rows],
                seq_lens=inputs.seq_lens[:rows],
                query_start_loc=inputs.query_start_loc[: rows + 1],
                max_query_len=1,
                max_seq_len=self.max_model_len,
            ),
            prefill=None,
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for rows in reversed(self.sizes):  # largest first: later graphs reuse its memory
            meta = self._metadata(rows)
            args = (self.inputs.token_ids[:rows], self.inputs.positions[:rows], self.caches, meta)
            # Warm-up outside the graph compiles kernels and builds lazy tables (RoPE).
            self.model.compute_logits(self.model(*args))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(*args)).float()
            pool = graph.pool()
            self.graphs[rows] = (graph, logits)
        torch.cuda.synchronize()

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Replay a decode step of B <= max_batch single-token requests (host inputs)."""
        rows = next(size for size in self.sizes if size >= token_ids.shape[0])
        index = self.inputs.stage(rows, token_ids, positions, spec, sample_rows)
        graph, logits = self.graphs[rows]
        graph.replay()
        return logits.index_select(0, index)
