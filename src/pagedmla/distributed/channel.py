"""Step messages from the driver (rank 0) to the other ranks, over the gloo CPU group.

A step travels as two int64 broadcasts: a fixed header (kind, sizes, and whether the
token ids follow on the device), then one flat payload with the step's host inputs
(token ids, positions, the BatchSpec and the rows to sample). Going through gloo even
on CUDA keeps the control plane on the host and makes a dead peer an error rather than
a hang. An ahead step (asynchronous scheduling) is sent before its token ids exist on
the host: they are sampled on rank 0's device, and the ranks then broadcast them over
the TP group, in stream order (`ParallelState.broadcast`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pagedmla.distributed.state import ParallelState
from pagedmla.metadata import BatchSpec

_HEADER = 6  # kind, T, B, block-table width, sampled rows, token ids on the device


class Kind(enum.IntEnum):
    STEP = 1  # run the model on the payload
    END = 2  # a generate() call finished (torchrun ranks return from theirs)
    SHUTDOWN = 3  # leave the serving loop


@dataclass
class StepInputs:
    """One step's host inputs: token_ids [T], positions [T] (int64), the BatchSpec, and
    the token rows whose logits are sampled. With device_tokens the host token ids are
    placeholders: the real ones follow by a device broadcast."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    spec: BatchSpec
    sample_rows: list[int]
    device_tokens: bool = False


class StepChannel:
    """Broadcasts from rank 0; every other rank receives in the same order."""

    def __init__(self, state: ParallelState) -> None:
        self.group = state.cpu_group

    def _broadcast(self, tensor: torch.Tensor) -> None:
        dist.broadcast(tensor, src=0, group=self.group)

    def send(self, kind: Kind, step: StepInputs | None = None) -> None:
        if step is None:
            self._broadcast(torch.tensor([kind] + [0] * (_HEADER - 1), dtype=torch.int64))
            return
        spec = step.spec
        table = spec.block_table
        header = [kind, step.token_ids.shape[0], table.shape[0], table.shape[1],
                  len(step.sample_rows), int(step.device_tokens)]
        self._broadcast(torch.tensor(header, dtype=torch.int64))
        self._broadcast(torch.cat([
            step.token_ids, step.positions,
            torch.tensor([*spec.query_lens, *spec.seq_lens], dtype=torch.int64),
            table.reshape(-1).to(torch.int64), spec.slot_mapping,
            torch.tensor(step.sample_rows, dtype=torch.int64),
        ]))

    def receive(self) -> tuple[Kind, StepInputs | None]:
        header = torch.empty(_HEADER, dtype=torch.int64)
        self._broadcast(header)
        kind, T, B, width, S, device_tokens = header.tolist()
        if kind != Kind.STEP:
            return Kind(kind), None
        payload = torch.empty(3 * T + 2 * B + B * width + S, dtype=torch.int64)
        self._broadcast(payload)
        token_ids, positions, lens, table, slots, rows = payload.split(
            [T, T, 2 * B, B * width, T, S]
        )
        spec = BatchSpec(
            query_lens=lens[:B].tolist(),
            seq_lens=lens[B:].tolist(),
            block_table=table.view(B, width).to(torch.int32),
            slot_mapping=slots.clone(),
        )
        return Kind.STEP, StepInputs(token_ids, positions, spec, rows.tolist(),
                                     bool(device_tokens))

    def send_object(self, value: Any) -> None:
        """Pickle `value` from rank 0 to every rank (rare: generate's outputs)."""
        dist.broadcast_object_list([value], src=0, group=self.group)

    def receive_object(self) -> Any:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]
