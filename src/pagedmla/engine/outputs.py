"""What generate() returns, and the counters behind its throughput reports."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated completion: token ids, decoded text, per-step logprobs, why it
    stopped ("stop", "length", "abort", or "error" with `error` saying why: the tokens
    before the failure are kept)."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]]
    finish_reason: str | None
    error: str | None = None


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]


@dataclass
class StreamOutput:
    """What one step added to one completion of a request (`OnlineEngine`): the new
    token ids, the text they complete (held back while it may still begin a stop string
    or ends in an incomplete character), their logprobs, and, on the completion's last
    output only, why it stopped ("stop", "length", "abort", "error" with `error`)."""

    request_id: int
    index: int  # which of the request's n completions
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]]
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class EngineStats:
    """Counters of the last generate() call, for throughput reports.

    Tokens count by what they are (`ScheduledBatch.num_decode_tokens`): a decode token
    is a sampled token fed back to sample the next, one per sequence and step; every
    other token fed is a prefill token: prompt tokens, in chunks of any size (one token
    included), and the tokens a preempted sequence recomputes before its newest. A
    step's time is split between the two in proportion to their tokens.
    """

    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    steps: int = 0
    preemptions: int = 0
    first_token_times: dict[int, float] = field(default_factory=dict)
