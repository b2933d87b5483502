"""Helpers shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pagedmla import LLM


@contextmanager
def ahead_steps(llm: LLM) -> Iterator[list[int]]:
    """Inside the block, llm's Scheduler.schedule_ahead records the size of every ahead
    step it plans in the yielded list; the method is restored on exit."""
    sizes: list[int] = []
    plan = llm.scheduler.schedule_ahead

    def recorded(launched):
        batch = plan(launched)
        if batch is not None:
            sizes.append(len(batch.seqs))
        return batch

    llm.scheduler.schedule_ahead = recorded
    try:
        yield sizes
    finally:
        del llm.scheduler.schedule_ahead  # the instance attribute: back to the method
