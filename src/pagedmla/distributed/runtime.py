"""ParallelRuntime: what a tensor / context parallel LLM adds to the engine.

The LLM builds the same engine on every rank and asks the runtime for the parallel
parts: how to shard the model (the loader's Sharder), the per-rank metadata builder,
the step channel that the driver's runner sends each step over, and the agreed cache
size. Rank 0 schedules and
samples; the other ranks only run the model on the steps they receive. The runtime
knows nothing of the engine: the engine hands it callables (the spawned workers' entry
point, the step to run, the generate call).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagedmla.dims import MLADims
from pagedmla.distributed.channel import Kind, StepChannel, StepInputs
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.dcp_metadata import DCPMetadataBuilder
from pagedmla.distributed.launch import (
    Workers,
    init_from_environment,
    launched_externally,
    rank_device,
)
from pagedmla.distributed.pcp import PrefillContextParallel
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import check_heads_divisible, shard_for
from pagedmla.metadata import MLAMetadataBuilder
from pagedmla.models.loader import Sharder, load_config

_DEATH_WAIT_S = 2.0

# Runs one step on this rank, the engine's `ModelRunner.execute`: (token_ids [T],
# positions [T], BatchSpec, sample_rows, device_token_ids [T] or None) -> logits.
StepRunner = Callable[..., torch.Tensor]


class ParallelRuntime:
    """This rank's ParallelState and its link to the other ranks.

    `start` joins (torchrun) or creates (spawned workers) the process group; the
    workers, when this process spawned them, are stopped by `close`, when the runtime
    is garbage collected, or at interpreter exit. Callbacks given to `before_close` run
    first: CUDA graphs that captured NCCL collectives must be freed before the group is
    destroyed, or NCCL's teardown waits for them forever.
    """

    def __init__(
        self, state: ParallelState, workers: Workers | None, interleave: int, owns_group: bool
    ) -> None:
        self.state = state
        self.workers = workers
        self.interleave = interleave
        self.channel = StepChannel(state)
        self._before_close: list[Callable[[], None]] = []
        self._finalizer = weakref.finalize(
            self, _shutdown, workers, self.channel, owns_group, self._before_close
        )

    @classmethod
    def start(
        cls,
        device: torch.device,
        worker: Callable[[], None],
        *,
        model: str,
        block_size: int,
        tensor_parallel_size: int,
        decode_context_parallel_size: int,
        interleave: int,
        prefill_context_parallel_size: int = 1,
    ) -> ParallelRuntime:
        """Validate the sizes against the model, then connect every rank.

        worker: the entry point of the ranks spawned here (see `Workers`): the engine's
        construction of the same LLM, serving the driver's steps. interleave: tokens
        per rank in a run of the decode context parallel layout.
        """
        tp, dcp, pcp = (tensor_parallel_size, decode_context_parallel_size,
                        prefill_context_parallel_size)
        check_heads_divisible(load_config(model), tp)
        if dcp > 1:
            DCPLayout(dcp, 0, interleave, block_size)
        workers = None
        owns_group = not dist.is_initialized()
        if launched_externally():
            device = rank_device(device, int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
            init_from_environment(device)
        else:
            device = rank_device(device, 0)
            workers = Workers(worker, tp * pcp, device)
        try:
            state = ParallelState.connect(tp, dcp, device, pcp)
        except BaseException:
            if workers is not None:
                workers.stop()
            raise
        return cls(state, workers, interleave, owns_group)

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def is_driver(self) -> bool:
        return self.state.is_driver

    def sharder(self) -> Sharder:
        """The loader's Sharder for this rank (`tensor_parallel.shard_for`)."""
        return shard_for(self.state)

    def metadata_builder(self, dims: MLADims, block_size: int, **kwargs: Any) -> MLAMetadataBuilder:
        """The builder for this rank (kwargs as MLAMetadataBuilder's)."""
        if self.state.dcp_size == 1:
            return MLAMetadataBuilder(dims, block_size=block_size, device=self.device, **kwargs)
        layout = DCPLayout(self.state.dcp_size, self.state.dcp_rank, self.interleave, block_size)
        return DCPMetadataBuilder(dims, layout, self.state, device=self.device, **kwargs)

    def prefill_context_parallel(
        self, builder: MLAMetadataBuilder
    ) -> PrefillContextParallel | None:
        """What splits this rank's steps with prompts (None without PCP); `builder` is
        the rank's (`metadata_builder`)."""
        if self.state.pcp_size == 1:
            return None
        local_slots = (builder.layout.local_slots if isinstance(builder, DCPMetadataBuilder)
                       else lambda slots: slots)
        return PrefillContextParallel(self.state, builder.uses_mqa, local_slots, self.device)

    def agree_num_blocks(self, num_blocks: int) -> int:
        """Cache blocks every rank can hold (the block table is shared)."""
        return self.state.min_over_ranks(num_blocks)

    def send_step(
        self, step: StepInputs, device_token_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The driver's side of a step: its inputs to the other ranks, then, for an
        ahead step, its token ids [T] on the device (rank 0's, broadcast in stream
        order); returns what this rank feeds (the broadcast tensor, or None)."""
        self.channel.send(Kind.STEP, step)
        if device_token_ids is None:
            return None
        return self.state.broadcast(device_token_ids.contiguous())

    def ready(self) -> None:
        """Wait until every rank has built its engine; then steps can flow."""
        with self.watching_workers():
            self.state.barrier()
        if self.workers is not None:
            self.workers.serving = True

    def watching_workers(self) -> _WorkerWatch:
        return _WorkerWatch(self)

    def serve(self, execute: StepRunner) -> tuple[Kind, Any]:
        """Run the driver's steps (`execute`: the engine's runner) until it ends a
        generate() (torchrun ranks only; returns END and the driver's outputs) or shuts
        down (returns SHUTDOWN, None)."""
        while True:
            kind, step = self.channel.receive()
            if kind == Kind.STEP:
                assert step is not None
                device_token_ids = None
                if step.device_tokens:  # an ahead step: rank 0 broadcasts its samples
                    device_token_ids = self.state.broadcast(torch.empty_like(
                        step.token_ids, device=self.device))
                execute(step.token_ids, step.positions, step.spec, step.sample_rows,
                        device_token_ids)
            elif kind == Kind.END:
                return kind, self.channel.receive_object()
            else:
                return kind, None

    def generate(self, generate: Callable[..., Any], execute: StepRunner, *args: Any) -> Any:
        """generate(*args) on the driver. Under torchrun every rank calls this with the
        same arguments: the others serve the driver's steps (`execute`) and return its
        outputs."""
        if not self.is_driver:
            kind, outputs = self.serve(execute)
            if outputs is None:
                reason = "failed" if kind == Kind.END else "was shut down"
                raise RuntimeError(f"generate() {reason} on the driver (rank 0)")
            return outputs
        outputs = None
        try:
            outputs = generate(*args)
        finally:
            if self.workers is None:  # torchrun ranks wait for the outputs (None: failed)
                self.channel.send(Kind.END)
                self.channel.send_object(outputs)
        return outputs

    def before_close(self, callback: Callable[[], None]) -> None:
        """Run callback() when the runtime closes, before anything else."""
        self._before_close.append(callback)

    @property
    def is_open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Stop spawned workers and leave the process group (idempotent)."""
        self._finalizer()


class _WorkerWatch:
    """Guards the driver's work with spawned workers: a dead worker becomes a RuntimeError
    saying which one and why; any failure stops the others, since ranks that disagree
    on where they are in a step cannot be resumed."""

    def __init__(self, runtime: ParallelRuntime) -> None:
        self.runtime = runtime

    def __enter__(self) -> None:
        if not self.runtime.is_open:
            raise RuntimeError("the parallel workers were stopped (close() or a failed step)")
        self._check(None)

    def __exit__(self, kind: Any, error: BaseException | None, trace: Any) -> None:
        workers = self.runtime.workers
        if error is not None and workers is not None:
            workers.serving = False  # maybe mid-collective: no shutdown message, kill them
            self._check(error)
            self.runtime.close()

    def _check(self, cause: BaseException | None) -> None:
        workers = self.runtime.workers
        if workers is None:
            return
        if cause is not None:
            # A peer's death reaches us as a broken connection, maybe before it is reaped.
            mp.connection.wait([proc.sentinel for proc in workers.procs], _DEATH_WAIT_S)
        try:
            workers.check()
        except RuntimeError as dead:
            self.runtime.close()
            raise dead from cause


def _shutdown(
    workers: Workers | None,
    channel: StepChannel,
    owns_group: bool,
    before: list[Callable[[], None]],
) -> None:
    """Stop serving: run the `before` callbacks, tell live workers to leave and leave the
    group with them (its NCCL teardown waits for every rank's), then reap them. After a
    failure the workers are killed first, and the group is left if this runtime created
    it."""
    for callback in before:
        callback()
    if workers is not None:
        graceful = workers.serving and all(proc.is_alive() for proc in workers.procs)
        if graceful:
            try:
                channel.send(Kind.SHUTDOWN)
            except RuntimeError:
                graceful = False
        if graceful and owns_group and dist.is_initialized():
            dist.destroy_process_group()
        workers.stop(graceful)
    if owns_group and dist.is_initialized():
        dist.destroy_process_group()
