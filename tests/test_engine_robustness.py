"""A failed, interrupted or concurrent generate() never breaks the LLM.

Failures are injected into the engine's internals, on the CPU with the built-in tiny
model: an exception, or the KeyboardInterrupt that Ctrl-C raises, from the model runner,
the sampler, the scheduler or the block manager's allocation, at a chosen call. After
each, the same LLM must answer a follow-up call with exactly the tokens and the number
of steps of an LLM that never failed, with no sequence left in the scheduler and every
cache block free. Every prompt starts with two tokens no other prompt starts with, so
that prefix caching cannot shorten a follow-up call. Where CUDA is present the same
tests run there too (CUDA graphs, pinned copies, the wait for launched steps); the soak
runs on the CPU.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine import llm as llm_module

OPTIONS = dict(device="cpu", block_size=16, num_kv_blocks=24, max_num_batched_tokens=32)
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
# Four prompts of 100 tokens and 8 more need 4 x 7 blocks, the cache has 23: one is
# preempted (at the tenth step).
PREEMPTING = (100, 100, 100, 100)
LONG = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
_starts = itertools.count()


def _prompts(*lengths: int) -> list[list[int]]:
    """Prompts of these lengths, each starting with two tokens no other prompt starts with
    (a 1-token prompt fills no block that could be reused)."""
    prompts = []
    for n in lengths:
        start = next(_starts)
        head = [3 + start // 250 % 250, 3 + start % 250]
        prompts.append((head + [(7 * i) % 250 + 3 for i in range(n)])[:n])
    return prompts


def _tokens(outputs: list) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def _assert_idle(llm: LLM) -> None:
    """No sequence left, every block unreferenced and free."""
    assert not llm.scheduler.has_unfinished()
    manager = llm.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert all(manager.ref_count(block) == 0 for block in range(manager.num_blocks))


@pytest.fixture(scope="module", params=[(device, ahead) for device in DEVICES
                                        for ahead in (False, True)],
                ids=lambda param: f"{param[0]}-{'async' if param[1] else 'sync'}")
def engines(request) -> tuple[LLM, LLM]:
    """The LLM that failures are injected into, and one that never fails."""
    device, ahead = request.param
    options = {**OPTIONS, "device": device, "async_scheduling": ahead}
    return LLM("tiny", **options), LLM("tiny", **options)


def _assert_recovered(engines: tuple[LLM, LLM]) -> None:
    """The failed LLM is idle and runs a follow-up call (chunked prefill, then decodes)
    exactly as the LLM that never failed."""
    llm, fresh = engines
    _assert_idle(llm)
    prompts = _prompts(20, 37)
    want = _tokens(fresh.generate(prompts, GREEDY, use_tqdm=False)), fresh.stats.steps
    got = _tokens(llm.generate(prompts, GREEDY, use_tqdm=False)), llm.stats.steps
    assert got == want
    _assert_idle(llm)


@contextmanager
def failing(owner: object, name: str, after: int, error: BaseException,
            returned: bool = False) -> Iterator[list[int]]:
    """owner.name raises error at its call number after + 1, before running (or, with
    returned, once it has returned); the calls before run as usual. Yields a list
    holding the number of calls so far."""
    original = getattr(owner, name)
    own = name in vars(owner)  # a module's function; else an instance's method
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1 and not returned:
            raise error
        result = original(*args, **kwargs)
        if calls[0] == after + 1:
            raise error
        return result

    setattr(owner, name, wrapper)
    try:
        yield calls
    finally:
        if own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


INTERRUPT = KeyboardInterrupt()  # what Ctrl-C raises
INJECTED = RuntimeError("injected")
# Where a failure is injected: the owner of the method, its name, the calls before it
# raises, what it raises, and whether it raises once the method has returned.
POINTS: dict[str, tuple[Callable[[LLM], object], str, int, BaseException, bool]] = {
    "queueing": (lambda llm: llm.scheduler, "add", 2, INTERRUPT, False),
    "schedule": (lambda llm: llm.scheduler, "schedule", 0, INJECTED, False),
    "schedule_ahead": (lambda llm: llm.scheduler, "schedule_ahead", 2, INTERRUPT, False),
    "model runner, prefill": (lambda llm: llm.runner, "run", 1, INJECTED, False),
    "model runner, decode": (lambda llm: llm.runner, "run", 6, INTERRUPT, True),
    "sampler": (lambda llm: llm_module, "draw", 3, INTERRUPT, True),
    "postprocess": (lambda llm: llm.scheduler, "postprocess", 4, INJECTED, False),
    # A block taken off the free list, on its way to a sequence's table.
    "block allocation": (lambda llm: llm.block_manager, "_allocate", 5, INTERRUPT, True),
}


@pytest.mark.parametrize("point", list(POINTS))
def test_a_failure_inside_generate_leaves_the_llm_as_new(engines, point: str) -> None:
    llm = engines[0]
    if point == "schedule_ahead" and not llm.async_scheduling:
        pytest.skip("no step is planned ahead without async scheduling")
    owner, name, after, error, returned = POINTS[point]
    with (failing(owner(llm), name, after, error, returned) as calls,
          pytest.raises(type(error))):
        llm.generate(_prompts(40, 50, 3, 33), GREEDY, use_tqdm=False)
    assert calls[0] == after + 1
    _assert_recovered(engines)


def test_an_interrupt_while_a_sequence_is_preempted(engines) -> None:
    llm = engines[0]
    preemptions = llm.scheduler.num_preemptions
    with failing(llm.runner, "run", 16, INTERRUPT), pytest.raises(KeyboardInterrupt):
        llm.generate(_prompts(*PREEMPTING), LONG, use_tqdm=False)
    assert llm.scheduler.num_preemptions > preemptions
    _assert_recovered(engines)


def test_a_failed_call_leaves_cached_prefixes_reusable(engines) -> None:
    """The failed call's sequences held references on blocks of a cached prefix; after
    it the prefix is still cached, unreferenced, and a later call reuses it."""
    llm, fresh = engines
    (prefix,) = _prompts(48)  # 3 full blocks that a longer prompt can reuse
    llm.generate([prefix], GREEDY, use_tqdm=False)
    with failing(llm.runner, "run", 3, INJECTED), pytest.raises(RuntimeError):
        llm.generate([prefix + [5] * 20, prefix + [6] * 30], GREEDY, use_tqdm=False)
    _assert_idle(llm)
    prompt = prefix + [7] * 10
    got = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.stats.prefill_tokens == len(prompt) - 48  # the prefix came from the cache
    if llm.device.type == "cpu":  # float32: reusing the prefix changes no greedy token
        assert _tokens(got) == _tokens(fresh.generate([prompt], GREEDY, use_tqdm=False))
    _assert_recovered(engines)


def _concurrently(llm: LLM, calls: list[tuple[list, object]]) -> list[list]:
    """The outputs of llm.generate(prompts, params) for each call, all made at once from
    threads of their own."""
    results: dict[int, list] = {}
    start = threading.Barrier(len(calls))

    def call(index: int) -> None:
        start.wait()
        results[index] = llm.generate(*calls[index], use_tqdm=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(calls))]


def test_two_threads_calling_generate_run_one_after_the_other(engines) -> None:
    llm, fresh = engines
    prompts = [_prompts(30, 5), _prompts(17, 40, 2)]
    want = [_tokens(fresh.generate(p, GREEDY, use_tqdm=False)) for p in prompts]
    got = _concurrently(llm, [(p, GREEDY) for p in prompts])
    assert [_tokens(outputs) for outputs in got] == want
    _assert_recovered(engines)


# --- throughput accounting ---------------------------------------------------------------


def test_a_one_token_prefill_chunk_counts_as_prefill(engines) -> None:
    """A 33-token prompt under a 32-token budget is prefilled in chunks of 32 and 1."""
    llm = engines[0]
    llm.generate(_prompts(33), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    assert (llm.stats.prefill_tokens, llm.stats.decode_tokens) == (33, 3)
    assert llm.stats.steps == 5


def test_recomputed_tokens_count_as_prefill(engines) -> None:
    """Under preemption every sampled token but the last is still fed back once as a
    decode token; a preempted sequence's recomputed tokens are prefill."""
    llm = engines[0]
    prompts = _prompts(*PREEMPTING)
    outputs = llm.generate(prompts, LONG, use_tqdm=False)
    assert llm.stats.preemptions > 0
    assert llm.stats.decode_tokens == sum(len(tokens) - 1 for tokens in _tokens(outputs))
    assert llm.stats.prefill_tokens > sum(len(p) for p in prompts)


# --- soak ------------------------------------------------------------------------------------


def _bad_call(rng: random.Random, vocab: int) -> tuple[Callable[[LLM], object], type]:
    """A call the engine must refuse before queuing anything, and the error it raises."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    field, value, error = rng.choice([
        ("max_tokens", 2.5, TypeError), ("top_k", 0, ValueError),
        ("stop_token_ids", 5, TypeError), ("logprobs", 2.5, TypeError),
        ("temperature", float("nan"), ValueError), ("seed", 2**70, ValueError),
    ])
    setattr(params, field, value)
    good = _prompts(rng.randint(1, 40))[0]
    return rng.choice([
        (lambda llm: llm.generate([good, good], [GREEDY, params], use_tqdm=False), error),
        (lambda llm: llm.generate(good, GREEDY, use_tqdm=False), TypeError),  # flat
        (lambda llm: llm.generate([good, b"hi"], GREEDY, use_tqdm=False), TypeError),
        (lambda llm: llm.generate([good, []], GREEDY, use_tqdm=False), ValueError),
        (lambda llm: llm.generate([good, [1.0]], GREEDY, use_tqdm=False), TypeError),
        (lambda llm: llm.generate([good, [vocab]], GREEDY, use_tqdm=False), ValueError),
        (lambda llm: llm.generate([good, "x" * 5000], GREEDY, use_tqdm=False), ValueError),
        (lambda llm: llm.generate([good, [9] * 400], GREEDY, use_tqdm=False), ValueError),
        (lambda llm: llm.generate([good], [GREEDY, GREEDY], use_tqdm=False), ValueError),
    ])


def _valid_call(rng: random.Random) -> tuple[list[list[int]], list[SamplingParams]]:
    """1-4 prompts, some extending a prompt of an earlier call (prefix cache hits)."""
    count = rng.randint(1, 4)
    prompts = _prompts(*[rng.randint(1, 40) for _ in range(count)])
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8),
                             ignore_eos=rng.random() < 0.8) for _ in range(count)]
    return prompts, params


def test_a_request_whose_logits_are_not_finite_fails_alone(engines) -> None:
    """NaN logits for one request's third token: that request stops with finish reason
    "error" after its two good tokens; the others go on as if it had not been there."""
    llm, fresh = engines
    prompts = _prompts(20, 37, 9)
    want = _tokens(fresh.generate(prompts, GREEDY, use_tqdm=False))
    target = prompts[1][:2]
    launches = [0]
    original = llm.runner.run

    def run(batch, samples_before):
        logits = original(batch, samples_before).clone()  # (an inference tensor)
        sampled = [seq for seq, s in zip(batch.seqs, batch.needs_sample, strict=True) if s]
        for row, seq in enumerate(sampled):
            if seq.token_ids[:2] == target:
                launches[0] += 1
                if launches[0] == 3:
                    logits[row] = float("nan")
        return logits

    llm.runner.run = run
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        del llm.runner.run
    failed = outs[1].outputs[0]
    assert failed.finish_reason == "error"
    assert failed.token_ids == want[1][:2]
    assert "not finite" in failed.error and f"request {outs[1].request_id}" in failed.error
    assert [out.outputs[0].finish_reason for out in (outs[0], outs[2])] == ["length"] * 2
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == [want[0], want[2]]
    assert outs[0].outputs[0].error is None
    _assert_recovered(engines)


def test_a_nan_weight_fails_every_request_and_samples_no_token(engines) -> None:
    llm, _ = engines
    weight = llm.model.state_dict()["lm_head.weight"]
    saved = weight.clone()
    weight.fill_(float("nan"))
    try:
        outs = llm.generate(_prompts(12, 5), GREEDY, use_tqdm=False)
    finally:
        weight.copy_(saved)
    assert [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs] == [
        ("error", []), ("error", [])]
    _assert_recovered(engines)


@pytest.mark.parametrize("temperature", [1e-40, 1e-7])
def test_a_vanishing_temperature_is_greedy(engines, temperature: float) -> None:
    llm, fresh = engines
    prompts = _prompts(14, 30)
    want = _tokens(fresh.generate(prompts, GREEDY, use_tqdm=False))
    params = SamplingParams(temperature=temperature, max_tokens=5, ignore_eos=True, seed=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert _tokens(outs) == want
    assert {out.outputs[0].finish_reason for out in outs} == {"length"}
    _assert_idle(llm)


def test_soak_valid_invalid_failing_and_concurrent_calls() -> None:
    """Seeded random calls over one LLM with a cache small enough to preempt: valid
    ones, some from two threads at once, whose tokens must equal those of an LLM that
    sees only them; invalid ones, refused; and valid ones with a failure or interrupt
    injected at a random point. After every call no sequence is left and no block is
    held; every valid call returns one finished output per prompt."""
    rng = random.Random(52)
    llm = LLM("tiny", **{**OPTIONS, "num_kv_blocks": 8})
    fresh = LLM("tiny", **{**OPTIONS, "num_kv_blocks": 8, "enable_prefix_caching": False})
    vocab = llm.config.vocab_size
    done_ids: set[int] = set()
    cached: list[list[int]] = []  # prompts of earlier calls, for prefix cache hits

    def check_valid(prompts, params, outputs) -> None:
        assert _tokens(outputs) == _tokens(fresh.generate(prompts, params, use_tqdm=False))
        for out, p in zip(outputs, params, strict=True):
            assert out.request_id not in done_ids  # no request is lost or answered twice
            done_ids.add(out.request_id)
            assert out.outputs[0].finish_reason in ("length", "stop")
            assert len(out.outputs[0].token_ids) <= p.max_tokens

    for _ in range(150):
        kind = rng.choice(["valid", "valid", "invalid", "failure", "threads"])
        prompts, params = _valid_call(rng)
        if cached and rng.random() < 0.3:
            prompts[0] = rng.choice(cached) + prompts[0]
        if kind == "valid":
            check_valid(prompts, params, llm.generate(prompts, params, use_tqdm=False))
            if len(prompts[0]) <= 40:
                cached.append(prompts[0])
        elif kind == "invalid":
            call, error = _bad_call(rng, vocab)
            with pytest.raises(error):
                call(llm)
        elif kind == "failure":
            owner, name, _, _, returned = POINTS[rng.choice(list(POINTS))]
            error = rng.choice([INJECTED, INTERRUPT])
            outputs = None
            with failing(owner(llm), name, rng.randint(0, 12), error, returned):
                try:
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                except (RuntimeError, KeyboardInterrupt) as raised:
                    assert raised is error
            if outputs is not None:  # the call ended before the failure was due
                check_valid(prompts, params, outputs)
        else:
            other = _valid_call(rng)
            first, second = _concurrently(llm, [(prompts, params), other])
            check_valid(prompts, params, first)
            check_valid(*other, second)
        _assert_idle(llm)
