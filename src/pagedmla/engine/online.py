"""The online engine: requests arrive, stream their tokens and are aborted while the
engine runs.

`OnlineEngine` owns an `LLM` and runs its steps on a thread of its own (`StepLoop`, the
loop `LLM.generate` runs). Callers on any thread `add` requests, which are checked
before anything is queued, and receive `StreamOutput`s through a callback (or iterate
`stream`); `abort` drops a request and frees its blocks at the next step boundary.
Requests join the running batch between steps, so continuous batching, chunked
prefill, prefix caching, preemption, CUDA graphs, asynchronous scheduling and tensor
parallelism (workers spawned by the LLM) work as they do offline.

Requests, their n completions and stop strings are `RequestTracker`'s, as offline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator

import torch

from pagedmla.engine.llm import LLM
from pagedmla.engine.outputs import StreamOutput
from pagedmla.engine.requests import OutputCallback, Request, RequestTracker, deliver
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.engine.step_loop import StepLoop

logger = logging.getLogger(__name__)

class OnlineEngine:
    """An LLM serving requests as they come (see the module docstring).

    The LLM is the engine's while it runs: `LLM.generate` from another thread waits
    until `close`. Under tensor parallelism the LLM must have spawned its workers (not
    torchrun). `close(drain=True)` finishes the requests in flight first.
    """

    def __init__(self, llm: LLM) -> None:
        if llm.parallel is not None and llm.parallel.workers is None:
            raise ValueError("OnlineEngine needs an LLM that spawned its tensor parallel "
                             "workers; under torchrun use LLM.generate on every rank")
        self.llm = llm
        self._cv = threading.Condition()
        self._pending: list[Request] = []  # added, not yet seen by the engine thread
        self._aborts: set[int] = set()
        self._closing = False
        self._drain = True
        self._next_id = 0
        self._generators: dict[int, torch.Generator] = {}
        self._tracker = RequestTracker(llm.scheduler, llm.tokenizer, llm.device,
                                       self._generators)  # the engine thread's
        self.error: BaseException | None = None  # what stopped the engine thread
        self._thread = threading.Thread(target=self._run, name="pagedmla-engine", daemon=True)
        self._thread.start()

    # -- callers' side --------------------------------------------------------------

    def add(self, prompt: str | list[int], params: SamplingParams | None = None,
            on_output: OutputCallback | None = None) -> int:
        """Queue one request; returns its id. The prompt (a str or token ids) and the
        params are checked first: a TypeError or ValueError leaves nothing queued.
        on_output(StreamOutput) is called on the engine thread for every piece of every
        completion; it must return quickly (an exception it raises is logged and loses
        that output only)."""
        with self._cv:
            if self._closing or self.error is not None:
                raise RuntimeError("the engine is closed" if self._closing else
                                   f"the engine thread stopped: {self.error!r}")
            (_, seq), = self.llm._requests([prompt], params)
            request_id = self._next_id
            self._next_id += 1
            request = Request(request_id, seq, self.llm._reserve_ids(seq.params.n - 1),
                              on_output or (lambda out: None))
            self._pending.append(request)
            self._cv.notify()
        return request_id

    def abort(self, request_id: int) -> None:
        """Stop a request: its completions end with finish_reason "abort" and their
        blocks are freed before the next step. Unknown or finished ids are ignored."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None
               ) -> Iterator[StreamOutput]:
        """add() and iterate over the request's outputs until each completion finished;
        leaving the loop early aborts the request."""
        outputs: queue.Queue[StreamOutput] = queue.Queue()
        request_id = self.add(prompt, params, outputs.put)
        n = (params or SamplingParams()).n
        finished = 0
        try:
            while finished < n:
                out = outputs.get()
                finished += out.finish_reason is not None
                yield out
        finally:
            if finished < n:
                self.abort(request_id)

    @property
    def num_requests(self) -> tuple[int, int]:
        """(running, waiting) sequences of the scheduler (a snapshot)."""
        scheduler = self.llm.scheduler
        return len(scheduler.running), len(scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the cache's usable blocks held by sequences (a snapshot)."""
        manager = self.llm.block_manager
        return 1.0 - manager.num_free_blocks / manager.num_usable_blocks

    def close(self, drain: bool = True) -> None:
        """Stop the engine: drain=True lets every request queued or running finish
        first, drain=False aborts them. Idempotent."""
        with self._cv:
            self._closing = True
            self._drain = self._drain and drain
            self._cv.notify()
        self._thread.join()

    def __enter__(self) -> OnlineEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close(drain=False)

    # -- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            with self.llm._lock:
                if self.llm.parallel is not None:
                    self.llm.parallel.generate(self._serve, self.llm.runner.execute)
                else:
                    self._serve()
        except BaseException as error:  # the LLM is unusable: fail what is left
            logger.exception("the engine thread stopped")
            with self._cv:  # add() refuses from now on, so _pending stays empty after this
                self.error = error
                pending, self._pending = self._pending, []
            reason = f"the engine stopped: {error!r}"
            self._fail_admitted(reason)
            for request in pending:
                for index in range(request.params.n):
                    deliver(request, StreamOutput(request.request_id, index, [], "", [],
                                                  "error", reason))

    def _serve(self) -> None:
        tracker = self._tracker
        loop = StepLoop(self.llm, self._generators)
        while True:
            with self._cv:
                while not (self._pending or self._aborts or self._closing or loop.busy):
                    self._cv.wait()
                pending, self._pending = self._pending, []
                aborts, self._aborts = self._aborts, set()
                if self._closing and not self._drain:
                    aborts |= set(tracker.requests) | {r.request_id for r in pending}
                stop = self._closing and not (loop.busy or tracker.requests or pending)
            if stop:
                return
            for request in pending:
                tracker.admit(request)
            for request_id in aborts:
                tracker.finish(request_id, "abort")
            if not loop.busy:
                continue
            try:
                sampled, _ = loop.advance()
            except Exception as error:
                if self.llm.parallel is not None:
                    raise  # the failed step stopped the workers: the LLM is unusable
                # A failed step fails the requests it may have touched, not the engine.
                logger.exception("a step failed")
                self.llm._abort([c.seq for r in tracker.requests.values()
                                 for c in r.completions])
                self._fail_admitted(f"a step failed: {error!r}")
                loop = StepLoop(self.llm, self._generators)
                continue
            first_tokens = self.llm.stats.first_token_times
            for seq in sampled:
                tracker.emit(seq)
                first_tokens.pop(seq.seq_id, None)  # offline reports only: keep none

    def _fail_admitted(self, error: str) -> None:
        """End every admitted request with finish_reason "error"."""
        for request_id in list(self._tracker.requests):
            self._tracker.finish(request_id, "error", error)

