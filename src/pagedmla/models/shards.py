"""Where a rank's tensors come from: its part of each model tensor, and the checkpoint
tensors that fill it.

A model tensor (a `state_dict` entry of the whole, unsharded model) is filled by one or
more checkpoint tensors, each a `Piece` placed at an index of its leading dimensions and
an offset on the others (a routed expert's gate projection fills `w13[e, :I]`). Under
tensor parallelism a rank holds a `Shard` of a model tensor: a range along one
dimension, zero padded past the tensor's end (vocabulary shards). `Piece.placement`
intersects the two, so a rank reads exactly the rows or columns it keeps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Index = tuple[int | slice, ...]


@dataclass(frozen=True)
class Shard:
    """[start, stop) along `dim` of a model tensor; past the tensor's end, zeros."""

    dim: int
    start: int
    stop: int

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        """The shard's shape, for a model tensor of shape `full`."""
        shape = list(full)
        shape[self.dim] = self.stop - self.start
        return tuple(shape)

    def pads(self, full: Sequence[int]) -> bool:
        """Whether the shard reaches past the end of a tensor of shape `full`."""
        return self.stop > full[self.dim]

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """A new tensor holding this shard of `full` (zero padded)."""
        out = full.new_zeros(self.shape(full.shape))
        size = full.shape[self.dim]
        kept = max(0, min(self.stop, size) - self.start)
        out.narrow(self.dim, 0, kept).copy_(full.narrow(self.dim, min(self.start, size), kept))
        return out


@dataclass(frozen=True)
class Piece:
    """A checkpoint tensor `name` of shape `shape` that fills model tensor[lead][offset:]:
    `lead` indexes the model tensor's first dimensions, `offset` starts the others."""

    name: str
    shape: tuple[int, ...]
    lead: tuple[int, ...] = ()
    offset: tuple[int, ...] | None = None

    def region(self) -> Index:
        """The index of the model tensor this piece fills."""
        offset = self.offset or (0,) * len(self.shape)
        return (*self.lead, *(slice(o, o + n) for o, n in zip(offset, self.shape, strict=True)))

    def placement(self, shard: Shard | None) -> tuple[tuple[slice, ...], Index] | None:
        """(the slice of the checkpoint tensor a rank holding `shard` needs, where it goes
        in that rank's tensor), or None when the rank needs none of it."""
        lead = list(self.lead)
        offset = list(self.offset or (0,) * len(self.shape))
        source = [slice(0, n) for n in self.shape]
        if shard is not None:
            d = shard.dim
            if d < len(lead):
                if not shard.start <= lead[d] < shard.stop:
                    return None
                lead[d] -= shard.start
            else:
                j = d - len(lead)
                lo = max(offset[j], shard.start)
                hi = min(offset[j] + self.shape[j], shard.stop)
                if lo >= hi:
                    return None
                source[j] = slice(lo - offset[j], hi - offset[j])
                offset[j] = lo - shard.start
        dest = (*lead, *(slice(o, o + s.stop - s.start) for o, s in zip(offset, source)))
        return tuple(source), dest


# The ways a checkpoint may fill one model tensor, each a tuple of pieces; the first is
# the spelling a model expects (e.g. per-expert tensors), a later one a single tensor
# that stands for all of the first's (e.g. transformers' fused experts).
Alternatives = tuple[tuple[Piece, ...], ...]


@dataclass(frozen=True)
class RankShards:
    """How one rank holds a model: `shards`, its part of each sharded model tensor (full
    state_dict key -> Shard; other tensors whole), and `full_keys`, the rank module's
    state_dict key -> the whole model's (two keys may share one tensor: tied heads)."""

    shards: Mapping[str, Shard]
    full_keys: Mapping[str, str]
