"""Run a function on several gloo ranks from a test, and shard paged batches for DCP.

`run_ranks(fn, world_size, *args)` spawns one process per rank, initialises a gloo
process group in each, calls fn(*args) there and returns every rank's result (a
worker's exception comes back as an AssertionError carrying its traceback).
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pagedmla.distributed.dcp_layout import DCPLayout

RANK_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable, rank: int, world: int, port: int, args: tuple, results) -> None:
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        torch.set_num_threads(1)  # several ranks share two cores in CI
        results.put((rank, True, fn(*args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(*args) on world_size gloo ranks; the list of their results, rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, args, results), daemon=True)
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    by_rank: dict[int, Any] = {}
    try:
        for _ in procs:
            try:
                rank, ok, value = results.get(timeout=RANK_TIMEOUT_S)
            except queue.Empty as err:
                raise AssertionError("a rank did not answer in time") from err
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            by_rank[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [by_rank[r] for r in range(world_size)]


def shard_cache(data: torch.Tensor, layout: DCPLayout) -> torch.Tensor:
    """This rank's cache [num_blocks, block_size, W] from a cache laid out in virtual
    blocks [num_blocks, block_size * D, W]: every row moves to its owner's local slot."""
    num_blocks, virtual, width = data.shape
    assert virtual == layout.virtual_block_size
    local = torch.full((num_blocks, layout.block_size, width), float("nan"), dtype=data.dtype)
    slots = layout.local_slots(torch.arange(num_blocks * virtual))
    mine = slots >= 0
    local.view(-1, width)[slots[mine]] = data.reshape(-1, width)[mine]
    return local
