"""ParallelState: this rank's place in the tensor, decode and prefill context parallel
groups.

One object, created once per process after `torch.distributed` is initialised and
passed explicitly to every module that communicates (no global "current group").
The world holds pcp * tp ranks: global rank g is TP rank g % tp of the tensor parallel
(TP) group g // tp, and prefill context parallel (PCP) rank g // tp of the PCP group
of the ranks with its TP rank (the same weight shard). The decode context parallel
(DCP) groups are runs of `dcp_size` consecutive ranks inside a TP group, so TP rank r
is DCP rank r % dcp_size. Rank 0 is the driver that schedules and samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# all_gather_single replaces all_gather_into_tensor in recent PyTorch (same contract).
_ALL_GATHER_INTO = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def check_parallel_sizes(
    tensor_parallel_size: int,
    decode_context_parallel_size: int,
    prefill_context_parallel_size: int = 1,
) -> None:
    """ValueError unless every size is an int >= 1 and dcp divides tp."""
    for name, value in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("decode_context_parallel_size", decode_context_parallel_size),
        ("prefill_context_parallel_size", prefill_context_parallel_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if tensor_parallel_size % decode_context_parallel_size:
        raise ValueError(
            f"decode_context_parallel_size ({decode_context_parallel_size}) must divide "
            f"tensor_parallel_size ({tensor_parallel_size}): a DCP group is a run of "
            "consecutive tensor parallel ranks"
        )


@dataclass(frozen=True)
class ParallelState:
    """Sizes, ranks and process groups of one rank.

    tp_group / dcp_group / pcp_group carry the model's tensors (NCCL on CUDA, gloo on
    the CPU); cpu_group is a gloo group over all ranks for host-side control messages.
    A group of None means the default (world) group.
    """

    tp_rank: int
    tp_size: int
    dcp_rank: int
    dcp_size: int
    device: torch.device
    tp_group: dist.ProcessGroup | None
    dcp_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    pcp_rank: int = 0
    pcp_size: int = 1
    pcp_group: dist.ProcessGroup | None = None

    @property
    def is_driver(self) -> bool:
        return self.tp_rank == 0 and self.pcp_rank == 0

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.pcp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pcp_size

    @classmethod
    def connect(
        cls,
        tensor_parallel_size: int,
        decode_context_parallel_size: int,
        device: torch.device,
        prefill_context_parallel_size: int = 1,
    ) -> ParallelState:
        """Create the groups; every rank must call this, in the same order of calls."""
        tp, dcp, pcp = (tensor_parallel_size, decode_context_parallel_size,
                        prefill_context_parallel_size)
        check_parallel_sizes(tp, dcp, pcp)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialised before ParallelState")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world != tp * pcp:
            raise ValueError(
                f"the torch.distributed world has {world} ranks; tensor_parallel_size "
                f"{tp} times prefill_context_parallel_size {pcp} is {tp * pcp} (one rank "
                "per tensor parallel shard and prefill context parallel replica)"
            )
        # new_group is collective: every rank creates every group, keeps its own.
        tp_group = _own_group([range(k * tp, (k + 1) * tp) for k in range(pcp)], rank, world)
        dcp_group = _own_group([range(first, first + dcp) for first in range(0, world, dcp)],
                               rank, world)
        pcp_group = _own_group([range(t, world, tp) for t in range(tp)], rank, world)
        cpu_group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(
            tp_rank=rank % tp, tp_size=tp, dcp_rank=rank % dcp, dcp_size=dcp, device=device,
            tp_group=tp_group, dcp_group=dcp_group, cpu_group=cpu_group,
            pcp_rank=rank // tp, pcp_size=pcp, pcp_group=pcp_group,
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP group, in place; returns x."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x from rank 0 to every rank, in place (on the device's stream); returns x."""
        dist.broadcast(x, src=0)
        return x

    def tp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, ...] from every TP rank -> [tp_size, M, ...], rank order."""
        return _all_gather(x, self.tp_size, self.tp_group)

    def dcp_all_gather(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, ...] from every DCP rank -> [dcp_size, M, ...] (into `out` when given)."""
        return _all_gather(x, self.dcp_size, self.dcp_group, out)

    def pcp_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, ...] from every PCP rank -> [pcp_size, M, ...], rank order."""
        return _all_gather(x, self.pcp_size, self.pcp_group)

    def dcp_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """x [dcp_size, ...]: part k goes to DCP rank k; returns [dcp_size, ...] where part
        k came from DCP rank k."""
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.dcp_group)
        return out

    def barrier(self) -> None:
        """Wait for every rank (over gloo, so that a dead peer raises instead of hanging)."""
        dist.barrier(group=self.cpu_group)

    def gather_objects(self, value: object) -> list[object]:
        """Every rank's `value` (picklable), in rank order, over the host group."""
        values: list[object] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.cpu_group)
        return values

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (e.g. cache blocks that fit everywhere)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(x.item())


def _own_group(groups: list[range], rank: int, world: int) -> dist.ProcessGroup | None:
    """Create every group of ranks in `groups` (a partition of the world) and return the
    one holding `rank`. None for the whole world, and for groups of one rank, which no
    collective runs over (ParallelState skips collectives of size 1)."""
    if len(groups) in (1, world):
        return None
    own = None
    for ranks in groups:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            own = group
    return own


def _all_gather(
    x: torch.Tensor, size: int, group: dist.ProcessGroup | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, ...] -> [size, M, ...]; `out` (when given) holds the ranks' x back to back."""
    if out is None:
        if size == 1:
            return x.unsqueeze(0)
        out = x.new_empty(size * x.shape[0], *x.shape[1:])
    # gloo accepts only the concatenated form [size * M, ...] of the output.
    _ALL_GATHER_INTO(out.view(size * x.shape[0], *x.shape[1:]), x.contiguous(), group=group)
    return out.view(size, *x.shape)
