"""CUDA graphs of the single-token decode rows' attention in steps with prompt tokens.

Such a step replays `PiecewiseGraphs` around attention, and attention runs eagerly,
where one layer's call costs the host several times its GPU time (PyTorch's dispatch
and the kernel launches: ~400 µs of host against ~60 µs of GPU for 128 decodes). The
decode rows' part is graph-safe: its split plan is made on the device and its grids are
bounded by max_model_len. So the step's leading single-token decodes (K rows; the
builder puts decodes first) replay, layer by layer, a graph captured for D >= K rows,
the smallest such D captured, and only the other rows' attention stays eager.

Per layer the graph runs first. It writes the K rows' cache rows and attends for rows
0..D-1 of the pieces' static buffers (q, the latents, the attention output). Padded rows
have slot -1 and seq_len 0: they write no cache row and attend to nothing, and their
output rows, K..D-1, belong to the eager part or to padding. Then the layer's attention
runs eagerly on rows K..T-1 (multi-token decodes that the router sent to MQA, and the
prompts) with metadata for those rows alone, and writes their outputs over those rows.
Decode context parallelism keeps the eager path (its collectives are not captured here).
The mixed steps of `python -m benchmarks.bench_engine --arrivals 256` show the gain.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.engine.cuda_graph import GraphInputs, capture_each, graph_metadata, reset_all
from pagedmla.metadata import MLAMetadata


def decode_row_sizes(max_rows: int) -> list[int]:
    """Decode row counts to capture: the powers of two below max_rows, then max_rows.
    Padding costs little here: a padded row's programs find no work."""
    sizes = [1]
    while 2 * sizes[-1] < max_rows:
        sizes.append(2 * sizes[-1])
    return sizes if max_rows <= 1 else [*sizes, max_rows]


class DecodeRowGraphs:
    """The decode attention of each layer in `layers` (over `caches`), captured on CUDA
    for each row count in `sizes`, reading q [rows, N, P + R], kv_c [rows, L] and k_pe
    [rows, R] and writing out [rows, N * V]: the pieces' static buffers, at least
    sizes[-1] rows each. max_blocks_per_seq and max_model_len bound the block table and
    the lengths, as for `DecodeGraphs`.

    Per step: `stage(meta)` copies the step's leading single-token decode rows into the
    static inputs and returns their count K and the metadata of the other rows (or None
    where the graphs do not apply); then `replay(i)` before layer i's eager attention
    over rows K.. .
    """

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        caches: list[LatentKVCache],
        buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        sizes: list[int],
        max_blocks_per_seq: int,
        max_model_len: int,
    ) -> None:
        self.layers = layers
        self.caches = caches
        self.q, self.kv_c, self.k_pe, self.out = buffers
        self.sizes = sorted(sizes)
        if self.sizes[-1] > self.q.shape[0]:
            raise ValueError(f"sizes: at most {self.q.shape[0]} rows (the buffers'), got "
                             f"{self.sizes[-1]}")
        cache = caches[0]
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, cache.num_slots,
                                  cache.num_blocks, cache.device)
        self.metadata = {rows: graph_metadata(cache, self.inputs, rows, max_model_len)
                         for rows in self.sizes}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._captured: dict[int, MLAMetadata] = {}  # what the graphs read, kept alive
        self.rows = 0  # the size the staged step replays
        if cache.device.type == "cuda":
            self._capture()

    def attend(self, i: int, meta: MLAMetadata, q: torch.Tensor, kv_c: torch.Tensor,
               k_pe: torch.Tensor, out: torch.Tensor) -> None:
        """Layer i's decode attention over the staged rows: q [rows, N, P + R], kv_c
        [rows, L], k_pe [rows, R] -> out [rows, N * V] (meta: this size's)."""
        self.layers[i].self_attn.attn(q, kv_c, k_pe, self.caches[i], meta, out=out)

    def _attend_static(self, i: int, rows: int, meta: MLAMetadata) -> None:
        """`attend` over the first `rows` rows of the static buffers."""
        self.attend(i, meta, self.q[:rows], self.kv_c[:rows], self.k_pe[:rows],
                    self.out[:rows])

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        for rows in reversed(self.sizes):  # largest first: the others reuse its memory
            for i in range(len(self.layers)):  # warm-up: compiles this size's kernels
                self._attend_static(i, rows, self.metadata[rows].for_forward())
            torch.cuda.synchronize()
            # One forward's metadata for all layers: layer 0's graph makes the split plan
            # (from each replay's seq_lens), the others read it; it must outlive them.
            meta = self._captured[rows] = self.metadata[rows].for_forward()
            self.graphs[rows], pool = capture_each(
                len(self.layers),
                lambda i, rows=rows, meta=meta: self._attend_static(i, rows, meta), pool)
        torch.cuda.synchronize()

    def stage(self, meta: MLAMetadata) -> tuple[int, MLAMetadata] | None:
        """Take the step's leading single-token decode rows (K of them; the builder puts
        decodes first) into the static inputs, padded up to the smallest size that
        holds them, and return (K, the metadata of the step's other rows, K..T-1: what
        the eager attention keeps). None, staging nothing, where no leading request
        has a single token, under decode context parallelism, or where K exceeds the
        largest size."""
        decode = meta.decode
        if decode is None or decode.dcp is not None:
            return None
        lens = decode.query_lens
        if lens is None:  # all single-token, or not known which
            count = meta.num_decodes if meta.num_decode_tokens == meta.num_decodes else 0
        else:
            count = next((b for b, n in enumerate(lens) if n != 1), len(lens))
        if count == 0 or count > self.sizes[-1]:
            return None
        cache = self.caches[0]
        if meta.max_slot >= cache.num_slots or meta.max_block >= cache.num_blocks:
            raise ValueError(
                f"meta holds slot {meta.max_slot} and block {meta.max_block}; the caches "
                f"have {cache.num_slots} slots in {cache.num_blocks} blocks"
            )
        width = decode.block_table.shape[1]
        if width > self.inputs.max_blocks:
            raise ValueError(f"block_table has {width} columns, the graphs hold "
                             f"{self.inputs.max_blocks}")
        self.rows = rows = self.sizes[bisect.bisect_left(self.sizes, count)]
        inputs = self.inputs
        inputs.slot_mapping[:count].copy_(meta.slot_mapping[:count])
        inputs.slot_mapping[count:rows].fill_(-1)
        inputs.seq_lens[:count].copy_(decode.seq_lens[:count])
        inputs.seq_lens[count:rows].zero_()
        # Entries past a row's length, and the padded rows', are never read.
        inputs.block_table[:count, :width].copy_(decode.block_table[:count])
        rest = None
        if count < meta.num_decodes:  # multi-token decode rows (extends routed to MQA)
            rest = replace(
                decode,
                block_table=decode.block_table[count:],
                seq_lens=decode.seq_lens[count:],
                query_start_loc=decode.query_start_loc[count:] - count,
                query_lens=lens[count:] if lens is not None else None,
            )
        return count, replace(
            meta,
            num_tokens=meta.num_tokens - count,
            num_decodes=meta.num_decodes - count,
            num_decode_tokens=meta.num_decode_tokens - count,
            slot_mapping=meta.slot_mapping[count:],
            decode=rest,
        )

    def replay(self, i: int) -> None:
        """Layer i's decode attention over the staged rows."""
        if self.graphs:
            self.graphs[self.rows][i].replay()
        else:  # CPU: the same buffers and padding, called
            self._attend_static(i, self.rows, self.metadata[self.rows])

    def release(self) -> None:
        """Free the captured graphs."""
        reset_all(self.graphs)
