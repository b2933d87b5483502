"""`LLM`: the offline engine. Prompts in, completions out, over a paged latent cache."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence as SequenceABC
from typing import Any

import torch
from tqdm.auto import tqdm

from pagedmla.cache import (
    DS_MLA_DTYPE,
    FP8_DTYPE,
    LatentKVCache,
    describe_cache_format,
    resolve_cache_dtype,
)
from pagedmla.engine.args import EngineArgs
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.cuda_graph import DecodeGraphs, capture_sizes
from pagedmla.engine.decode_rows import decode_row_sizes
from pagedmla.engine.inputs import (
    checked_params,
    checked_token_ids,
    engine_args,
    engine_device,
    prompt_list,
)
from pagedmla.engine.kv_scales import calibrate, set_kv_cache_scales
from pagedmla.engine.memory import (
    MemoryReport,
    attach_index_keys,
    cache_block_bytes,
    check_fits,
    index_key_block_bytes,
    workspace_bytes,
)
from pagedmla.engine.model_runner import DriverRunner, ModelRunner
from pagedmla.engine.outputs import EngineStats, RequestOutput, StreamOutput
from pagedmla.engine.piecewise import PiecewiseGraphs, token_buckets
from pagedmla.engine.requests import Request, RequestTracker
from pagedmla.engine.sampler import TokenHistory, draw
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence
from pagedmla.engine.startup import CompileLog, StartupReport, use_compile_cache
from pagedmla.engine.step_loop import LaunchedStep, StepLoop
from pagedmla.engine.warmup import compiled_step_cases, run_cases, warmup_cases
from pagedmla.metadata import MLAMetadataBuilder
from pagedmla.models.loader import load_config, load_planned, plan_model
from pagedmla.ops.batch_invariant import ROW_TILE
from pagedmla.ops.registry import get_backend
from pagedmla.routing import PathCostModel

logger = logging.getLogger(__name__)

# Without a GPU memory budget to fill, the CPU cache holds this many tokens by default.
_CPU_CACHE_TOKENS = 64 * 1024


class LLM:
    """Serve an MLA model: the built-in "tiny" one or a Hugging Face checkpoint directory.

    Its arguments are `EngineArgs`' fields (documented there), given as keywords or as
    one EngineArgs.

    The KV cache holds `num_kv_blocks` blocks of `block_size` tokens per layer; when
    None it is sized from `gpu_memory_utilization` of the GPU's memory after the model
    and the chunked-prefill workspace are accounted for (on the CPU: 64Ki tokens).
    The weights are planned before anything is allocated (`models.loader.plan_model`):
    on CUDA, weights, workspace and the smallest cache (2 blocks, or num_kv_blocks)
    that need more than gpu_memory_utilization of the free memory are a ValueError
    saying how much is missing. `memory` (a `MemoryReport`) holds this rank's weights'
    and cache's bytes, the cache's capacity in tokens, the load time and the checkpoint
    bytes read; `memory_per_rank` every rank's, which the driver logs (logger
    `pagedmla.engine.llm`, level INFO).

    tensor_parallel_size > 1 shards the model over that many ranks (one per GPU, or
    CPU processes with gloo): started here as worker processes, or under torchrun,
    where every rank constructs the LLM with the same arguments and calls generate()
    alike (rank 0 schedules and samples; every rank returns the outputs).
    decode_context_parallel_size (dividing it) spreads each sequence's cached latents
    over that many ranks, dealt round-robin in runs of cp_kv_cache_interleave_size
    tokens: a block then holds block_size tokens per rank. prefill_context_parallel_size
    P runs P replicas of that group (P * tp ranks), which split each step's prompt
    tokens and write every token to all replicas' caches (`distributed/pcp.py`).
    close() (or a `with` block) stops the workers; they also stop when this process exits.

    With graph-safe kernels (Triton) on CUDA, decode-only steps replay CUDA graphs
    captured at start-up for a ladder of batch sizes, and other steps of up to 2048
    tokens replay graphs of everything but attention (`PiecewiseGraphs`; docs/design.md
    says which steps replay which graphs); enforce_eager turns all of them off.
    route_by_cost sends short prefill chunks to the absorbed MQA path when the cost
    model (`pagedmla.routing.PathCostModel`) predicts it to be cheaper than MHA.
    async_scheduling plans and enqueues each step while the device still runs the one
    before (`Scheduler.schedule_ahead`): decodes, prefill chunks and newly admitted
    prompts alike. The tokens that step samples are read on the device (under tensor
    parallelism rank 0 broadcasts them to the other ranks), so the host's scheduling,
    input preparation and bookkeeping overlap the device instead of adding to every
    step. A step that would preempt is scheduled after the one before it completes.
    """

    def __init__(self, model: str | EngineArgs = "tiny", **kwargs: Any) -> None:
        """LLM(EngineArgs(...)), or LLM(model, **kwargs) with EngineArgs' fields as
        keywords; an unknown keyword is a TypeError naming it, and every argument is
        checked (`EngineArgs.validate`) before anything is built."""
        args = engine_args(model, kwargs)
        self.args = args
        self.startup = StartupReport(compile_cache_dir=use_compile_cache(args.compile_cache_dir))
        with CompileLog() as built:
            self._build(args)
            if self.parallel is not None:
                self.parallel.ready()
            if self._warms_up():
                with self.startup.phase("warmup"):
                    self.warm_up()
        if built.supported:
            self.startup.kernels_built = sum(built.kernels.values())
        if self.parallel is None or self.parallel.is_driver:
            logger.info("%s", self.startup)

    def _build(self, args: EngineArgs) -> None:
        """Load the model, allocate the cache, build the scheduler and the runner, and
        capture the CUDA graphs."""
        device = engine_device(args.device)
        dtype = args.dtype
        if dtype is None:
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.parallel = None
        refused = [what for what, on in (
            ("batch_invariant=True", args.batch_invariant),
            ("decode_context_parallel_size > 1", args.decode_context_parallel_size > 1),
            ("prefill_context_parallel_size > 1", args.prefill_context_parallel_size > 1),
        ) if on]
        if refused and load_config(args.model).indexer:
            raise ValueError(
                f"{refused[0]} is not supported for sparse-attention models (DeepSeek-V3.2, "
                "GLM-5): their indexer keys are neither spread over nor gathered from "
                "context parallel ranks, and their top-k selection is not batch invariant"
            )
        if args.tensor_parallel_size * args.prefill_context_parallel_size > 1:
            from pagedmla.distributed.runtime import ParallelRuntime

            self.parallel = ParallelRuntime.start(
                device, functools.partial(_serve_driver, args), model=args.model,
                block_size=args.block_size, tensor_parallel_size=args.tensor_parallel_size,
                decode_context_parallel_size=args.decode_context_parallel_size,
                prefill_context_parallel_size=args.prefill_context_parallel_size,
                interleave=args.cp_kv_cache_interleave_size,
            )
            device = self.parallel.device
        torch.manual_seed(args.seed)
        self.device = device
        self.dtype = dtype
        start = time.perf_counter()
        # The plan knows the rank's weights before any is allocated (nothing is yet).
        # Every op of a batch-invariant engine comes from the "+invariant" backends.
        backend = args.backend + ("+invariant" if args.batch_invariant else "")
        plan = plan_model(args.model, dtype, backend,
                          None if self.parallel is None else self.parallel.sharder(),
                          keep_fp8=not args.dequantize_weights)
        self.config, self.tokenizer = plan.config, plan.tokenizer
        dims = plan.module.dims
        positions = self.config.max_position_embeddings
        if args.max_model_len is not None and args.max_model_len > positions:
            raise ValueError(
                f"max_model_len {args.max_model_len} exceeds the model's "
                f"max_position_embeddings {positions}"
            )
        self.max_model_len = args.max_model_len or positions
        block_size = args.block_size
        index = self.config.indexer
        sizes = dict(workspace_rows=args.workspace_rows, max_model_len=self.max_model_len,
                     max_num_seqs=args.max_num_seqs,
                     router=PathCostModel() if args.route_by_cost else None)
        if index is not None:  # (decode context parallel builders never see one)
            sizes["index_topk"] = index.topk
        if (device.type == "cuda" and get_backend(backend, device).graph_safe
                and args.decode_context_parallel_size == 1):
            sizes["decode_bound"] = self.max_model_len
        self.builder = (
            MLAMetadataBuilder(dims, block_size=block_size, device=device, **sizes)
            if self.parallel is None
            else self.parallel.metadata_builder(dims, block_size, **sizes)
        )
        cache_dtype = resolve_cache_dtype(args.kv_cache_dtype, dtype, dims.kv_lora_rank,
                                          dims.qk_rope_head_dim)
        # A sparse model's indexer keys are fp8 where the latents are (fp8, fp8_ds_mla).
        index_fp8 = cache_dtype in (FP8_DTYPE, DS_MLA_DTYPE)
        block_bytes = (
            cache_block_bytes(dims, block_size, cache_dtype, self.config.num_hidden_layers)
            + index_key_block_bytes(self.config, block_size, dtype, index_fp8)
        )
        workspace = workspace_bytes(dims, self.builder.workspace_rows, dtype)
        if device.type == "cuda":
            blocks = args.num_kv_blocks or 2  # the fewest _auto_num_blocks accepts
            check_fits(device, *torch.cuda.mem_get_info(device), args.gpu_memory_utilization,
                       plan.weight_bytes, workspace, blocks * block_bytes, blocks)
        self.model = load_planned(plan, device)
        if args.compile:
            self.model.decoder.enable_compile()
        load_seconds = time.perf_counter() - start
        self.startup.phases["load"] = load_seconds
        with self.startup.phase("kv_cache"):
            num_kv_blocks = args.num_kv_blocks
            if num_kv_blocks is None:
                num_kv_blocks = self._auto_num_blocks(block_size, block_bytes, workspace,
                                                      args.gpu_memory_utilization)
            if self.parallel is not None:
                num_kv_blocks = self.parallel.agree_num_blocks(num_kv_blocks)
            self.caches = [
                LatentKVCache(num_kv_blocks, block_size, dims.kv_lora_rank,
                              dims.qk_rope_head_dim, kv_cache_dtype=args.kv_cache_dtype,
                              dtype=dtype, device=device)
                for _ in range(self.config.num_hidden_layers)
            ]
            attach_index_keys(self.caches, self.config, dtype, index_fp8)
        # Under decode context parallelism a block id stands for block_size rows on each
        # rank of the group: the scheduler sees the group's combined capacity.
        self.block_manager = BlockManager(
            num_kv_blocks, block_size * args.decode_context_parallel_size,
            args.enable_prefix_caching,
        )
        read = 0 if plan.checkpoint is None else plan.checkpoint.bytes_read
        cache_format = describe_cache_format(cache_dtype, dims.kv_lora_rank,
                                             dims.qk_rope_head_dim)
        if index is not None:
            keys = index_key_block_bytes(self.config, 1, dtype, index_fp8)
            cache_format += f"; indexer keys {keys} bytes per token, all layers"
        self._report_memory(plan.weight_bytes, num_kv_blocks * block_bytes, load_seconds, read,
                            cache_format)
        eos = self.config.eos_token_id
        self.scheduler = Scheduler(
            self.block_manager, args.max_num_seqs, args.max_num_batched_tokens,
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            uses_mqa=self.builder.uses_mqa,
        )
        parts = (self.model, self.caches, self.block_manager, self.builder)
        self.runner = (
            DriverRunner(self.parallel, *parts)
            if self.parallel is not None and self.parallel.is_driver
            else ModelRunner(*parts)
        )
        if self.parallel is not None:
            self.runner.pcp = self.parallel.prefill_context_parallel(self.builder)
        if any(cache.is_fp8 for cache in self.caches):
            with self.startup.phase("kv_scales"):
                ranks = None if self.parallel is None else self.parallel.state
                logger.info("%s", set_kv_cache_scales(
                    self.caches, args.kv_cache_scale, plan.checkpoint,
                    lambda: calibrate(self.runner, self.caches, self.block_manager,
                                      self.config.vocab_size,
                                      min(self.max_model_len, args.max_num_batched_tokens),
                                      ranks)))
        self.runner.batch_invariant = args.batch_invariant
        if self._use_graphs(args.enforce_eager, backend):
            with self.startup.phase("graphs"):
                self._capture_graphs(args.max_num_seqs, args.max_num_batched_tokens,
                                     block_size)
        self.async_scheduling = args.async_scheduling
        self.generator = torch.Generator(device=device).manual_seed(args.seed)
        self._last_done = 0.0  # when the last step completed (perf_counter)
        self._next_id = 0
        self._lock = threading.Lock()  # one generate() at a time
        self.stats = EngineStats()

    def _report_memory(self, weight_bytes: int, cache_bytes: int, load_seconds: float,
                       bytes_read: int, cache_format: str) -> None:
        """Set `memory` (this rank's MemoryReport) and `memory_per_rank` (every rank's,
        gathered over the host group), and log the ranks' reports on the driver."""
        manager = self.block_manager
        rank = 0 if self.parallel is None else self.parallel.state.rank
        self.memory = MemoryReport(rank, weight_bytes, cache_bytes,
                                   manager.num_usable_blocks * manager.block_size, load_seconds,
                                   bytes_read, cache_format)
        self.memory_per_rank = (
            [self.memory] if self.parallel is None
            else self.parallel.state.gather_objects(self.memory)
        )
        if rank == 0:
            for report in self.memory_per_rank:
                logger.info("%s", report)

    def warm_up(self, show_progress: bool = True) -> None:
        """Run `warmup_cases` for this engine (`engine/warmup.py`), then start over as new:
        an empty prefix cache, request ids from 0, fresh statistics and the sampling
        generator (and torch's) at its seed. Under torchrun every rank calls this (the
        others serve the driver's steps); spawned workers run the driver's steps."""
        manager = self.block_manager
        cases = compiled_step_cases(self.max_model_len)
        if self.device.type == "cuda":
            cases = warmup_cases(self.max_model_len, self.args.max_num_seqs,
                                 self.args.max_num_batched_tokens,
                                 self.args.enable_prefix_caching,
                                 manager.num_usable_blocks * manager.block_size)
        run_cases(self.generate, cases, self.config.vocab_size, show_progress)
        manager.reset()
        self.scheduler.num_preemptions = 0
        self.generator.manual_seed(self.args.seed)
        torch.manual_seed(self.args.seed)
        self._next_id = 0
        self.stats = EngineStats()

    def _warms_up(self) -> bool:
        """Kernels compile on first use only on CUDA; compiled steps everywhere."""
        return self.args.warmup and (self.device.type == "cuda" or self.args.compile)

    def _use_graphs(self, enforce_eager: bool, backend: str) -> bool:
        """Decode steps replay CUDA graphs when the kernels allow capture.

        Under tensor / decode context parallelism every rank captures the same batch
        sizes in the same order, with the collectives inside the graphs (all-reduces,
        the logits' all-gather, DCP's query all-gather and partials' all-to-all), stages
        its own slots and cache lengths, and replays the size the driver's step picks.
        """
        return (
            not enforce_eager
            and self.device.type == "cuda"
            and get_backend(backend, self.device).graph_safe
        )

    def _capture_graphs(self, max_num_seqs: int, max_num_batched_tokens: int,
                        block_size: int) -> None:
        """Capture the runner's CUDA graphs: whole decode steps by batch size, and the
        pieces of other steps by token bucket, with the graphs of their decode rows'
        and prompts' attention where decode context parallelism is off. A
        sparse-attention model captures whole decode steps only (also by block-table
        width, `cuda_graph.graph_widths`); its other steps run eagerly."""
        max_blocks = -(-self.max_model_len // block_size)
        invariant = self.args.batch_invariant  # its forwards are all of ROW_TILE tokens
        indexer = self.config.indexer
        self.runner.graphs = DecodeGraphs(
            self.model, self.caches, [ROW_TILE] if invariant else capture_sizes(max_num_seqs),
            max_blocks_per_seq=max_blocks, max_model_len=self.max_model_len,
            dcp=self.builder.decode_hook, index_topk=None if indexer is None else indexer.topk,
        )
        # Not methods of self: the runtime's finalizer must not keep the LLM alive.
        if self.parallel is not None:
            self.parallel.before_close(self.runner.graphs.release)
        if self.args.compile or invariant or indexer is not None:  # no pieces
            return
        pieces = PiecewiseGraphs(self.model, self.caches,
                                 token_buckets(max_num_batched_tokens))
        if self.builder.decode_hook is None:
            pieces.capture_decode_rows(
                decode_row_sizes(min(max_num_seqs, pieces.max_tokens)), max_blocks,
                self.max_model_len)
            pieces.capture_steps()
        self.runner.pieces = pieces
        if self.parallel is not None:
            self.parallel.before_close(pieces.release)

    def close(self) -> None:
        """Stop the tensor parallel workers and leave the process group (no-op otherwise)."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _auto_num_blocks(
        self, block_size: int, block_bytes: int, workspace: int, utilization: float
    ) -> int:
        """Cache blocks of `block_bytes` that fill gpu_memory_utilization of the GPU's
        memory beside what is allocated and the `workspace` (on the CPU: 64Ki tokens)."""
        if self.device.type != "cuda":
            return max(2, _CPU_CACHE_TOKENS // block_size + 1)
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - (1.0 - utilization) * total - workspace
        blocks = int(budget // block_bytes)
        if blocks < 2:
            raise ValueError(
                f"no room for a KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB, "
                f"gpu_memory_utilization {utilization}, workspace {workspace / 2**30:.2f} GiB"
            )
        return blocks

    def generate(
        self,
        prompts: str | SequenceABC[str] | SequenceABC[SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in prompt order.

        prompts: one str, or a list of prompts, each a str or a list of token ids (a
        flat list of ids is refused: it would be one prompt, so wrap it). sampling_params:
        one SamplingParams for all, or one per prompt (None: the defaults).

        Every prompt and SamplingParams is checked before any request is queued; each
        request keeps a checked copy of its SamplingParams, so changing one afterwards
        affects only later calls. Calls from several threads run one after the other. A
        call that fails or is interrupted (Ctrl-C) aborts its requests before the error
        propagates, so the next call runs as on a fresh LLM.
        """
        with self._lock:
            if self.parallel is not None:
                return self.parallel.generate(
                    self._generate, self.runner.execute, prompts, sampling_params, use_tqdm
                )
            return self._generate(prompts, sampling_params, use_tqdm)

    def _generate(
        self,
        prompts: str | SequenceABC[str] | SequenceABC[SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        requests = self._requests(prompts, sampling_params)
        generators: dict[int, torch.Generator] = {}
        tracker = RequestTracker(self.scheduler, self.tokenizer, self.device, generators)
        self.stats = EngineStats()
        start = time.perf_counter()
        self._last_done = start
        preemptions = self.scheduler.num_preemptions
        tracked: list[Request] = []
        total = sum(seq.params.n for _, seq in requests)
        try:
            with tqdm(total=total, desc="generate", disable=not use_tqdm) as bar:
                def progress(out: StreamOutput) -> None:
                    bar.update(out.finish_reason is not None)

                for _, seq in requests:
                    tracked.append(Request(seq.seq_id, seq, self._reserve_ids(seq.params.n - 1),
                                           progress))
                    tracker.admit(tracked[-1])
                loop = StepLoop(self, generators, start)
                while loop.busy:
                    for seq in loop.advance()[0]:
                        tracker.emit(seq)
        except BaseException:
            # Every sequence once: the requests' first ones, admitted or not, and the
            # other completions of those admitted.
            seqs = {seq.seq_id: seq for _, seq in requests}
            seqs.update((c.seq.seq_id, c.seq) for request in tracked for c in request.completions)
            self._abort(list(seqs.values()))
            raise
        self.stats.preemptions = self.scheduler.num_preemptions - preemptions
        return [RequestOutput(request.request_id, text, seq.token_ids[:seq.num_prompt_tokens],
                              [c.output() for c in request.completions])
                for (text, seq), request in zip(requests, tracked, strict=True)]

    def _requests(
        self,
        prompts: str | SequenceABC[str] | SequenceABC[SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None,
    ) -> list[tuple[str | None, Sequence]]:
        """The call's prompts as new sequences, none queued yet: a TypeError or ValueError
        naming the prompt or the argument for the first one that is not right."""
        prompts = prompt_list(prompts)
        params = checked_params(sampling_params, len(prompts))
        requests = []
        for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            text, ids = self._encode(index, prompt)
            if p.stop and self.tokenizer is None:
                raise ValueError(f"sampling_params for prompts[{index}]: stop strings need "
                                 "a tokenizer, and this model has none (use stop_token_ids)")
            if len(ids) + p.max_tokens > self.max_model_len:
                raise ValueError(
                    f"prompts[{index}] of {len(ids)} tokens + max_tokens {p.max_tokens} "
                    f"exceeds max_model_len {self.max_model_len}"
                )
            seq = Sequence(self._next_id + index, ids, p)
            self.scheduler.check(seq, f"prompts[{index}]")
            requests.append((text, seq))
        self._next_id += len(requests)
        return requests

    def _reserve_ids(self, count: int) -> int:
        """The first of `count` new sequence ids."""
        first = self._next_id
        self._next_id += count
        return first

    def _encode(self, index: int, prompt: object) -> tuple[str | None, list[int]]:
        """prompts[index] as (its text or None, its token ids)."""
        name = f"prompts[{index}]"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, ids = None, checked_token_ids(name, prompt, self.config.vocab_size)
        else:
            raise TypeError(f"{name} must be a str or a list of token ids, got "
                            f"{type(prompt).__name__} {prompt!r:.80}")
        if not ids:
            # With no token there is no position whose logits predict the first output.
            raise ValueError(f"{name} is empty: a prompt needs at least one token")
        return text, ids

    def _abort(self, seqs: list[Sequence]) -> None:
        """Undo a failed call: drop its sequences, wherever the failure left them, and
        free every block that no remaining sequence holds.

        On CUDA the steps already launched may still run: they are waited for first, so
        that nothing still writes to the freed blocks or reads the step buffers the next
        call fills. Under tensor parallelism the other ranks keep no request state: they
        run the steps they are sent, and a step whose sending failed has closed the
        workers (`ParallelRuntime.watching_workers`), so nothing is left half-sent.
        """
        if self.device.type == "cuda":
            # A device error may be the failure itself: the exception raised is then the
            # one that stopped the call, not this wait's.
            with contextlib.suppress(RuntimeError):
                torch.cuda.synchronize(self.device)
        self.scheduler.abort(seqs)
        self.block_manager.reclaim([*self.scheduler.waiting, *self.scheduler.running])

    def step(self, generators: dict[int, torch.Generator], start: float) -> list[Sequence]:
        """Schedule, run and sample one step; returns the sequences it finished."""
        return self.complete(self.launch(self.scheduler.schedule(), generators), start)

    def launch(
        self,
        batch: ScheduledBatch,
        generators: dict[int, torch.Generator],
        before: LaunchedStep | None = None,
    ) -> LaunchedStep:
        """Enqueue a step's forward and sampling without waiting for the device.

        An ``ahead`` batch reads the tokens that ``before`` samples on the device.
        """
        tick = time.perf_counter()
        samples_before = None
        if batch.ahead:
            if before is None:
                raise ValueError("an ahead batch needs the launched step before it")
            samples_before = None if before.drawn is None else before.drawn.token_ids
        logits = self.runner.run(batch, samples_before)
        sampled = [seq for seq, s in zip(batch.seqs, batch.needs_sample, strict=True) if s]
        drawn = None
        if sampled:
            # Penalties and min_tokens read each row's tokens so far; an ahead batch's
            # newest token, not on the host yet, is read from samples_before on the
            # device, so ahead steps stay exact and are still planned for such requests.
            drawn = draw(
                logits,
                [seq.params for seq in sampled],
                [generators.get(seq.seq_id, self.generator) for seq in sampled],
                TokenHistory.of(batch, samples_before, self.scheduler.eos_token_id),
            )
        return LaunchedStep(batch, sampled, drawn, tick)

    def complete(self, launched: LaunchedStep, start: float) -> list[Sequence]:
        """Wait for a launched step's samples and account for it; returns the sequences
        it finished."""
        batch = launched.batch
        sampled: dict[int, tuple[int | None, dict[int, float]]] = {}
        if launched.drawn is not None:
            token_ids, logprobs, finite = launched.drawn.result()
            for seq, token, lp, ok in zip(launched.sampled, token_ids, logprobs, finite,
                                          strict=True):
                # Logits that are not finite give no token: the request fails alone.
                sampled[seq.seq_id] = (token, lp) if ok else (None, {})
        done = time.perf_counter()
        # Steps overlap: a step's time runs from the later of its launch and the end of
        # the step before, so that the steps' times add up to the wall time.
        elapsed = done - max(launched.tick, self._last_done)
        self._last_done = done
        now = done - start
        decode_tokens = batch.num_decode_tokens()
        prefill_tokens = batch.num_tokens - decode_tokens
        self.stats.steps += 1
        self.stats.decode_tokens += decode_tokens
        self.stats.prefill_tokens += prefill_tokens
        # A mixed step's time is split between the two in proportion to their tokens.
        self.stats.decode_time += elapsed * decode_tokens / batch.num_tokens
        self.stats.prefill_time += elapsed * prefill_tokens / batch.num_tokens
        for seq in launched.sampled:
            self.stats.first_token_times.setdefault(seq.seq_id, now)
        return self.scheduler.postprocess(batch, sampled)


def _serve_driver(args: EngineArgs) -> None:
    """A tensor parallel rank spawned by the driver: the driver's engine, serving the
    driver's steps until it shuts down (`Workers`' entry point). It builds its kernels
    running the steps of the driver's warm-up."""
    llm = LLM(dataclasses.replace(args, warmup=False))
    assert llm.parallel is not None
    llm.parallel.serve(llm.runner.execute)
    llm.close()
