"""One request as the engine tracks it: its tokens, how many are cached, and its blocks."""

from __future__ import annotations

import enum

from pagedmla.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life: queued, holding cache blocks, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """A request's token ids (prompt then generated) and its place in the paged cache.

    ``token_ids[:num_computed_tokens]`` have their latents in the cache, in the blocks
    listed by ``block_table`` (position ``p`` lives in ``block_table[p // block_size]``).
    The remaining ``num_uncomputed`` tokens are fed to the model in later steps.
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_token_ids) == 0:
            # With no token there is no position whose logits predict the first output.
            raise ValueError(
                f"prompt_token_ids must hold at least one token, got {prompt_token_ids!r}"
            )
        self.seq_id = seq_id
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.output_logprobs: list[dict[int, float]] = []
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it failed (finish_reason "error")

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose latents are not in the cache yet."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (everything after the prompt)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens have been generated."""
        return self.num_tokens - self.num_prompt_tokens

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Record a sampled token and its log-probabilities (empty when none were asked for)."""
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprobs if logprobs is not None else {})

    def reset_for_recompute(self) -> None:
        """Forget the cache state after preemption; every token is kept and re-prefilled.

        The caller releases the blocks first (``BlockManager.free``).
        """
        self.block_table = []
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"num_tokens={self.num_tokens}, num_computed_tokens={self.num_computed_tokens})"
        )
