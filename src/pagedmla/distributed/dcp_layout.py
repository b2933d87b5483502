"""Where each token's latent row lives under decode context parallelism (host math only).

With D = dcp size and I = interleave (`cp_kv_cache_interleave_size`), positions are
dealt to the ranks of a DCP group round-robin in runs of I tokens: position p lives on
rank (p // I) % D, at local index (p // (I * D)) * I + p % I there. So a request of S
tokens keeps about S / D rows per rank, and a rank's rows are in position order.

The engine sees virtual blocks of block_size * D tokens: one block id of the host's
block table is one physical block of block_size rows on every rank of the group, and
a rank keeps its local index j at block_table[j // block_size] * block_size
+ j % block_size (I divides block_size, so a virtual block's rows stay in its blocks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class DCPLayout:
    """Token placement for DCP rank `rank` of `size`, interleave I, block_size rows/block."""

    size: int
    rank: int
    interleave: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("size", "interleave", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.block_size % self.interleave:
            raise ValueError(
                f"cp_kv_cache_interleave_size ({self.interleave}) must divide block_size "
                f"({self.block_size}), so that a virtual block's rows fill whole blocks"
            )

    @property
    def virtual_block_size(self) -> int:
        """Tokens one block-table entry covers across the group."""
        return self.block_size * self.size

    @property
    def stripe(self) -> int:
        """I * D: positions after which every rank has received I more rows."""
        return self.interleave * self.size

    @property
    def chunk_alignment(self) -> int:
        """Context chunks split at multiples of this, so that every rank holds exactly
        padded_rows(start) rows before a split (and splits stay on block boundaries)."""
        return math.lcm(self.block_size, self.stripe)

    def padded_rows(self, n: int) -> int:
        """Most rows any rank holds of positions [0, n): ceil(n / (I * D)) * I."""
        return -(-n // self.stripe) * self.interleave

    def local_counts(self, n: np.ndarray | int, rank: np.ndarray | int | None = None):
        """Rows of positions [0, n) held by `rank` (default: this rank); numpy broadcast."""
        rank = self.rank if rank is None else rank
        full, rest = np.divmod(n, self.stripe)
        return full * self.interleave + np.clip(rest - rank * self.interleave, 0, self.interleave)

    def local_count(self, n: int) -> int:
        """Rows of positions [0, n) on this rank."""
        return int(self.local_counts(n))

    def owner(self, positions: np.ndarray) -> np.ndarray:
        """DCP rank holding each position."""
        return positions // self.interleave % self.size

    def local_index(self, positions: np.ndarray) -> np.ndarray:
        """Index of each position among its owner's rows of the request."""
        return positions // self.stripe * self.interleave + positions % self.interleave

    def local_slots(self, virtual_slots: torch.Tensor) -> torch.Tensor:
        """Virtual slots (block id * virtual_block_size + offset) -> slots in this rank's
        cache, -1 for tokens another rank holds (and for -1)."""
        block = virtual_slots.div(self.virtual_block_size, rounding_mode="floor")
        # A virtual block starts on a stripe boundary: its offset r places like position r.
        offset = virtual_slots % self.virtual_block_size
        local = block * self.block_size + self.local_index(offset)
        mine = (virtual_slots >= 0) & (self.owner(offset) == self.rank)
        return torch.where(mine, local, torch.full_like(local, -1))
