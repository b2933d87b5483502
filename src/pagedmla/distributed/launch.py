"""Starting the ranks of a tensor parallel LLM and stopping them again.

Two ways to run: under `torchrun` (or any launcher that sets RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT), every rank constructs the LLM and rank 0 drives; or from
a plain process, where `LLM(tensor_parallel_size=tp)` spawns ranks 1..tp-1 itself on
this machine. A spawned worker is a daemon process that sets the torchrun variables
and calls the entry point the engine gave (`worker`: construct the same LLM and serve
the driver's steps until told to stop); this module knows nothing of the engine. A
worker exits on its own when the driver process dies (a thread watches the parent),
and sends its traceback to the driver when it fails, so that the driver's error says
why.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take `group =
# group.WORLD` as a default argument, evaluated at import. PyTorch imports it lazily
# (through torch._dynamo, e.g. the first time a meta tensor is initialised); imported
# after init_process_group, those defaults would keep the world group alive after
# destroy_process_group, and its gloo worker threads would race the interpreter's exit
# (SIGABRT under torchrun: "terminate called without an active exception").
import torch.distributed.nn

# How long a collective may wait for a peer (a slow CPU step must not time out).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
_JOIN_TIMEOUT_S = 10.0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """One GPU per rank (the LOCAL_RANK-th of this machine); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def launched_externally() -> bool:
    """Whether this process is one rank of a launcher's group (torchrun or our spawn)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_from_environment(device: torch.device) -> None:
    """Join the launcher's group (env:// rendezvous), unless the caller already did."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend_for(device), init_method="env://", timeout=COLLECTIVE_TIMEOUT
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Workers:
    """Processes of ranks 1..world-1 spawned by the driver, and their error pipes.

    worker: what each process runs once the torchrun variables name its rank; it must
    be picklable (a module-level function, or a functools.partial of one), since the
    processes are spawned.
    """

    def __init__(
        self, worker: Callable[[], None], world_size: int, device: torch.device
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialised in this process (another "
                "tensor parallel LLM still open?): close() it first"
            )
        ctx = mp.get_context("spawn")  # CUDA cannot be used in forked children
        port = _free_port()
        self.procs: list[mp.process.BaseProcess] = []
        self.pipes: list[mp.connection.Connection] = []
        for rank in range(1, world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main, args=(rank, world_size, port, device.type, worker, writer),
                daemon=True, name=f"pagedmla-rank{rank}",
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.pipes.append(reader)
        self.serving = False
        try:
            self._join_group(port, world_size, device)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs if proc.pid is not None]

    def _join_group(self, port: int, world_size: int, device: torch.device) -> None:
        """Rank 0's rendezvous, watching the workers: one that dies before joining would
        otherwise leave the driver waiting for the whole timeout."""
        failure: list[BaseException] = []

        def init() -> None:
            try:
                dist.init_process_group(
                    backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=0,
                    world_size=world_size, timeout=COLLECTIVE_TIMEOUT,
                )
            except BaseException as err:
                failure.append(err)

        thread = threading.Thread(target=init, daemon=True, name="pagedmla-rendezvous")
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)
            self.check()
        if failure:
            raise failure[0]

    def check(self) -> None:
        """RuntimeError naming the first worker that is no longer running, with its error."""
        for rank, proc in enumerate(self.procs, start=1):
            # A process's sentinel closes while it exits, a moment before waitpid reports
            # it (on a loaded machine, often right after a SIGKILL): join it then, rather
            # than read it as running.
            if mp.connection.wait([proc.sentinel], 0):
                proc.join(_JOIN_TIMEOUT_S)
            if not proc.is_alive():
                code = proc.exitcode
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                raise RuntimeError(
                    f"tensor parallel worker rank {rank} (pid {proc.pid}) {how}"
                    f"{self._reported_errors()}"
                )

    def _reported_errors(self) -> str:
        reports = []
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                while pipe.poll():
                    reports.append(f"\n--- rank {rank} ---\n{pipe.recv()}")
            except (EOFError, OSError):
                continue
        return "".join(reports)

    def stop(self, graceful: bool = False) -> None:
        """Wait for the workers (graceful: after a shutdown message) or kill them."""
        for proc in self.procs:
            if graceful:
                proc.join(timeout=_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=_JOIN_TIMEOUT_S)
        for pipe in self.pipes:
            pipe.close()
        self.procs, self.pipes = [], []


def _exit_with_parent() -> None:
    """Exit this worker at once when the driver process is gone (no orphans)."""
    parent = mp.parent_process()
    if parent is not None:
        mp.connection.wait([parent.sentinel])
        os._exit(1)


def _worker_main(
    rank: int, world_size: int, port: int, device_type: str, worker: Callable[[], None],
    errors: Any,
) -> None:
    """A spawned rank: sets the torchrun variables, then runs `worker`."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    threading.Thread(target=_exit_with_parent, daemon=True, name="pagedmla-parent").start()
    if device_type == "cpu":
        # CPU ranks share this machine's cores: do not oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    try:
        worker()
    except BaseException:
        errors.send(traceback.format_exc())
        errors.close()
        os._exit(1)
