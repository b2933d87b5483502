"""The prompts' attention in whole-step CUDA graphs of steps with prompt tokens.

Once `decode_rows` has taken a step's single-token decodes, its eager attention is left
with the prompts, where one layer's call costs the host ~15x its GPU time (~320 µs of
host against ~20 µs of GPU for a 256-token prompt). A prompt without cached context is
graph-safe: MHA over its new tokens depends only on the step's token count and on how
the tokens are cut into sequences, which the prefill kernels read from the device
(their query blocks are packed, `ops/triton/prefill_triton.py`). So a step whose other rows
are all such prompts (at most `max_prompts` of them) replays one graph of the whole
step, captured for its token bucket and decode-row size
(`PiecewiseGraphs.capture_steps`), in which this attention runs for every layer.

It attends over all `rows` rows of the step's tensors, cut into max_prompts + 2
sequences: the rows before the prompts (the decode rows, which their own attention
covers) as one, each prompt, empty ones up to max_prompts, and the padding rows as the
last. Only the prompts' rows write the cache (the others' slots are -1) and reach the
attention output: every row is attended into a scratch tensor, and the prompts' rows are
copied from it. The other rows cost causal attention among themselves, a block or two,
where an eager call would cost the host ~10x more.
"""

from __future__ import annotations

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import MLAMetadata, PrefillMetadata

MAX_PROMPTS = 8  # prompts a graphed step may hold; each adds a query block to the grid


class PromptRows:
    """The attention of each layer in `layers` (over `caches`) for steps whose rows from
    some row on are prompts without context, in buckets of `buckets` rows.

    Per step: `stage(meta, first, rows)` takes a step whose rows first.. are described
    by meta and padded up to the bucket `rows`, and says whether it staged them; then
    `attend(i, q, kv_c, k_pe, out)` runs layer i's attention over them (in a graph of
    the step). `stage_nothing(rows)` stages a step that keeps and writes nothing, as a
    warm-up or capture runs.
    """

    def __init__(
        self,
        layers: torch.nn.ModuleList,
        caches: list[LatentKVCache],
        buckets: list[int],
        max_prompts: int = MAX_PROMPTS,
    ) -> None:
        self.layers = layers
        self.caches = caches
        self.buckets = sorted(buckets)
        self.max_prompts = max_prompts
        rows = self.buckets[-1]
        device = caches[0].device
        # Sequence bounds: the rows before the prompts, the prompts, the empty ones and
        # the padding; staged per step.
        num_seqs = max_prompts + 2
        self.cu_seqlens = torch.zeros(num_seqs + 1, dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self._row_index = torch.arange(rows, device=device).unsqueeze(1)
        self.keep = torch.zeros(rows, 1, dtype=torch.bool, device=device)  # prompt rows
        self._block_table = torch.zeros(num_seqs, 1, dtype=torch.int32, device=device)
        self.metadata = {rows: self._metadata(rows) for rows in self.buckets}

    def _metadata(self, rows: int) -> MLAMetadata:
        """What a graph of `rows` rows reads: its sequences' bounds from cu_seqlens (the
        host lengths here are the capture's: every row in the last sequence)."""
        cache = self.caches[0]
        num_seqs = self.cu_seqlens.shape[0] - 1
        lens = [0] * (num_seqs - 1) + [rows]
        return MLAMetadata(
            num_tokens=rows,
            num_decodes=0,
            num_decode_tokens=0,
            num_prefills=num_seqs,
            num_prefill_tokens=rows,
            block_size=cache.block_size,
            kv_lora_rank=cache.kv_lora_rank,
            rope_dim=cache.rope_dim,
            slot_mapping=self.slot_mapping[:rows],
            max_slot=-1,  # stage checks the slots it copies
            max_block=0,
            device=cache.device,
            decode=None,
            prefill=PrefillMetadata(
                block_table=self._block_table,
                query_start_loc=self.cu_seqlens,
                query_lens=lens,
                seq_lens=lens,
                max_query_len=rows,
                context=None,
            ),
        )

    def attend(self, i: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               out: torch.Tensor) -> None:
        """Layer i's attention over the staged prompts of a step in a bucket of rows:
        q [rows, N, P + R], kv_c [rows, L], k_pe [rows, R]; writes the prompts' rows of
        out [rows, N * V] and leaves its other rows."""
        attended = torch.empty_like(out)
        self.layers[i].self_attn.attn(q, kv_c, k_pe, self.caches[i],
                                      self.metadata[q.shape[0]], out=attended)
        torch.where(self.keep[: q.shape[0]], attended, out, out=out)

    def stage_nothing(self, rows: int) -> None:
        """Stage a step of `rows` rows in one sequence that writes and keeps nothing."""
        self.cu_seqlens.zero_()
        self.cu_seqlens[-1] = rows
        self.slot_mapping.fill_(-1)
        self.keep.zero_()

    def stage(self, meta: MLAMetadata, first: int, rows: int) -> bool:
        """Stage a step whose rows first..first + meta.num_tokens - 1 are described by
        meta (its other rows, before them, attend elsewhere), padded up to the bucket
        `rows`: where those rows are all prompts without context, at most max_prompts
        of them, their sequences, slots and rows to keep go into the static buffers and
        True is returned; else nothing is staged."""
        prefill = meta.prefill
        if (meta.decode is not None or prefill is None or prefill.context is not None
                or meta.num_prefills > self.max_prompts):
            return False
        cache = self.caches[0]
        if meta.max_slot >= cache.num_slots:
            raise ValueError(f"meta holds slot {meta.max_slot}; the caches have "
                             f"{cache.num_slots} slots")
        end = first + meta.num_tokens
        if end > rows:
            raise ValueError(f"rows {first}..{end - 1} do not fit a bucket of {rows}")
        count = meta.num_prefills
        cu = self.cu_seqlens
        torch.add(prefill.query_start_loc, first, out=cu[1 : count + 2])
        cu[count + 2 : -1].fill_(end)
        cu[-1:].fill_(rows)
        self.slot_mapping.fill_(-1)
        self.slot_mapping[first:end].copy_(meta.slot_mapping)
        torch.logical_and(self._row_index >= first, self._row_index < end, out=self.keep)
        return True
