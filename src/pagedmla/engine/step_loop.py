"""The loop that runs an LLM's steps, shared by the offline `LLM.generate` and the online
engine: each step is launched on the device, the next one (with asynchronous
scheduling) is planned and launched while it runs, and then its samples are read."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedmla.engine.sampler import DrawnTokens
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence


@dataclass
class LaunchedStep:
    """A step enqueued on the device: its batch, the entries it samples (in row order)
    and their tokens on the way to the host (None when it samples nothing)."""

    batch: ScheduledBatch
    sampled: list[Sequence]
    drawn: DrawnTokens | None
    tick: float  # when its launch began (perf_counter)


class Stepper(Protocol):
    """What the loop drives: `LLM`'s scheduler, launch and complete."""

    scheduler: Scheduler
    async_scheduling: bool

    def launch(self, batch: ScheduledBatch, generators: dict[int, torch.Generator],
               before: LaunchedStep | None = None) -> LaunchedStep: ...

    def complete(self, launched: LaunchedStep, start: float) -> list[Sequence]: ...


class StepLoop:
    """Steps of one LLM, at most two in flight: the one whose samples are read next and,
    with asynchronous scheduling, the one launched ahead of it.

    generators: a seeded request's own random generator, by seq_id (the others draw
    from the LLM's). start: perf_counter time that `EngineStats.first_token_times`
    count from.
    """

    def __init__(self, llm: Stepper, generators: dict[int, torch.Generator],
                 start: float | None = None) -> None:
        self.llm = llm
        self.generators = generators
        self.start = time.perf_counter() if start is None else start
        self.launched: LaunchedStep | None = None

    @property
    def busy(self) -> bool:
        """Whether a step is in flight or a sequence is waiting or running."""
        return self.launched is not None or self.llm.scheduler.has_unfinished()

    def advance(self, ahead: bool = True) -> tuple[list[Sequence], list[Sequence]]:
        """Complete one step: launch it first if none is in flight, and (asynchronous
        scheduling, `ahead`) launch the step after it before reading its samples.
        Returns the sequences the completed step sampled a token for (or failed) and
        those it finished. ahead=False leaves nothing in flight, so that the caller may
        then change the scheduler's sequences (abort them)."""
        llm = self.llm
        if self.launched is None:
            self.launched = llm.launch(llm.scheduler.schedule(), self.generators)
        current = self.launched
        following = None
        if ahead and llm.async_scheduling:
            batch = llm.scheduler.schedule_ahead(current.batch)
            if batch is not None:
                following = llm.launch(batch, self.generators, current)
        finished = llm.complete(current, self.start)
        self.launched = following
        return current.sampled, finished
