"""Helpers shared by the engine tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from pagedmla import LLM
from pagedmla.engine.outputs import RequestOutput


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


def assert_same_completions(
    expected: Sequence[RequestOutput], got: Sequence[RequestOutput], tol: float = 1e-3
) -> None:
    """The same tokens for every request, and each step's logprobs within `tol`."""
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs, strict=True):
            for token, value in step_a.items():
                assert abs(value - step_b[token]) < tol, (value, step_b[token])
