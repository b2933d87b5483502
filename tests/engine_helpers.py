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


def assert_same_until_a_near_tie(
    expected: Sequence[RequestOutput], got: Sequence[RequestOutput], tol: float
) -> None:
    """Two 16-bit engines that round differently (e.g. compiled and eager): per request
    the same tokens, each step's logprobs within `tol`, up to the first step where they
    pick different tokens, which must be a near tie in `expected` (both tokens among its
    logprobs, within `tol`: sample with logprobs >= 2); the continuations then differ and
    are not compared. At least half of all steps must be compared."""
    compared = total = 0
    for want, have in zip(expected, got, strict=True):
        a, b = want.outputs[0], have.outputs[0]
        total += len(a.token_ids)
        for token_a, token_b, step_a, step_b in zip(a.token_ids, b.token_ids, a.logprobs,
                                                    b.logprobs, strict=True):
            if token_a != token_b:
                assert token_b in step_a, (token_a, token_b, step_a)
                assert step_a[token_a] - step_a[token_b] < tol, (token_a, token_b, step_a)
                break
            compared += 1
            for token, value in step_a.items():
                if token in step_b:
                    assert abs(value - step_b[token]) < tol, (value, step_b[token])
    assert 2 * compared >= total, f"only {compared} of {total} steps agree"
