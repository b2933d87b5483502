"""Continuous batching: which sequences run in a step, with how many new tokens each.

Each step packs, under ``max_num_seqs`` sequences and ``max_num_batched_tokens``
tokens: first the running sequences with one uncomputed token (decodes), then the
running sequences still prefilling (chunked prefills continuing), then waiting
sequences in FIFO order. A prefill takes ``min(remaining tokens, budget left)``, so
long prompts are spread over several steps. When a running sequence cannot get a
block, the most recently admitted running sequence is preempted by recompute: its
blocks are freed, its tokens kept, and it goes back to the front of the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step of work for the model runner.

    For entry ``i`` with ``c = seqs[i].num_computed_tokens`` and ``n = num_new_tokens[i]``
    the runner feeds ``seqs[i].token_ids[c : c + n]`` at positions ``c .. c + n - 1``
    (query_len ``n``, seq_len ``c + n``), writing their latents to the slots
    ``BlockManager.slot(seq, position)``. Every entry that takes the absorbed MQA path
    (``uses_mqa(n, c)``; by default ``n == 1``) comes before every other entry, the
    decode-first order the attention metadata expects.
    ``needs_sample[i]`` is true when the chunk reaches the sequence's last known token
    (``c + n == num_tokens``): only then do the logits of the chunk's last token predict
    a new token. A prefill chunk that stops inside the known tokens samples nothing.

    ``starts`` and ``sources`` are set on a step that ``Scheduler.schedule_ahead``
    planned while the step before it (``launched``) still ran, before ``postprocess``
    accounted for it. ``starts[i]`` is then entry ``i``'s first position ``c'``: ``c``
    plus its sequence's tokens in ``launched``. ``sources[i]`` is the row of
    ``launched``'s samples (its ``needs_sample`` entries, in order) holding the entry's
    one token, which the host does not know yet, or -1 where the host knows the tokens.
    ``needs_sample`` then means ``c' + n`` reaches the last token, counting the one
    ``launched`` samples.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    needs_sample: list[bool]
    starts: list[int] | None = None
    sources: list[int] | None = None

    @property
    def ahead(self) -> bool:
        """Whether the step was planned before the step before it was accounted for."""
        return self.starts is not None

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the model in this step (T)."""
        return sum(self.num_new_tokens)

    def first_positions(self) -> list[int]:
        """Each entry's first position: ``starts``, or each sequence's computed tokens."""
        if self.starts is not None:
            return self.starts
        return [seq.num_computed_tokens for seq in self.seqs]

    def num_decode_tokens(self) -> int:
        """Tokens that feed back a sampled token to sample the next: the last token of
        each entry that samples and ends past its sequence's prompt, one per entry. The
        others are prefill: prompt tokens in chunks of any size (one token included) and
        the tokens a preempted sequence recomputes before its newest. Call it before
        ``postprocess`` accounts for the step."""
        return sum(
            needs and start + n > seq.num_prompt_tokens
            for seq, n, needs, start in zip(self.seqs, self.num_new_tokens, self.needs_sample,
                                            self.first_positions())
        )


@dataclass
class _StepPlan:
    """The step being assembled: chosen sequences and the budgets they use."""

    max_num_seqs: int
    max_num_batched_tokens: int
    entries: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # seq_id -> (seq, n)
    num_tokens: int = 0

    @property
    def tokens_left(self) -> int:
        """Token budget not yet used in this step."""
        return self.max_num_batched_tokens - self.num_tokens

    def has_room(self) -> bool:
        """Whether one more sequence with at least one token fits in this step."""
        return len(self.entries) < self.max_num_seqs and self.tokens_left > 0

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        """Place ``seq`` in the step with ``num_new_tokens`` tokens."""
        self.entries[seq.seq_id] = (seq, num_new_tokens)
        self.num_tokens += num_new_tokens

    def discard(self, seq: Sequence) -> None:
        """Take ``seq`` out of the step if it is in it, returning its tokens to the budget."""
        _, num_new_tokens = self.entries.pop(seq.seq_id, (seq, 0))
        self.num_tokens -= num_new_tokens


class Scheduler:
    """Admits, schedules, preempts and finishes sequences over one ``BlockManager``."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        eos_token_id: int | None = None,
        uses_mqa: Callable[[int, int], bool] | None = None,
    ) -> None:
        """uses_mqa(query_len, context_len): whether an entry takes the decode path, so
        that such entries are ordered first (the metadata builder's rule). It must hold
        for one token over a non-empty context (``uses_mqa(1, c)`` for ``c >= 1``), as it
        does for every builder: decode-only steps are scheduled without asking it."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_id = eos_token_id
        self.uses_mqa = uses_mqa or (lambda query_len, context_len: query_len == 1)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the most recent is last
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; refuse one that could not fit in the whole cache (``check``)."""
        self.check(seq)
        self.waiting.append(seq)

    def check(self, seq: Sequence, name: str | None = None) -> None:
        """ValueError unless seq is new and could fit in the whole cache; the message
        calls it name (default: "sequence <seq_id>").

        The check uses the worst case (prompt + max_tokens - 1 cached tokens: the last
        sampled token is never fed), so an accepted request always runs to completion.
        """
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"add() takes a new waiting sequence, got {seq!r}")
        manager = self.block_manager
        max_cached = seq.num_prompt_tokens + seq.params.max_tokens - 1
        if manager.blocks_needed(max_cached) > manager.num_usable_blocks:
            raise ValueError(
                f"{name or f'sequence {seq.seq_id}'} needs up to "
                f"{manager.blocks_needed(max_cached)} cache "
                f"blocks (prompt {seq.num_prompt_tokens} + max_tokens {seq.params.max_tokens} "
                f"- 1 tokens), but the cache has {manager.num_usable_blocks}"
            )

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Drop seqs wherever they are (waiting, running, preempted, or between the two
        when a step was cut short) and free their blocks; each finishes with reason
        "abort". Finished sequences are left as they are."""
        dropped = [seq for seq in seqs if seq.status is not SequenceStatus.FINISHED]
        ids = {seq.seq_id for seq in dropped}
        kept = [seq for seq in self.waiting if seq.seq_id not in ids]
        self.waiting.clear()
        self.waiting.extend(kept)
        self.running[:] = [seq for seq in self.running if seq.seq_id not in ids]
        for seq in dropped:
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "abort"

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """Choose the next step's sequences and reserve cache blocks for their new tokens."""
        batch = self._schedule_decodes()
        if batch is not None:
            return batch
        plan = _StepPlan(self.max_num_seqs, self.max_num_batched_tokens)
        preempted = False
        decodes = [seq for seq in self.running if seq.num_uncomputed == 1]
        prefills = [seq for seq in self.running if seq.num_uncomputed > 1]
        for seq in decodes + prefills:
            if not plan.has_room():
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step to make room for another one
            num_new = min(seq.num_uncomputed, plan.tokens_left)
            while not self.block_manager.can_append(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                plan.discard(victim)  # a victim already placed in this step leaves it again
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.append_slots(seq, num_new)
                plan.add(seq, num_new)
        if not preempted:
            # After a preemption the freed blocks go to the preempted sequence first.
            self._admit(plan)
        if not plan.entries and self.has_unfinished():
            raise RuntimeError(
                f"scheduler made no progress: {len(self.waiting)} waiting, "
                f"{len(self.running)} running, {self.block_manager.num_free_blocks} free blocks"
            )
        return self._batch(
            [(seq, n, seq.num_computed_tokens, -1) for seq, n in plan.entries.values()]
        )

    def _batch(self, entries: list[tuple[Sequence, int, int, int]],
               ahead: bool = False) -> ScheduledBatch:
        """The step of ``entries``, each (sequence, tokens, first position, source; see
        ScheduledBatch), reordered decode path first."""
        # Stable partition: a one-token prefill chunk or a short one routed to the MQA
        # path moves up with the decodes.
        mqa = [self.uses_mqa(n, start) for _, n, start, _ in entries]
        entries = [e for e, m in zip(entries, mqa) if m] + [
            e for e, m in zip(entries, mqa) if not m]
        return ScheduledBatch(
            seqs=[seq for seq, *_ in entries],
            num_new_tokens=[n for _, n, *_ in entries],
            needs_sample=[start + n == seq.num_tokens + (source >= 0)
                          for seq, n, start, source in entries],
            starts=[start for *_, start, _ in entries] if ahead else None,
            sources=[source for *_, source in entries] if ahead else None,
        )

    def _schedule_decodes(self) -> ScheduledBatch | None:
        """The steady state in one pass, or None (nothing changed) when it does not apply.

        Applies when every running sequence decodes one token over a non-empty context,
        they all fit in the step, no waiting sequence could be admitted, and the free
        blocks cover every sequence whose next token starts a new block. The general
        path would then schedule the same: all of ``running`` in order, one token each,
        no preemption, blocks allocated in the same order.
        """
        running = self.running
        num_seqs = len(running)
        if not running or num_seqs > self._room or self._could_admit(num_seqs):
            return None
        for seq in running:
            computed = seq.num_computed_tokens
            if computed == 0 or len(seq.token_ids) - computed != 1:
                return None
        if not self._reserve_next_position(running, ahead=0):
            return None
        return ScheduledBatch(list(running), [1] * num_seqs, [True] * num_seqs)

    @property
    def _room(self) -> int:
        """Most one-token entries a step holds."""
        return min(self.max_num_seqs, self.max_num_batched_tokens)

    def _could_admit(self, num_seqs: int) -> bool:
        """Whether a step of num_seqs one-token entries leaves room for a waiting one."""
        return bool(self.waiting) and num_seqs < self._room

    def _reserve_next_position(self, seqs: list[Sequence], ahead: int) -> bool:
        """Blocks for one more token of each of seqs, at position num_computed_tokens +
        ahead: a new block where that position starts one. False, and nothing taken,
        when the free blocks do not cover them all (the caller would have to preempt)."""
        block_size = self.block_manager.block_size
        starting = [seq for seq in seqs
                    if seq.num_computed_tokens + ahead == len(seq.block_table) * block_size]
        if len(starting) > self.block_manager.num_free_blocks:
            return False
        for seq in starting:
            self.block_manager.append_slots(seq, 1 + ahead)
        return True

    def schedule_ahead(self, launched: ScheduledBatch) -> ScheduledBatch | None:
        """The step after ``launched``, planned before its sampled tokens are known; or None.

        Lets the host plan and enqueue step n+1 while the device runs step n. Every step
        before ``launched`` must be postprocessed; call ``postprocess(launched)`` before
        ``postprocess`` of the returned step. The step packs what ``schedule`` would
        once ``launched`` is accounted for, as far as the host knows it now:
        - a sequence that samples in ``launched`` decodes that token next, read on the
          device (``sources``). One whose token from ``launched`` is its last (max_tokens)
          is left out. One that stops on it (EOS, a stop token) is only known later: its
          row is computed, and dropped by ``postprocess``;
        - a prefill chunk continues after its chunk in ``launched``, and waiting sequences
          are admitted as ``schedule`` admits them;
        - nothing is preempted: None when the free blocks do not cover the running
          sequences' next tokens, and the caller then schedules synchronously.
        """
        return self._decodes_ahead(launched) or self._plan_ahead(launched)

    def _decodes_ahead(self, launched: ScheduledBatch) -> ScheduledBatch | None:
        """``schedule_ahead``'s steady state in one pass, or None where it does not apply.

        Applies when ``launched`` holds every running sequence, each decoding one token
        over a non-empty context, besides rows of sequences that finished in the step
        before it; no waiting sequence could be admitted; and the free blocks cover every
        sequence whose next token starts a block. ``_plan_ahead`` would plan the same.
        """
        if any(n != 1 for n in launched.num_new_tokens) or not all(launched.needs_sample):
            return None
        running = iter(self.running)
        seqs: list[Sequence] = []
        sources: list[int] = []
        for row, seq in enumerate(launched.seqs):
            if seq.status is SequenceStatus.FINISHED:
                continue
            if seq is not next(running, None) or seq.num_computed_tokens == 0:
                return None
            if seq.num_output_tokens + 1 < seq.params.max_tokens:  # else launched's is last
                seqs.append(seq)
                sources.append(row)
        # This step writes position c + 1, one past launched's c.
        if (
            next(running, None) is not None
            or not seqs
            or self._could_admit(len(seqs))
            or not self._reserve_next_position(seqs, ahead=1)
        ):
            return None
        num_seqs = len(seqs)
        return ScheduledBatch(seqs, [1] * num_seqs, [True] * num_seqs,
                              starts=[seq.num_computed_tokens + 1 for seq in seqs],
                              sources=sources)

    def _plan_ahead(self, launched: ScheduledBatch) -> ScheduledBatch | None:
        """``schedule_ahead`` in general: ``schedule``'s packing over the counts that
        ``launched`` leaves, without preemption."""
        in_flight: dict[int, tuple[int, int]] = {}  # seq_id -> (tokens in launched, source)
        row = 0
        for seq, n, sample in zip(launched.seqs, launched.num_new_tokens, launched.needs_sample,
                                  strict=True):
            in_flight[seq.seq_id] = (n, row if sample else -1)
            row += sample
        decodes, prefills = [], []
        for seq in self.running:
            pending, source = in_flight.get(seq.seq_id, (0, -1))
            if source >= 0 and seq.num_output_tokens + 1 >= seq.params.max_tokens:
                continue  # launched's token is its last
            start = seq.num_computed_tokens + pending
            uncomputed = seq.num_tokens + (source >= 0) - start
            (decodes if uncomputed == 1 else prefills).append((seq, start, uncomputed, source))
        plan = _StepPlan(self.max_num_seqs, self.max_num_batched_tokens)
        placed: dict[int, tuple[int, int]] = {}  # seq_id -> (start, source)
        missing = 0
        for seq, start, uncomputed, source in decodes + prefills:
            if not plan.has_room():
                break
            num_new = min(uncomputed, plan.tokens_left)
            # Blocks up to start + num_new, counted from num_computed_tokens.
            missing += self.block_manager.num_missing_blocks(
                seq, start - seq.num_computed_tokens + num_new)
            plan.add(seq, num_new)
            placed[seq.seq_id] = (start, source)
        if missing > self.block_manager.num_free_blocks:
            return None  # schedule would preempt
        for seq, num_new in plan.entries.values():
            self.block_manager.append_slots(
                seq, placed[seq.seq_id][0] - seq.num_computed_tokens + num_new)
        self._admit(plan)
        if not plan.entries:
            return None
        return self._batch(
            [(seq, n, *placed.get(seq.seq_id, (seq.num_computed_tokens, -1)))
             for seq, n in plan.entries.values()],
            ahead=True,
        )

    def postprocess(
        self, batch: ScheduledBatch, sampled: dict[int, tuple[int | None, dict[int, float]]]
    ) -> list[Sequence]:
        """Account for a finished step and return the sequences it finished.

        ``sampled`` maps ``seq_id`` to ``(token_id, logprobs)`` for every entry with
        ``needs_sample``; other entries are ignored, as are the entries of an ``ahead``
        step whose sequence finished in the step before. A token_id of None means the
        entry's logits were not finite: its sequence fails (finish reason "error").
        """
        finished: list[Sequence] = []
        manager = self.block_manager
        block_size = manager.block_size
        starts = batch.first_positions()
        for seq, start in zip(batch.seqs, starts, strict=True):
            if seq.status is not SequenceStatus.FINISHED and seq.num_computed_tokens != start:
                raise RuntimeError(
                    f"{seq!r} was planned from position {start}: postprocess the step "
                    "before this one first"
                )
        for seq, num_new, needs_sample, start in zip(
            batch.seqs, batch.num_new_tokens, batch.needs_sample, starts, strict=True
        ):
            if batch.ahead and seq.status is SequenceStatus.FINISHED:
                continue  # stopped in the step before: this row was computed for nothing
            computed = start + num_new
            seq.num_computed_tokens = computed
            # commit registers the blocks filled since its last call, which follows every
            # step: a one-token step that does not end on a block boundary has none.
            if num_new > 1 or computed % block_size == 0:
                manager.commit(seq)
            if not needs_sample:
                continue
            entry = sampled.get(seq.seq_id)
            if entry is None:
                raise ValueError(f"sampled has no token for sequence {seq.seq_id}, which needs one")
            token_id, logprobs = entry
            if token_id is None:
                seq.finish_reason = "error"
                seq.error = (f"request {seq.seq_id}: the logits for output token "
                             f"{seq.num_output_tokens} are not finite (NaN or inf)")
            else:
                seq.append_token(token_id, logprobs)
                seq.finish_reason = self._finish_reason(seq, token_id)
            if seq.finish_reason is not None:
                seq.status = SequenceStatus.FINISHED
                manager.free(seq)
                self.running.remove(seq)
                finished.append(seq)
        return finished

    def _admit(self, plan: _StepPlan) -> None:
        """Move waiting sequences, in FIFO order, into the step while they fit."""
        while self.waiting and plan.has_room():
            seq = self.waiting[0]
            self.block_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed, plan.tokens_left)
            if not self.block_manager.can_append(seq, num_new):
                # Give the cached blocks back; the head waits so that it is not starved.
                self.block_manager.free(seq)
                seq.reset_for_recompute()
                return
            self.waiting.popleft()
            self.block_manager.append_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.add(seq, num_new)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks and queue it first; its tokens are recomputed later."""
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Why ``seq`` stops after ``token_id``, its newest token; None if it goes on.

        EOS and stop tokens stop it only once it holds min_tokens generated tokens (the
        sampler keeps them from being drawn before; this covers a row that could draw
        nothing else)."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == self.eos_token_id:
                return "stop"
            if params.stop_token_ids and token_id in params.stop_token_ids:
                return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None
