"""CUDA graphs for steps that are not plain decodes.

A step with prompts in it (alone, or mixed with decodes) cannot in general be captured
whole: its attention metadata (which requests take which path, context chunks) changes
from step to step. The rest of a layer depends only on the number of tokens T. So the
model runs in pieces split at attention: piece 0 embeds the tokens and projects layer 0
(q, the normalised latent, k_pe); piece i (1..n-1) finishes layer i-1 (o_proj, the
residual add with the norm, the MLP or experts) and projects layer i; piece n finishes
the last layer and applies the final norm. Each piece is captured once per token bucket
(`token_buckets`: T padded by at most a quarter above 128 tokens), and attention runs
eagerly between the replays on the step's real rows. A step of 27 layers then launches
28 graphs and the attention kernels instead of ~470 kernels, one at a time from Python.
The single-token decode rows' attention replays graphs of its own, per layer
(`engine/decode_rows.py`).

A step whose other rows are all prompts without cached context (`engine/prompt_rows.py`)
is graph-safe whole: it replays one graph captured for its bucket and decode-row size
(`capture_steps`) instead of up to three per layer, each launch of which costs the GPU
15-25 µs (`python -m benchmarks.bench_engine --layers 27 --arrivals 256` times such
steps; docs/PERFORMANCE.md).

Tensors crossing a piece boundary live in static buffers shared by every layer and
bucket (views of the largest bucket's): each piece copies its outputs there, so the
graph's own temporaries are dead when its capture ends and every capture reuses one
memory pool. A whole step's graph hands its tensors from layer to layer instead and
skips those copies, four per layer. Padded rows hold what an earlier step left there
(valid token ids and positions, stale attention outputs; zeros at first): every op of
the pieces works row by row, so they never reach a real row.

Steps above the largest bucket run eagerly: with that many tokens the device, not the
host, is the bottleneck. On the CPU (no graphs) `run` calls the pieces instead of
replaying them, which exercises the same buffers and padding.
"""

from __future__ import annotations

import bisect

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.engine.cuda_graph import capture_each, reset_all
from pagedmla.engine.decode_rows import DecodeRowGraphs
from pagedmla.engine.prompt_rows import PromptRows
from pagedmla.metadata import MLAMetadata

MAX_TOKENS = 2048  # largest bucket: above it a step is device-bound anyway
MIN_TOKENS = 16
# From here on buckets are a quarter of an octave apart: a step this large is bound by
# its matmuls, where padding adds work (tuned by `python -m benchmarks.bench_engine
# --layers 27 --arrivals 256`: 128 decodes and a 256-token prompt run ~3% faster on a
# 384-row bucket than on a 512-row one).
FINE_TOKENS = 128


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then four per octave (160, 192, 224, 256, 320, ..), up to the
    first bucket >= max_tokens (at most MAX_TOKENS)."""
    top = min(max_tokens, MAX_TOKENS)
    sizes = [MIN_TOKENS]
    while sizes[-1] < top:
        last = sizes[-1]
        octave = 1 << (last.bit_length() - 1)  # the power of two at or below last
        sizes.append(2 * last if last < FINE_TOKENS else last + octave // 4)
    return sizes


class PiecewiseGraphs:
    """The pieces of `model` (the engine's model: `decoder` owns the layers,
    `compute_logits` the head) over `caches`, captured for each T in `buckets` on CUDA.

    `run(token_ids [T], positions [T], meta, sample_rows)` runs a step of T <=
    max_tokens tokens and returns the logits [len(sample_rows), vocab] float32.
    """

    def __init__(
        self, model: torch.nn.Module, caches: list[LatentKVCache], buckets: list[int]
    ) -> None:
        self.model = model
        self.decoder = model.decoder
        self.caches = caches
        self.buckets = sorted(buckets)
        rows = self.buckets[-1]
        dec = self.decoder
        d = dec.layers[0].self_attn.dims  # this rank's heads
        H = dec.config.hidden_size
        weight = dec.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            # Zeros, not garbage: capture warm-ups read these before any step wrote them.
            return torch.zeros(*shape, dtype=dtype, device=device)

        # Token ids and positions, and their pinned host twin: one copy per step.
        self._inputs = zeros(2, rows, dtype=torch.int64)
        self.input_ids, self.positions = self._inputs
        self._host_inputs = torch.zeros(2, rows, dtype=torch.int64,
                                        pin_memory=device.type == "cuda")
        # Recorded after each copy: the host twin is rewritten only once it was read.
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        self.q = zeros(rows, d.num_heads, d.qk_head_dim)
        self.kv_c = zeros(rows, d.kv_lora_rank)
        self.k_pe = zeros(rows, d.qk_rope_head_dim)
        self.residual = zeros(rows, H)
        self.attn_out = zeros(rows, d.num_heads * d.v_head_dim)
        self.hidden = zeros(rows, H)
        self.cos = self.sin = None
        if dec.rotary is not None:
            cos, sin = dec.rotary(self.positions[:1])
            self.cos = zeros(rows, cos.shape[-1], dtype=cos.dtype)
            self.sin = zeros(rows, sin.shape[-1], dtype=sin.dtype)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        # Graphs of the decode rows' attention (`capture_decode_rows`; None: all eager).
        self.decode_rows: DecodeRowGraphs | None = None
        # The prompts' attention in whole-step graphs (`capture_steps`; None: eager).
        self.prompt_rows: PromptRows | None = None
        # Whole-step graphs of steps with prompts that `prompt_rows` takes, by (bucket,
        # decode rows' size) (`capture_steps`; None: off; empty on the CPU, where their
        # body is called instead).
        self.steps: dict[tuple[int, int], torch.cuda.CUDAGraph] | None = None
        self._step_metadata: dict[tuple[int, int], MLAMetadata] = {}  # what they read
        self._pool: tuple | None = None  # the captures' memory pool
        if device.type == "cuda":
            self._capture()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def capture_decode_rows(self, sizes: list[int], max_blocks_per_seq: int,
                            max_model_len: int) -> None:
        """Let the single-token decode rows' attention replay graphs captured for each
        row count in `sizes` (at most max_tokens), over these pieces' static buffers
        (`DecodeRowGraphs`)."""
        self.decode_rows = DecodeRowGraphs(
            self.decoder.layers, self.caches, (self.q, self.kv_c, self.k_pe, self.attn_out),
            sizes, max_blocks_per_seq, max_model_len,
        )

    def capture_steps(self) -> None:
        """Let steps whose rows after the decode rows' graphs (or from the first row)
        are all prompts without context (`PromptRows`) replay one graph of the whole
        step, captured for each bucket and each decode-row size that fits it (0: no
        decode rows), instead of up to three graphs per layer."""
        self.prompt_rows = PromptRows(self.decoder.layers, self.caches, self.buckets)
        self.steps = {}
        if self.device.type != "cuda":
            return
        sizes = [0] + ([] if self.decode_rows is None else self.decode_rows.sizes)
        pool = self._pool
        with torch.inference_mode():
            for rows in reversed(self.buckets):  # largest first: the others reuse its memory
                self.prompt_rows.stage_nothing(rows)
                self._step(rows, 0, None)  # compiles this bucket's kernels
                torch.cuda.synchronize()
                fitting = [size for size in reversed(sizes) if size <= rows]
                metas = [self._decode_metadata(size) for size in fitting]
                graphs, pool = capture_each(
                    len(fitting),
                    lambda j, rows=rows, fitting=fitting, metas=metas: self._step(
                        rows, fitting[j], metas[j]),
                    pool)
                for size, meta, graph in zip(fitting, metas, graphs, strict=True):
                    self.steps[rows, size] = graph
                    self._step_metadata[rows, size] = meta
        self._pool = pool
        torch.cuda.synchronize()

    def _decode_metadata(self, size: int) -> MLAMetadata | None:
        """One forward's metadata for `size` decode rows, whose layer 0 makes the split
        plan that the other layers read (None for no decode rows)."""
        return self.decode_rows.metadata[size].for_forward() if size else None

    def _step(self, rows: int, size: int, decode_meta: MLAMetadata | None) -> None:
        """A whole step over `rows` rows whose first `size` rows' attention is the decode
        rows' (decode_meta: `_decode_metadata(size)`) and the others' the prompts': what
        `run` does layer by layer with their graphs. Within one graph the layers hand
        their tensors on directly; only the inputs, the attention output and the final
        hidden state are the static buffers."""
        dec = self.decoder
        hidden, cos, sin = dec.embed(self.input_ids[:rows], self.positions[:rows])
        residual = None
        out = self.attn_out[:rows]
        for i, layer in enumerate(dec.layers):
            q, kv_c, k_pe, residual = layer.before_attention(hidden, residual, cos, sin)
            if size:
                self.decode_rows.attend(i, decode_meta, q[:size], kv_c[:size], k_pe[:size],
                                        out[:size])
            self.prompt_rows.attend(i, q, kv_c, k_pe, out)
            hidden, residual = layer.after_attention(out, residual)
        self.hidden[:rows].copy_(dec.final_norm(hidden, residual))

    def _piece(self, i: int, rows: int) -> None:
        """Piece i over the first `rows` rows of the static buffers."""
        dec = self.decoder
        cos = None if self.cos is None else self.cos[:rows]
        sin = None if self.sin is None else self.sin[:rows]
        residual: torch.Tensor | None
        if i == 0:
            hidden, cos_new, sin_new = dec.embed(self.input_ids[:rows], self.positions[:rows])
            if cos is not None:
                cos.copy_(cos_new)
                sin.copy_(sin_new)
            residual = None
        else:
            hidden, residual = dec.layers[i - 1].after_attention(
                self.attn_out[:rows], self.residual[:rows]
            )
        if i == len(dec.layers):
            self.hidden[:rows].copy_(dec.final_norm(hidden, residual))
            return
        q, kv_c, k_pe, residual = dec.layers[i].before_attention(hidden, residual, cos, sin)
        self.q[:rows].copy_(q)
        self.kv_c[:rows].copy_(kv_c)
        self.k_pe[:rows].copy_(k_pe)
        self.residual[:rows].copy_(residual)

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        pieces = range(len(self.decoder.layers) + 1)
        for rows in reversed(self.buckets):  # largest first: the others reuse its memory
            for i in pieces:  # warm-up outside the graphs: compiles kernels for this T
                self._piece(i, rows)
            torch.cuda.synchronize()
            self.graphs[rows], pool = capture_each(
                len(pieces), lambda i, rows=rows: self._piece(i, rows), pool)
        self._pool = pool
        torch.cuda.synchronize()

    def _replay(self, i: int, rows: int) -> None:
        if self.graphs:
            self.graphs[rows][i].replay()
        else:
            self._piece(i, rows)

    def release(self) -> None:
        """Free the captured graphs (and with them the collectives they hold)."""
        torch.cuda.synchronize(self.device)
        reset_all(self.graphs)
        if self.steps is not None:
            for graph in self.steps.values():
                graph.reset()
            self.steps.clear()
            self._step_metadata.clear()
        if self.decode_rows is not None:
            self.decode_rows.release()

    @torch.inference_mode()
    def run(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: MLAMetadata,
        sample_rows: list[int],
        device_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A step of T <= max_tokens tokens: host token_ids [T] and positions [T] int64,
        the step's metadata; returns the logits of sample_rows [S, vocab] float32.
        device_token_ids [T] int64 on the device, when given, is fed instead of
        token_ids."""
        num_tokens = token_ids.shape[0]
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the largest bucket ({self.max_tokens})")
        rows = self.buckets[bisect.bisect_left(self.buckets, num_tokens)]
        if self._copied is not None:
            self._copied.synchronize()
        self._host_inputs[0, :num_tokens] = token_ids
        self._host_inputs[1, :num_tokens] = positions
        # The whole twin (at most 32 KB): a contiguous source keeps the copy asynchronous.
        self._inputs.copy_(self._host_inputs, non_blocking=True)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.device))
        if device_token_ids is not None:
            self.input_ids[:num_tokens].copy_(device_token_ids)
        layers = self.decoder.layers
        real = slice(0, num_tokens)
        meta = meta.for_forward()
        staged = None if self.decode_rows is None else self.decode_rows.stage(meta)
        if staged is not None:  # rows 0..K-1 replay graphs, the rest runs eagerly
            first, meta = staged
            real = slice(first, num_tokens)
        # ... unless the rest are prompts without context: then the step is one graph.
        prompts = self.prompt_rows is not None and self.prompt_rows.stage(meta, real.start,
                                                                          rows)
        if prompts:
            size = 0 if staged is None else self.decode_rows.rows
            if self.steps:
                self.steps[rows, size].replay()
            else:  # CPU: the same body, called
                self._step(rows, size, self._decode_metadata(size))
            return self._logits(sample_rows)
        self._replay(0, rows)
        for i, (layer, cache) in enumerate(zip(layers, self.caches, strict=True)):
            if staged is not None:
                self.decode_rows.replay(i)
            if real.start < real.stop:
                layer.self_attn.attn(self.q[real], self.kv_c[real], self.k_pe[real], cache,
                                     meta, out=self.attn_out[real])
            self._replay(i + 1, rows)
        return self._logits(sample_rows)

    def _logits(self, sample_rows: list[int]) -> torch.Tensor:
        """The logits [len(sample_rows), vocab] float32 of those rows of the last step."""
        index = torch.tensor(sample_rows, dtype=torch.int64).to(self.device, non_blocking=True)
        return self.model.compute_logits(self.hidden.index_select(0, index)).float()
