"""Scheduler: step packing, chunked prefill, preemption by recompute, stop conditions.

A fake model stands in for the network: it writes each fed token id into the slot the
block manager assigned, and predicts the next token from the ids it reads back through
the block table. A lost, shared-by-mistake or overwritten block therefore changes the
generated tokens, which are compared with a reference computed without any paging.
"""

from __future__ import annotations

import copy

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.engine.scheduler import ScheduledBatch, Scheduler
from pagedmla.engine.sequence import Sequence, SequenceStatus

VOCAB = 11
EOS = 0


def next_token(context: list[int]) -> int:
    """The fake model's deterministic prediction from everything before it."""
    return hash(tuple(context)) % VOCAB


def reference_output(prompt: list[int], params: SamplingParams) -> tuple[list[int], str]:
    """Tokens and finish reason that a request must produce, computed without the engine."""
    tokens = list(prompt)
    stops = set(params.stop_token_ids or [])
    while True:
        token = next_token(tokens)
        tokens.append(token)
        if (not params.ignore_eos and token == EOS) or token in stops:
            return tokens[len(prompt) :], "stop"
        if len(tokens) - len(prompt) == params.max_tokens:
            return tokens[len(prompt) :], "length"


class FakeModel:
    """Writes fed tokens into a simulated paged cache and predicts from what it reads."""

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.cache: dict[int, int] = {}  # slot -> token id stored there

    def step(
        self,
        batch: ScheduledBatch,
        before: dict[int, tuple[int, dict[int, float]]] | None = None,
    ) -> dict[int, tuple[int, dict[int, float]]]:
        """Run a step; an ahead batch feeds the tokens `before` (the step launched just
        before it, not yet postprocessed) sampled, as the device would."""
        sampled: dict[int, tuple[int, dict[int, float]]] = {}
        sources = batch.sources or [-1] * len(batch.seqs)
        for seq, num_new, needs_sample, start, source in zip(
            batch.seqs, batch.num_new_tokens, batch.needs_sample, batch.first_positions(),
            sources, strict=True,
        ):
            for position in range(start, start + num_new):
                slot = self.manager.slot(seq, position)
                block = slot // self.manager.block_size
                assert block != 0, "a token was written to the null block"
                assert self.manager.ref_count(block) == 1, "a token was written to a shared block"
                if source >= 0:
                    assert position == seq.num_tokens and before is not None
                    self.cache[slot] = before[seq.seq_id][0]
                else:
                    self.cache[slot] = seq.token_ids[position]
            if needs_sample:
                context = [self.cache[self.manager.slot(seq, p)] for p in range(start + num_new)]
                sampled[seq.seq_id] = (next_token(context), {next_token(context): -0.5})
        return sampled


def check_batch(scheduler: Scheduler, batch: ScheduledBatch) -> None:
    assert len(batch.seqs) <= scheduler.max_num_seqs
    assert batch.num_tokens <= scheduler.max_num_batched_tokens
    assert len({seq.seq_id for seq in batch.seqs}) == len(batch.seqs)
    sizes = batch.num_new_tokens
    assert sizes == sorted(sizes, key=lambda n: n > 1), "one-token entries must come first"
    for seq, num_new, needs_sample in zip(batch.seqs, sizes, batch.needs_sample, strict=True):
        assert seq.status is SequenceStatus.RUNNING
        assert 1 <= num_new <= seq.num_uncomputed
        assert needs_sample == (num_new == seq.num_uncomputed)
        covered = len(seq.block_table) * scheduler.block_manager.block_size
        assert covered >= seq.num_computed_tokens + num_new
    # Decodes go first: a running decode is left out only when the step is full of decodes.
    scheduled = {seq.seq_id for seq in batch.seqs}
    left_out = [s for s in scheduler.running if s.num_uncomputed == 1 and s.seq_id not in scheduled]
    if left_out:
        assert all(seq.num_uncomputed == 1 for seq in batch.seqs)


def check_ahead(scheduler: Scheduler, launched: ScheduledBatch, batch: ScheduledBatch) -> None:
    """An ahead batch, checked before `launched` is postprocessed: every entry starts
    where `launched` leaves its sequence, reads `launched`'s sample exactly where it has
    one, fits the budgets and its blocks, and decode-path entries come first."""
    assert batch.ahead and len(batch.seqs) <= scheduler.max_num_seqs
    assert batch.num_tokens <= scheduler.max_num_batched_tokens
    assert len({seq.seq_id for seq in batch.seqs}) == len(batch.seqs)
    sizes = batch.num_new_tokens
    assert sizes == sorted(sizes, key=lambda n: n > 1), "one-token entries must come first"
    samples = [seq for seq, s in zip(launched.seqs, launched.needs_sample, strict=True) if s]
    pending = dict(zip([seq.seq_id for seq in launched.seqs], launched.num_new_tokens,
                       strict=True))
    for seq, n, needs_sample, start, source in zip(
        batch.seqs, sizes, batch.needs_sample, batch.starts, batch.sources, strict=True
    ):
        assert seq.status is SequenceStatus.RUNNING
        assert start == seq.num_computed_tokens + pending.get(seq.seq_id, 0)
        known = seq.num_tokens
        if seq in samples:
            assert samples[source] is seq and n == 1 and start == known
            assert seq.num_output_tokens + 1 < seq.params.max_tokens
            known += 1
        else:
            assert source == -1 and 1 <= n <= known - start
        assert needs_sample == (start + n == known)
        covered = len(seq.block_table) * scheduler.block_manager.block_size
        assert covered >= start + n


def check_shortcut(scheduler: Scheduler, launched: ScheduledBatch) -> None:
    """Where schedule_ahead's steady-state shortcut applies, the general planner plans
    the same step with the same blocks (each on its own copy of the state)."""

    def plan(method: str) -> tuple[list, ...] | None:
        twin, twin_launched = copy.deepcopy((scheduler, launched))
        batch = getattr(twin, method)(twin_launched)
        if batch is None:
            return None
        return ([seq.seq_id for seq in batch.seqs], batch.num_new_tokens, batch.needs_sample,
                batch.starts, batch.sources, [seq.block_table for seq in batch.seqs])

    shortcut = plan("_decodes_ahead")
    if shortcut is not None:
        assert plan("_plan_ahead") == shortcut


def run_to_completion(
    scheduler: Scheduler,
    arrivals: list[tuple[int, Sequence]],
    model: FakeModel | None = None,
    max_steps: int = 5000,
    ahead: bool = False,
) -> list[Sequence]:
    """Drive the scheduler with the fake model; ``arrivals`` are (step, sequence) pairs.

    With ``ahead`` it is driven as the engine's async loop drives it: the step after a
    launched one is scheduled (``schedule_ahead``) and run before the launched one is
    postprocessed. Returns the finished sequences; ``scheduler.ahead_steps`` counts the
    ahead steps run.
    """
    model = model if model is not None else FakeModel(scheduler.block_manager)
    pending = sorted(arrivals, key=lambda item: item[0])
    finished: list[Sequence] = []
    launched: tuple[ScheduledBatch, dict] | None = None
    scheduler.ahead_steps = 0
    for step in range(max_steps):
        while pending and pending[0][0] <= step:
            scheduler.add(pending.pop(0)[1])
        if launched is None:
            if not scheduler.has_unfinished():
                if not pending:
                    return finished
                continue
            batch = scheduler.schedule()
            check_batch(scheduler, batch)
            launched = (batch, model.step(batch))
        following = None
        if ahead:
            check_shortcut(scheduler, launched[0])
        if ahead and (batch := scheduler.schedule_ahead(launched[0])) is not None:
            check_ahead(scheduler, launched[0], batch)
            following = (batch, model.step(batch, launched[1]))
            scheduler.ahead_steps += 1
        finished += scheduler.postprocess(*launched)
        launched = following
    raise AssertionError("the scheduler did not finish every request")


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    prefix_caching: bool = True,
) -> Scheduler:
    manager = BlockManager(num_blocks, block_size, prefix_caching)
    return Scheduler(manager, max_num_seqs, max_num_batched_tokens, eos_token_id=EOS)


def test_rejects_bad_budgets() -> None:
    manager = BlockManager(8, 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(manager, 0, 8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(manager, 8, 0)


def test_long_prompt_is_chunked_and_sampled_only_at_its_end() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=4)
    seq = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=3, ignore_eos=True))
    scheduler.add(seq)
    model = FakeModel(scheduler.block_manager)
    sizes, samples = [], []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        sizes += batch.num_new_tokens
        samples += batch.needs_sample
        scheduler.postprocess(batch, model.step(batch))
    assert sizes == [4, 4, 2, 1, 1]
    assert samples == [False, False, True, True, True]
    assert seq.output_token_ids == reference_output(list(range(1, 11)), seq.params)[0]
    assert seq.output_logprobs == [{token: -0.5} for token in seq.output_token_ids]


def test_decodes_come_first_and_one_token_chunks_join_them() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=5)
    model = FakeModel(scheduler.block_manager)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    decoder = Sequence(0, [1, 2], params)
    scheduler.add(decoder)
    scheduler.postprocess(batch := scheduler.schedule(), model.step(batch))
    prefill = Sequence(1, list(range(1, 13)), params)
    scheduler.add(prefill)
    batch = scheduler.schedule()
    assert [seq.seq_id for seq in batch.seqs] == [0, 1]
    assert batch.num_new_tokens == [1, 4]
    scheduler.postprocess(batch, model.step(batch))
    late = Sequence(2, [5, 6, 7], params)
    scheduler.add(late)
    batch = scheduler.schedule()  # decoder 1, prefill continues with 4, late gets 0 tokens
    assert [seq.seq_id for seq in batch.seqs] == [0, 1]
    scheduler.postprocess(batch, model.step(batch))
    batch = scheduler.schedule()  # decoder 1, prefill's last 4 (12 = 4+4+4), late 0
    scheduler.postprocess(batch, model.step(batch))
    batch = scheduler.schedule()  # two decodes, then late's first chunk of 3
    assert batch.num_new_tokens == [1, 1, 3]
    assert [seq.seq_id for seq in batch.seqs] == [0, 1, 2]


def test_prefix_cache_hit_skips_the_shared_prompt() -> None:
    scheduler = make_scheduler(block_size=4)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    model = FakeModel(scheduler.block_manager)
    first = Sequence(0, list(range(1, 14)), params)
    run_to_completion(scheduler, [(0, first)], model)
    second_prompt = [*range(1, 10), 7, 7]
    second = Sequence(1, second_prompt, params)
    scheduler.add(second)
    batch = scheduler.schedule()
    assert second.num_computed_tokens == 8  # two full blocks came from the cache
    assert batch.num_new_tokens == [3]
    scheduler.postprocess(batch, model.step(batch))
    run_to_completion(scheduler, [], model)
    assert second.output_token_ids == reference_output(second_prompt, params)[0]


def test_add_refuses_a_sequence_larger_than_the_cache() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4)  # 3 usable blocks = 12 tokens
    scheduler.add(Sequence(0, list(range(8)), SamplingParams(max_tokens=5)))
    with pytest.raises(ValueError, match="cache blocks"):
        scheduler.add(Sequence(1, list(range(8)), SamplingParams(max_tokens=6)))


def test_a_lone_sequence_that_fills_the_whole_cache_finishes() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=3)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    seq = Sequence(0, list(range(1, 9)), params)
    run_to_completion(scheduler, [(0, seq)])
    assert seq.output_token_ids == reference_output(list(range(1, 9)), params)[0]


def test_preemption_recomputes_the_newest_and_loses_nothing() -> None:
    scheduler = make_scheduler(num_blocks=7, block_size=2, prefix_caching=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    seqs = [Sequence(i, prompt, params) for i, prompt in enumerate(prompts)]
    finished = run_to_completion(scheduler, [(0, seq) for seq in seqs])
    assert scheduler.num_preemptions > 0
    assert sorted(seq.seq_id for seq in finished) == [0, 1, 2]
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output_token_ids == reference_output(prompt, params)[0]
        assert len(seq.output_logprobs) == params.max_tokens
    assert scheduler.block_manager.num_free_blocks == 6


def test_preempted_sequence_goes_back_to_the_front() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=2, max_num_batched_tokens=4)
    model = FakeModel(scheduler.block_manager)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    old, new = Sequence(0, [1, 2], params), Sequence(1, [3, 4], params)
    scheduler.add(old)
    scheduler.add(new)
    scheduler.postprocess(batch := scheduler.schedule(), model.step(batch))  # 2 blocks used
    queued = Sequence(2, [5], params)
    scheduler.add(queued)
    batch = scheduler.schedule()  # both need a 2nd block, 1 free: the newest is preempted
    assert [seq.seq_id for seq in batch.seqs] == [0]
    assert [seq.seq_id for seq in scheduler.waiting] == [1, 2]
    assert new.num_computed_tokens == 0 and new.block_table == []
    assert new.token_ids == [3, 4, reference_output([3, 4], params)[0][0]]


def test_abort_drops_sequences_wherever_they_are() -> None:
    """Abort a preempted, a running and a never scheduled sequence mid-run: each leaves
    the queues with its blocks; the one left finishes exactly, and every block returns."""
    scheduler = make_scheduler(num_blocks=7, block_size=2, max_num_batched_tokens=4)
    manager = scheduler.block_manager
    model = FakeModel(manager)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    seqs = [Sequence(i, prompt, params) for i, prompt in enumerate(prompts)]
    for seq in seqs[:3]:
        scheduler.add(seq)
    while scheduler.num_preemptions == 0:
        batch = scheduler.schedule()
        scheduler.postprocess(batch, model.step(batch))
    preempted = scheduler.waiting[0]
    assert preempted.status is SequenceStatus.WAITING  # preempted: first in the queue
    running = scheduler.running[-1]
    scheduler.add(seqs[3])
    scheduler.abort([preempted, running, seqs[3]])
    for seq in (preempted, running, seqs[3]):
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
        assert seq.block_table == [] and seq.num_computed_tokens == 0
        assert seq not in scheduler.waiting and seq not in scheduler.running
    (left,) = scheduler.running
    scheduler.abort([running])  # finished: left as it is
    assert running.finish_reason == "abort"
    run_to_completion(scheduler, [], model)
    assert left.output_token_ids == reference_output(prompts[left.seq_id], params)[0]
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))


def test_decode_tokens_are_sampled_tokens_fed_back() -> None:
    """A one-token chunk of a prompt is prefill; so is a preempted sequence's recompute
    up to its newest token, which it feeds back as a decode."""
    params = SamplingParams()
    prompt_end = Sequence(0, [1, 2, 3, 4, 5], params)  # its last prompt token
    prompt_end.num_computed_tokens = 4
    decode = Sequence(1, [1, 2, 3], params)
    decode.append_token(7)
    decode.num_computed_tokens = 3
    recompute = Sequence(2, [1, 2], params)
    for token in (7, 8, 9):
        recompute.append_token(token)
    partial = Sequence(3, [1, 2], params)  # a recompute chunk short of the newest token
    partial.append_token(7)
    partial.append_token(8)
    batch = ScheduledBatch([prompt_end, decode, recompute, partial], [1, 1, 5, 3],
                           [True, True, True, False])
    assert batch.num_decode_tokens() == 2
    # An ahead step's decode starts one past the computed tokens.
    ahead = ScheduledBatch([decode], [1], [True], starts=[4], sources=[0])
    assert ahead.num_decode_tokens() == 1


def test_stop_conditions() -> None:
    scheduler = make_scheduler()
    cases = {
        0: (SamplingParams(max_tokens=5), [3, EOS, 4], "stop", [3, EOS]),
        1: (SamplingParams(max_tokens=5, ignore_eos=True), [3, EOS, 4, 4, 4], "length", None),
        2: (SamplingParams(max_tokens=5, stop_token_ids=[9]), [3, 9, 4], "stop", [3, 9]),
        3: (SamplingParams(max_tokens=2), [3, 4, 5], "length", [3, 4]),
    }
    seqs = {seq_id: Sequence(seq_id, [1, 2], case[0]) for seq_id, case in cases.items()}
    for seq in seqs.values():
        scheduler.add(seq)
    step = 0
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        sampled = {s.seq_id: (cases[s.seq_id][1][step], {}) for s in batch.seqs}
        scheduler.postprocess(batch, sampled)
        step += 1
    for seq_id, (_, script, reason, expected) in cases.items():
        seq = seqs[seq_id]
        assert seq.status is SequenceStatus.FINISHED
        assert seq.finish_reason == reason
        assert seq.output_token_ids == (expected if expected is not None else script)
    assert scheduler.block_manager.num_free_blocks == 63


def test_postprocess_requires_a_token_for_each_sampling_sequence() -> None:
    scheduler = make_scheduler()
    scheduler.add(Sequence(0, [1, 2], SamplingParams()))
    with pytest.raises(ValueError, match="sampled has no token for sequence 0"):
        scheduler.postprocess(scheduler.schedule(), {})


def test_schedule_ahead_drops_rows_of_sequences_that_stopped() -> None:
    """Ahead steps run while every sequence decodes; the row of a sequence that stopped on
    EOS in the step before is computed and dropped, one that reached max_tokens is left
    out, and nothing leaks."""
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_seqs=4)
    cases = {
        0: (SamplingParams(max_tokens=9), [3, 4, EOS]),
        1: (SamplingParams(max_tokens=2, ignore_eos=True), [3, 4]),
        2: (SamplingParams(max_tokens=6, stop_token_ids=[9]), [5, 9]),
        3: (SamplingParams(max_tokens=6, ignore_eos=True), [3, 4, 5, 6, 7, 8]),
    }
    seqs = [Sequence(i, [1, 2, 3], params) for i, (params, _) in cases.items()]
    for seq in seqs:
        scheduler.add(seq)
    outputs: dict[int, int] = {i: 0 for i in cases}  # tokens drawn per sequence so far

    def draw(batch: ScheduledBatch) -> dict:
        sampled = {}
        for seq in batch.seqs:
            script = cases[seq.seq_id][1]
            step = outputs[seq.seq_id]
            outputs[seq.seq_id] += 1
            sampled[seq.seq_id] = (script[step] if step < len(script) else 7, {})
        return sampled

    launched = (first := scheduler.schedule(), draw(first))
    ahead_sizes = []
    while launched is not None:
        batch = scheduler.schedule_ahead(launched[0])
        following = None
        if batch is not None:
            check_ahead(scheduler, launched[0], batch)
            ahead_sizes.append([seq.seq_id for seq in batch.seqs])
            following = (batch, draw(batch))
        scheduler.postprocess(*launched)
        if following is None and scheduler.has_unfinished():
            following = (batch := scheduler.schedule(), draw(batch))
        launched = following
    # The prompts' step samples everyone's 1st token; the step after it is planned ahead
    # and draws everyone's 2nd, sequence 1's last, so the next ahead step leaves 1 out;
    # 2 stops on that token (known late): that step computes its row for nothing, as the
    # one after it does for 0 (EOS on its 3rd token). Then 3 decodes alone until its
    # max_tokens.
    assert ahead_sizes == [[0, 1, 2, 3], [0, 2, 3], [0, 3], [3], [3]]
    for seq in seqs:
        script = cases[seq.seq_id][1]
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_token_ids == script
        assert len(seq.output_logprobs) == len(script)
    assert [s.finish_reason for s in seqs] == ["stop", "length", "stop", "length"]
    assert scheduler.block_manager.num_free_blocks == 15


def test_schedule_ahead_plans_prompts_and_declines_only_where_schedule_would_preempt() -> None:
    scheduler = make_scheduler(num_blocks=10, block_size=2, max_num_seqs=2,
                               max_num_batched_tokens=4)
    scheduler.add(Sequence(0, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True)))
    first = scheduler.schedule()
    assert first.num_new_tokens == [4] and first.needs_sample == [False]
    # The chunk after a chunk: host tokens at positions 4..5, sampled at the prompt's end.
    second = scheduler.schedule_ahead(first)
    assert (second.num_new_tokens, second.starts, second.sources) == ([2], [4], [-1])
    assert second.needs_sample == [True]
    with pytest.raises(RuntimeError, match="postprocess the step before this one first"):
        scheduler.postprocess(second, {0: (4, {})})
    scheduler.postprocess(first, {})
    # The decode after it reads the sample of `second` (row 0) at position 6; a waiting
    # sequence joins with the budget's remaining 3 tokens.
    scheduler.add(Sequence(1, [7, 8, 9, 10, 11], SamplingParams(max_tokens=2)))
    third = scheduler.schedule_ahead(second)
    assert [seq.seq_id for seq in third.seqs] == [0, 1]
    assert (third.num_new_tokens, third.starts, third.sources) == ([1, 3], [6, 0], [0, -1])
    assert third.needs_sample == [True, False]
    scheduler.postprocess(second, {0: (4, {})})
    scheduler.postprocess(third, {0: (5, {})})
    fourth = scheduler.schedule()  # 0 decodes position 7, 1 finishes its prompt (3..4)
    assert fourth.num_new_tokens == [1, 2]
    # The step after it has 0 decode position 8, which starts a 5th block: with every
    # free block taken, schedule() would preempt, so schedule_ahead leaves it to it.
    hoard = Sequence(2, [1] * 16, SamplingParams())
    free = scheduler.block_manager.num_free_blocks
    assert free == 2  # of 9 usable: 4 for sequence 0, 3 for sequence 1
    scheduler.block_manager.append_slots(hoard, 2 * free)
    assert scheduler.schedule_ahead(fourth) is None
    assert scheduler.block_manager.num_free_blocks == 0  # nothing taken, nothing lost
    scheduler.block_manager.free(hoard)
    assert scheduler.schedule_ahead(fourth) is not None


@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_workloads_finish_every_request_exactly(ahead: bool, data: st.DataObject) -> None:
    """Random arrivals, lengths, budgets and tiny caches: every request ends as if alone,
    also when steps are scheduled ahead of the previous step's tokens."""
    block_size = data.draw(st.sampled_from([1, 2, 3, 4, 8]), label="block_size")
    base = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=24, max_size=24))
    requests = []
    for seq_id in range(data.draw(st.integers(1, 8), label="num_requests")):
        shared = data.draw(st.integers(0, 24))
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=int(shared == 0), max_size=8))
        params = SamplingParams(
            max_tokens=data.draw(st.integers(1, 12)),
            ignore_eos=data.draw(st.booleans()),
            stop_token_ids=data.draw(
                st.one_of(st.none(), st.lists(st.integers(1, 20), max_size=2))
            ),
        )
        arrival = data.draw(st.integers(0, 6))
        requests.append((arrival, Sequence(seq_id, base[:shared] + tail, params)))
    largest = max(len(seq.token_ids) + seq.params.max_tokens - 1 for _, seq in requests)
    min_blocks = -(-largest // block_size) + 1
    scheduler = make_scheduler(
        num_blocks=min_blocks + data.draw(st.integers(0, 6), label="extra_blocks"),
        block_size=block_size,
        max_num_seqs=data.draw(st.integers(1, 6), label="max_num_seqs"),
        max_num_batched_tokens=data.draw(st.integers(1, 40), label="token_budget"),
        prefix_caching=data.draw(st.booleans(), label="prefix_caching"),
    )
    prompts = {seq.seq_id: list(seq.token_ids) for _, seq in requests}
    finished = run_to_completion(scheduler, requests, ahead=ahead)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    event(f"ahead steps: {scheduler.ahead_steps > 0}")
    assert sorted(seq.seq_id for seq in finished) == sorted(prompts)
    for _, seq in requests:
        tokens, reason = reference_output(prompts[seq.seq_id], seq.params)
        assert seq.token_ids[: seq.num_prompt_tokens] == prompts[seq.seq_id]
        assert seq.output_token_ids == tokens
        assert seq.finish_reason == reason
        assert len(seq.output_logprobs) == len(tokens)
        if seq.params.ignore_eos and not seq.params.stop_token_ids:
            assert len(tokens) == seq.params.max_tokens
    manager = scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))
