"""CUDA graphs of decode-only steps: capture once per batch size, replay every step.

A decode step launches hundreds of small kernels; replaying a captured graph removes
their launch cost. Inputs live in static buffers that each step overwrites (padding
rows: token 0, slot -1 so nothing is written, the null block 0 and seq_len 0 so they
attend to nothing). The decode metadata is captured with max_seq_len = max_model_len,
which bounds the kernels' grids, and the split plan is made on the device from each
replay's lengths (its kernel is part of the graph): a graph captured with short
contexts stays correct and fast when replayed with long or ragged ones.

A sparse-attention model's graphs run the indexer and sparse attention for every row
(`SparseMetadata.dense` False: a row whose context fits in top-k selects all of it, which
is dense attention's result). The indexer scores every position its block table covers,
so these graphs also come in block-table widths (`graph_widths`) and a replay takes the
narrowest that holds the step's table.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import BatchSpec, DecodeHook, DecodeMetadata, MLAMetadata, SparseMetadata

# Each captured block-table width of a sparse model's decode graphs is this many times the
# one before it: a replay's indexer scores at most this many times the positions of the
# step's widest table.
WIDTH_STEP = 4


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 up to max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def graph_widths(max_blocks: int, block_size: int, topk: int | None) -> list[int]:
    """Block-table widths (in blocks) to capture decode graphs at, ascending, max_blocks
    last. Dense attention needs max_blocks alone: no kernel's work follows the table's
    width. A sparse model's indexer scores and ranks every position of the table, so
    its widths start at the first that holds topk positions and grow WIDTH_STEP times."""
    widths = [max_blocks]
    if topk is not None:
        width = -(-topk // block_size)
        while width < max_blocks:
            widths.insert(-1, width)
            width *= WIDTH_STEP
    return widths


def capture_each(
    count: int, body: Callable[[int], None], pool: tuple | None
) -> tuple[list[torch.cuda.CUDAGraph], tuple]:
    """Graphs of body(0), .., body(count - 1), captured in that order into one memory
    pool (`pool`, an earlier capture's, or None for a new one); returns them and the
    pool for the next capture. Whatever crosses graphs must live in static buffers:
    each graph's temporaries are dead once its capture ends, and later ones reuse them."""
    graphs = []
    for i in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body(i)
        pool = graph.pool()
        graphs.append(graph)
    return graphs, pool


def reset_all(graphs: dict[int, list[torch.cuda.CUDAGraph]]) -> None:
    """Free every graph of `graphs` (lists of graphs by size) and empty it."""
    for each in graphs.values():
        for graph in each:
            graph.reset()
    graphs.clear()


def _padded_rows(max_rows: int) -> int:
    """Entries per array in the GraphInputs buffer: max_rows rounded up to a multiple of
    4, so that every array starts 16-byte aligned (what the kernels are tuned for)."""
    return -(-max_rows // 4) * 4


def _input_words(max_rows: int, rows: int, max_blocks: int) -> int:
    """int64 words of the GraphInputs layout up to the end of table row `rows`."""
    padded = _padded_rows(max_rows)
    return 4 * padded + padded // 2 + (rows * max_blocks + 1) // 2


def _input_views(buffer: torch.Tensor, max_rows: int, max_blocks: int) -> list[torch.Tensor]:
    """The graph inputs as views of an int64 `buffer` laid out by GraphInputs: token_ids,
    positions, slot_mapping, sample_index int64 [max_rows]; seq_lens int32 [max_rows];
    block_table int32 [max_rows, max_blocks], last, so that a step copies only the rows
    its graph reads."""
    padded = _padded_rows(max_rows)
    views = [buffer[i * padded : i * padded + max_rows] for i in range(4)]
    narrow = buffer[4 * padded :].view(torch.int32)
    views.append(narrow[:max_rows])
    views.append(narrow[padded : padded + max_rows * max_blocks].view(max_rows, max_blocks))
    return views


class GraphInputs:
    """The static input buffers of captured decode steps and their per-step staging.

    Buffers for up to `max_rows` rows on `device`: token_ids, positions, slot_mapping
    and sample_index int64 [max_rows], seq_lens int32 [max_rows] and block_table int32
    [max_rows, max_blocks], all views of one device buffer, and query_start_loc int32
    [max_rows + 1] (0, 1, .., max_rows: one token per row). `stage` fills a host twin of
    that buffer (pinned on CUDA) with numpy and moves it in one copy, rather than a
    copy or a fill per tensor. Slots and block ids are checked against a cache of
    `num_slots` slots in `num_blocks` blocks, since a replayed graph writes and reads
    wherever they point. On the CPU (no graphs) it does the same bookkeeping, which is
    what the host benchmark times.
    """

    def __init__(
        self, max_rows: int, max_blocks: int, num_slots: int, num_blocks: int,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.max_rows = max_rows
        self.max_blocks = max_blocks
        # int64 words (not bytes): few elements, so a CPU copy stays one serial memcpy.
        size = _input_words(max_rows, max_rows, max_blocks)
        self._device_buffer = torch.zeros(size, dtype=torch.int64, device=device)
        (self.token_ids, self.positions, self.slot_mapping, self.sample_index, self.seq_lens,
         self.block_table) = _input_views(self._device_buffer, max_rows, max_blocks)
        self._host_buffer = torch.zeros(size, dtype=torch.int64,
                                        pin_memory=device.type == "cuda")
        (self._host_token_ids, self._host_positions, self._host_slots, self._host_sample_index,
         self._host_seq_lens, self._host_table) = (
            view.numpy() for view in _input_views(self._host_buffer, max_rows, max_blocks)
        )
        # Until a step writes them, rows write nothing (capture runs on these values).
        self.slot_mapping.fill_(-1)
        self._host_slots.fill(-1)
        self.query_start_loc = torch.arange(max_rows + 1, dtype=torch.int32, device=device)
        # Recorded after each copy: the host buffer is rewritten only once it has been read.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self._table_used = (0, 0)  # rows and columns of the host table the last step wrote

    def stage(
        self,
        rows: int,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Write B <= rows single-token requests (host token_ids [B], positions [B], spec)
        into the first `rows` rows, padding the rest (token 0, position 0, slot -1, seq_len
        0, null blocks); returns sample_rows as an int64 index [S] on the device."""
        batch = token_ids.shape[0]
        table = spec.block_table.numpy()
        slots = spec.slot_mapping.numpy()
        width = table.shape[1]
        if width > self.max_blocks:
            raise ValueError(
                f"block_table has {width} columns, the graphs hold {self.max_blocks}"
            )
        if slots.max() >= self.num_slots:
            raise ValueError(f"slot_mapping exceeds the cache's {self.num_slots} slots")
        if table.max() >= self.num_blocks:
            raise ValueError(f"block_table exceeds the cache's {self.num_blocks} blocks")
        if self._copied is not None:
            self._copied.synchronize()
        self._host_token_ids[:batch] = token_ids.numpy()
        self._host_token_ids[batch:rows] = 0
        self._host_positions[:batch] = positions.numpy()
        self._host_positions[batch:rows] = 0
        self._host_slots[:batch] = slots
        self._host_slots[batch:rows] = -1
        self._host_seq_lens[:batch] = spec.seq_lens
        self._host_seq_lens[batch:rows] = 0
        self._host_sample_index[: len(sample_rows)] = sample_rows
        # Outside what the last step wrote the host table is all null blocks.
        used_rows, used_width = self._table_used
        self._host_table[:used_rows, :used_width] = 0
        self._host_table[:batch, :width] = table
        self._table_used = (batch, width)
        end = _input_words(self.max_rows, rows, self.max_blocks)
        self._device_buffer[:end].copy_(self._host_buffer[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self._device_buffer.device))
        return self.sample_index[: len(sample_rows)]


def graph_metadata(
    cache: LatentKVCache, inputs: GraphInputs, rows: int, max_model_len: int,
    dcp: DecodeHook | None = None, topk: int | None = None, width: int | None = None,
) -> MLAMetadata:
    """The metadata a captured decode reads: `rows` single-token decodes over the first
    rows of `inputs` (slots, seq_lens, the first `width` columns of the block table, all
    by default), with max_seq_len = max_model_len (or what `width` blocks hold, if
    fewer), for caches shaped like `cache`; with `topk`, the sparse batch of a
    sparse-attention model whose indexer keeps topk positions, sparse for every row.
    Its slots are checked by whoever fills `inputs` (max_slot -1 and max_block 0 here),
    since a replay writes wherever they point."""
    table = inputs.block_table[:rows, :width]
    max_seq_len = min(max_model_len, table.shape[1] * cache.block_size)
    seq_lens, query_start_loc = inputs.seq_lens[:rows], inputs.query_start_loc[: rows + 1]
    sparse = None
    if topk is not None:
        sparse = SparseMetadata(block_table=table, seq_lens=seq_lens,
                                query_start_loc=query_start_loc, max_seq_len=max_seq_len,
                                topk=topk, dense=False)
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
        max_slot=-1,
        max_block=0,
        device=cache.device,
        decode=DecodeMetadata(
            block_table=table,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            max_query_len=1,
            max_seq_len=max_seq_len,
            dcp=dcp,
        ),
        prefill=None,
        sparse=sparse,
    )


class DecodeGraphs:
    """Captured decode steps of `model` over `caches` for each size in `sizes` (and, for
    a sparse-attention model whose indexer keeps `index_topk` positions, each of
    `graph_widths`).

    `run(token_ids [B], positions [B], spec, sample_rows)` replays the smallest graph
    with at least B rows (and as wide as spec's block table at least) and returns the
    logits [len(sample_rows), vocab] float32; spec as this rank's kernels read it
    (`MLAMetadataBuilder.decode_spec`). Under decode context parallelism `dcp` (the
    builder's decode hook) puts the query all-gather and the partials' all-to-all into
    the graphs.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        caches: list[LatentKVCache],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
        dcp: DecodeHook | None = None,
        index_topk: int | None = None,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.dcp = dcp
        self.index_topk = index_topk
        cache = caches[0]
        self.widths = graph_widths(max_blocks_per_seq, cache.block_size, index_topk)
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, cache.num_slots,
                                  cache.num_blocks, cache.device)
        # (rows, width) -> the graph and its static logits
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def release(self) -> None:
        """Free the captured graphs (and with them the collectives they hold)."""
        torch.cuda.synchronize(self.inputs.token_ids.device)
        for graph, _ in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        # Largest first: later graphs reuse its memory.
        for width in reversed(self.widths):
            for rows in reversed(self.sizes):
                meta = graph_metadata(self.caches[0], self.inputs, rows, self.max_model_len,
                                      self.dcp, self.index_topk, width)
                args = (self.inputs.token_ids[:rows], self.inputs.positions[:rows],
                        self.caches, meta)
                # Warm-up outside the graph compiles kernels and builds lazy tables (RoPE).
                self.model.compute_logits(self.model(*args))
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.model.compute_logits(self.model(*args)).float()
                pool = graph.pool()
                self.graphs[rows, width] = (graph, logits)
        torch.cuda.synchronize()

    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spec: BatchSpec,
        sample_rows: list[int],
        device_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Replay a decode step of B <= max_batch single-token requests (host inputs;
        device_token_ids [B], when given, replaces token_ids on the device)."""
        batch = token_ids.shape[0]
        rows = self.sizes[bisect.bisect_left(self.sizes, batch)]
        index = self.inputs.stage(rows, token_ids, positions, spec, sample_rows)
        # stage refused a table wider than the widest graph
        width = self.widths[bisect.bisect_left(self.widths, spec.block_table.shape[1])]
        if device_token_ids is not None:
            self.inputs.token_ids[:batch].copy_(device_token_ids)
        graph, logits = self.graphs[rows, width]
        graph.replay()
        if sample_rows == list(range(len(sample_rows))):
            # Decode steps sample every row: a view of the static logits, no extra launch
            # (the sampler reads them before the next replay, in stream order).
            return logits[: len(sample_rows)]
        return logits.index_select(0, index)
