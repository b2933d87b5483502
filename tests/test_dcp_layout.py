"""Token placement under decode context parallelism (host math, no processes).

Properties: every position has exactly one owner; each rank's positions take its local
indices 0, 1, ... in order; virtual slots map one-to-one onto the ranks' physical
slots; padded_rows bounds every rank's rows and is exact at stripe boundaries; and
the DCP chunk plan respects the per-rank row budget.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.planner import plan_context_chunks

layouts = st.builds(
    lambda size, interleave, blocks: DCPLayout(size, 0, interleave, interleave * blocks),
    st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 4]), st.integers(1, 4),
)


def _ranks(layout: DCPLayout) -> list[DCPLayout]:
    return [DCPLayout(layout.size, r, layout.interleave, layout.block_size)
            for r in range(layout.size)]


@settings(max_examples=60, deadline=None)
@given(layouts, st.integers(0, 200))
def test_positions_are_dealt_once_and_in_order(layout: DCPLayout, n: int) -> None:
    positions = np.arange(n)
    owner = layout.owner(positions)
    local = layout.local_index(positions)
    for rank in _ranks(layout):
        mine = local[owner == rank.rank]
        assert mine.tolist() == list(range(rank.local_count(n)))
        assert rank.local_count(n) <= layout.padded_rows(n)
        if n % layout.stripe == 0:
            assert rank.local_count(n) == layout.padded_rows(n)


@settings(max_examples=40, deadline=None)
@given(layouts, st.integers(1, 6))
def test_virtual_slots_cover_every_physical_slot_once(layout: DCPLayout, blocks: int) -> None:
    slots = torch.arange(blocks * layout.virtual_block_size)
    taken = torch.zeros(layout.size, blocks * layout.block_size, dtype=torch.int64)
    for rank in _ranks(layout):
        local = rank.local_slots(slots)
        taken[rank.rank].index_add_(0, local[local >= 0], torch.ones_like(local[local >= 0]))
        # A token's slot lies in the physical block with the id of its virtual block.
        mine = local >= 0
        assert torch.equal(local[mine] // layout.block_size,
                           slots[mine] // layout.virtual_block_size)
    assert bool((taken == 1).all())
    assert rank.local_slots(torch.tensor([-1])).item() == -1


@settings(max_examples=60, deadline=None)
@given(layouts, st.lists(st.integers(0, 120), min_size=1, max_size=6), st.integers(1, 4))
def test_chunk_plan_fits_every_rank(layout: DCPLayout, context_lens: list[int],
                                    budget_stripes: int) -> None:
    align = layout.chunk_alignment
    workspace = align * budget_stripes
    plans = plan_context_chunks(context_lens, workspace // layout.size, workspace, align,
                                padded_rows=layout.padded_rows)
    covered = [0] * len(context_lens)
    for plan in plans:
        for rank in _ranks(layout):
            rows = sum(rank.local_count(s + n) - rank.local_count(s)
                       for s, n in zip(plan.starts, plan.seq_lens))
            assert rows <= workspace // layout.size
        for j, (start, length) in enumerate(zip(plan.starts, plan.seq_lens)):
            request = plan.request_start + j
            assert start == covered[request] and start % align == 0
            covered[request] += length
    assert covered == context_lens


def test_interleave_must_divide_block_size() -> None:
    with pytest.raises(ValueError, match="must divide block_size"):
        DCPLayout(2, 0, 3, 8)
    with pytest.raises(ValueError, match="rank must be in"):
        DCPLayout(2, 2, 1, 8)
