"""Requests on top of sequences: a request's n completions, their text as tokens arrive,
stop strings, and the outputs each step gives them. Shared by the offline
`LLM.generate` and the `OnlineEngine`.

A request of `SamplingParams.n` completions starts one sequence; the other n - 1 are
queued once it has sampled its first token, when its prompt's full blocks are in the
prefix cache for them to share. Completion i of a seeded request draws from seed + i.
Stop strings are matched on the decoded text (`detokenize`): the text that could still
become a stop string is held back until it cannot, and a stop string is not returned;
the completion's token ids end with the token that completed it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedmla.engine.detokenize import IncrementalDetokenizer, find_stop
from pagedmla.engine.outputs import CompletionOutput, StreamOutput
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.engine.scheduler import Scheduler
from pagedmla.engine.sequence import Sequence
from pagedmla.tokenizer import TextTokenizer

OutputCallback = Callable[[StreamOutput], None]

logger = logging.getLogger(__name__)


def deliver(request: Request, out: StreamOutput) -> None:
    """request.on_output(out); a callback that raises loses its output, not the engine."""
    try:
        request.on_output(out)
    except Exception:
        logger.exception("the output callback of request %d raised", request.request_id)


@dataclass
class Completion:
    """One of a request's completions."""

    index: int
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    sent_tokens: int = 0  # output tokens already given out
    sent_text: int = 0  # characters of the detokenizer's text already given out
    searched: int = 0  # characters of it already searched for stop strings
    done: bool = False

    def output(self) -> CompletionOutput:
        """Everything the completion produced (the offline result)."""
        seq = self.seq
        text = self.detokenizer.text if self.detokenizer is not None else ""
        return CompletionOutput(seq.output_token_ids, text, seq.output_logprobs,
                                seq.finish_reason, seq.error)


@dataclass
class Request:
    """A prompt and its n completions. `first` is completion 0's sequence (made and
    checked by the caller); the others take seq_ids first_fork_id, first_fork_id + 1..."""

    request_id: int
    first: Sequence
    first_fork_id: int
    on_output: OutputCallback
    completions: list[Completion] = field(default_factory=list)
    forks: list[Sequence] = field(default_factory=list)  # queued after the first token

    @property
    def params(self) -> SamplingParams:
        return self.first.params

    @property
    def done(self) -> bool:
        return not self.forks and all(c.done for c in self.completions)


class RequestTracker:
    """The requests of one scheduler, from admission to their last output.

    generators: filled with each seeded completion's generator by seq_id (the dict the
    `StepLoop` draws from). tokenizer: None leaves the text empty (token ids only).
    """

    def __init__(self, scheduler: Scheduler, tokenizer: TextTokenizer | None,
                 device: torch.device, generators: dict[int, torch.Generator]) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.device = device
        self.generators = generators
        self.requests: dict[int, Request] = {}
        self._by_seq: dict[int, tuple[Request, Completion]] = {}

    def admit(self, request: Request) -> None:
        """Queue the request's first sequence; the others wait for its first token."""
        self.requests[request.request_id] = request
        self.scheduler.add(self._new_seq(request, 0))
        request.forks = [self._new_seq(request, i) for i in range(1, request.params.n)]

    def emit(self, seq: Sequence) -> None:
        """Give out what `seq`'s newest step added to its completion (`on_output`);
        a stop string found in its text stops the sequence."""
        entry = self._by_seq.get(seq.seq_id)
        if entry is None:
            return  # aborted while its step ran
        request, completion = entry
        if request.forks:  # the first token: the prompt is cached, the others may start
            for fork in request.forks:
                self.scheduler.add(fork)
            request.forks = []
        ids = seq.output_token_ids[completion.sent_tokens:]
        logprobs = seq.output_logprobs[completion.sent_tokens:]
        completion.sent_tokens += len(ids)
        reason = seq.finish_reason
        text = ""
        detokenizer = completion.detokenizer
        if detokenizer is not None:
            detokenizer.add(ids)
            if reason is not None:
                detokenizer.flush()
            stops = request.params.stop
            searched, completion.searched = completion.searched, len(detokenizer.text)
            if stops and seq.num_output_tokens >= request.params.min_tokens:
                # Only text new since the last look: what came before min_tokens (and may
                # have been given out) is not searched again.
                at = find_stop(detokenizer.text, stops, searched)
                if at != -1:
                    detokenizer.text = detokenizer.text[:at]
                    if reason is None:  # the sequence runs on: stop it
                        self.scheduler.abort([seq])
                    reason = seq.finish_reason = "stop"
            # Hold back what may still begin a stop string.
            hold = 0 if reason is not None or not stops else max(map(len, stops)) - 1
            end = max(completion.sent_text, len(detokenizer.text) - hold)
            text = detokenizer.text[completion.sent_text:end]
            completion.sent_text = end
        if reason is not None:
            self._close(request, completion)
        deliver(request, StreamOutput(request.request_id, completion.index, ids, text,
                                       logprobs, reason, seq.error))

    def finish(self, request_id: int, reason: str, error: str | None = None) -> None:
        """End every open completion of a request with `reason` (and `error`), freeing
        its blocks; unknown or finished requests are left alone."""
        request = self.requests.get(request_id)
        if request is None:
            return
        open_ = [c for c in request.completions if not c.done]
        self.scheduler.abort([c.seq for c in open_])
        request.forks = []
        for completion in open_:
            completion.seq.finish_reason = reason
            completion.seq.error = error
            self._close(request, completion)
            deliver(request, StreamOutput(request_id, completion.index, [], "", [], reason,
                                           error))

    def _new_seq(self, request: Request, index: int) -> Sequence:
        params = request.params
        first = request.first
        seq = first if index == 0 else Sequence(request.first_fork_id + index - 1,
                                                first.token_ids, params)
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            self.generators[seq.seq_id] = generator.manual_seed((params.seed + index) % 2**64)
        detokenizer = (IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None
                       else None)
        completion = Completion(index, seq, detokenizer)
        request.completions.append(completion)
        self._by_seq[seq.seq_id] = (request, completion)
        return seq

    def _close(self, request: Request, completion: Completion) -> None:
        completion.done = True
        self._by_seq.pop(completion.seq.seq_id, None)
        self.generators.pop(completion.seq.seq_id, None)
        if request.done:
            del self.requests[request.request_id]
