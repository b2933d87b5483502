"""Per-request sampling settings: how the next token is drawn and when a request stops."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop it.

    Attributes:
        temperature: divides the logits before sampling; 0 means greedy (argmax).
        top_p: nucleus sampling; keep the smallest set of most likely tokens whose
            probability adds up to at least ``top_p`` (1.0 keeps everything).
        top_k: keep only the ``top_k`` most likely tokens; -1 keeps everything.
        max_tokens: the request stops with reason ``"length"`` after this many
            generated tokens.
        stop_token_ids: generating any of these stops the request (reason ``"stop"``);
            the stop token is kept in the output token ids.
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: None for no log-probabilities; otherwise the number of most likely
            tokens whose log-probability is returned at each step (the sampled token
            is always included, so 0 returns only the sampled token's).
        seed: per-request seed; a seeded request draws its randomness from its own
            generator, so its tokens do not depend on the other requests in a batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # written this way so that NaN is rejected too
            _reject("temperature", ">= 0", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            _reject("top_p", "in (0, 1]", self.top_p)
        if self.top_k != -1 and self.top_k < 1:
            _reject("top_k", "-1 (disabled) or >= 1", self.top_k)
        if self.max_tokens < 1:
            _reject("max_tokens", ">= 1", self.max_tokens)
        if self.logprobs is not None and self.logprobs < 0:
            _reject("logprobs", "None or >= 0", self.logprobs)


def _reject(field: str, expected: str, actual: object) -> None:
    raise ValueError(f"SamplingParams.{field} must be {expected}, got {actual!r}")
