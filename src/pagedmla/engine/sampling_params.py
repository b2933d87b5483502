"""Per-request sampling settings: how the next token is drawn and when a request stops."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedmla.validation import boolean, integer, real

# Temperatures below this sample greedily (argmax): dividing float32 logits by a tinier
# one overflows them to +-inf, and the softmax of such a row is NaN.
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request's tokens and when to stop it.

    Attributes:
        temperature: divides the logits before sampling; 0 (or anything below
            ``GREEDY_TEMPERATURE``, 1e-5) means greedy (argmax).
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
        seed: per-request seed, an int in [0, 2**64); a seeded request draws its
            randomness from its own generator, so its tokens do not depend on the
            other requests in a batch.
        min_tokens: until this many tokens are generated, the model's end-of-sequence
            token (even with ``ignore_eos``) and ``stop_token_ids`` cannot be drawn and
            do not stop the request; in [0, max_tokens].
        presence_penalty: subtracted from the logit of every token generated so far
            (the prompt does not count); in [-2, 2], 0 is off. Positive values favour
            new tokens.
        frequency_penalty: subtracted from each token's logit once per time it was
            generated so far; in [-2, 2], 0 is off.
        repetition_penalty: for every token in the prompt or generated so far, a
            positive logit is divided by it and a negative one multiplied by it
            (CTRL's penalty); finite and > 0, 1 is off, > 1 discourages repetition.
        n: completions of the prompt; they share its cached blocks (`RequestTracker`).
        stop: strings that end a completion (reason ``"stop"``) when its text holds one,
            once it has min_tokens tokens; the text ends before the stop string, the
            token ids with the token that completed it.

    The penalties and the min_tokens mask apply to the raw logits, repetition penalty
    first, before temperature, top-k and top-p, and for greedy rows too (the argmax of
    the penalised logits), as in vLLM and the OpenAI API. Returned logprobs stay those
    of the raw logits.

    Each field is checked by type and value (`validate`) when the object is made and
    again by every `LLM.generate` call it is given to.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    seed: int | None = None
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    stop: list[str] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and value; TypeError or ValueError naming the field.

        Runs at construction and again in `LLM.generate`, so that a field changed after
        construction is checked too. Numbers become plain ints and floats (a numpy
        integer is an int, a bool is not) and stop_token_ids a list.
        """
        self.temperature = _real("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:  # NaN fails too
            _reject("temperature", "finite and >= 0", self.temperature)
        self.top_p = _real("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            _reject("top_p", "in (0, 1]", self.top_p)
        self.top_k = _int("top_k", self.top_k)
        if self.top_k != -1 and self.top_k < 1:
            _reject("top_k", "-1 (disabled) or >= 1", self.top_k)
        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            _reject("max_tokens", ">= 1", self.max_tokens)
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError("SamplingParams.stop_token_ids must be None or a list of token "
                                f"ids, got {self.stop_token_ids!r}")
            self.stop_token_ids = [
                integer(f"SamplingParams.stop_token_ids[{i}]", token, minimum=0)
                for i, token in enumerate(self.stop_token_ids)
            ]
        boolean("SamplingParams.ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs)
            if self.logprobs < 0:
                _reject("logprobs", "None or >= 0", self.logprobs)
        if self.seed is not None:
            # The range of torch.Generator.manual_seed.
            self.seed = integer("SamplingParams.seed", self.seed, minimum=0,
                                maximum=2**64 - 1)
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            _reject("min_tokens", f"in [0, max_tokens] = [0, {self.max_tokens}]",
                    self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:  # NaN fails too
                _reject(name, "in [-2, 2]", value)
            setattr(self, name, value)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            _reject("repetition_penalty", "finite and > 0", self.repetition_penalty)
        self.n = _int("n", self.n)
        if self.n < 1:
            _reject("n", ">= 1", self.n)
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)):
                raise TypeError(f"SamplingParams.stop must be None or a list of str, got "
                                f"{self.stop!r}")
            for i, text in enumerate(self.stop):
                if not isinstance(text, str) or not text:
                    raise (TypeError if not isinstance(text, str) else ValueError)(
                        f"SamplingParams.stop[{i}] must be a non-empty str, got {text!r}")
            self.stop = list(self.stop)

    @property
    def has_penalties(self) -> bool:
        """Whether any of presence, frequency or repetition penalty is on."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _int(field: str, value: object) -> int:
    return integer(f"SamplingParams.{field}", value)


def _real(field: str, value: object) -> float:
    return real(f"SamplingParams.{field}", value)


def _reject(field: str, expected: str, actual: object) -> None:
    raise ValueError(f"SamplingParams.{field} must be {expected}, got {actual!r}")
