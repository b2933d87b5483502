"""Presence, frequency and repetition penalties and min_tokens: the sampler against a
float64 reference written here, and the engine (synchronous and asynchronous
scheduling) against properties that the unpenalised engine does not have."""

from __future__ import annotations

import math
import random
import zlib
from collections import Counter

import numpy as np
import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.sampler import TokenHistory, draw, sample
from pagedmla.engine.scheduler import Scheduler
from pagedmla.engine.sequence import Sequence, SequenceStatus
from pagedmla.models.tiny import write_tiny_checkpoint
from tests.engine_helpers import ahead_steps

EOS = 3
NUM_DRAWS = 4000  # rows of one batch; frequency tolerances are ~4 standard deviations


@pytest.fixture(autouse=True)
def fixed_global_seed() -> None:
    torch.manual_seed(4321)


def reference_logits(row: np.ndarray, prompt: list[int], output: list[int],
                     params: SamplingParams, eos: int | None) -> np.ndarray:
    """float64: one row's logits after the penalties and min_tokens, token by token."""
    x = row.astype(np.float64).copy()
    rep = params.repetition_penalty
    for token in set(prompt) | set(output):
        x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    for token, count in Counter(output).items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in [*(params.stop_token_ids or []), *([] if eos is None else [eos])]:
            if token < len(x):
                x[token] = -math.inf
    return x


def random_history(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """A prompt and an output that repeat some tokens (few distinct ones)."""
    pool = rng.sample(range(vocab), rng.randint(1, 12))
    prompt = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
    output = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
    return prompt, output


def random_params(rng: random.Random, kind: str, vocab: int, max_tokens: int = 64,
                  temperature: float = 0.0) -> SamplingParams:
    if kind == "presence":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              presence_penalty=rng.uniform(-2, 2))
    if kind == "frequency":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              frequency_penalty=rng.uniform(-2, 2))
    if kind == "repetition":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              repetition_penalty=rng.choice([rng.uniform(0.3, 1),
                                                             rng.uniform(1, 4)]))
    if kind == "min_tokens":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              min_tokens=rng.randint(0, min(15, max_tokens)),
                              stop_token_ids=rng.sample(range(vocab), rng.randint(0, 4)))
    if kind == "all":
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              presence_penalty=rng.uniform(-2, 2),
                              frequency_penalty=rng.uniform(-2, 2),
                              repetition_penalty=rng.uniform(0.5, 3),
                              min_tokens=rng.randint(0, min(15, max_tokens)),
                              stop_token_ids=rng.sample(range(vocab), 2))
    return SamplingParams(temperature=temperature, max_tokens=max_tokens)


def clear_argmax(x: np.ndarray, margin: float = 1e-3) -> int | None:
    """argmax of x, or None when the top two are within margin (float32 may differ)."""
    top = np.argsort(-x, kind="stable")[:2]
    if np.isfinite(x[top[1]]) and x[top[0]] - x[top[1]] < margin:
        return None
    return int(top[0])


@pytest.mark.parametrize("kind", ["presence", "frequency", "repetition", "min_tokens", "all"])
def test_greedy_rows_follow_the_float64_reference(kind: str) -> None:
    rng = random.Random(zlib.crc32(kind.encode()))  # str hashes change per process
    vocab, rows = 40, 96
    generator = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = torch.randn(rows, vocab, generator=generator) * 2
    histories = [random_history(rng, vocab) for _ in range(rows)]
    # Each row's current favourite among its own tokens, so that the penalties bite.
    for row, (prompt, output) in enumerate(histories):
        logits[row, rng.choice(prompt + output)] += 3.0
        logits[row, EOS] += 2.0 * (kind == "min_tokens")
    params = [random_params(rng, kind if row % 4 else "none", vocab) for row in range(rows)]
    history = TokenHistory([p + o for p, o in histories], [len(p) for p, _ in histories], EOS)
    tokens, _ = sample(logits, params, [None] * rows, history)
    changed = checked = 0
    for row, ((prompt, output), p) in enumerate(zip(histories, params, strict=True)):
        x = reference_logits(logits[row].numpy(), prompt, output, p, EOS)
        want = clear_argmax(x)
        if want is None:
            continue
        checked += 1
        changed += want != int(logits[row].argmax())
        assert tokens[row].item() == want, (row, p)
    assert checked > rows * 0.9
    assert changed >= 5  # the reference moves tokens, and the sampler moves the same ones


def test_ahead_rows_count_the_token_in_flight() -> None:
    """A row whose newest token is still on the device (sources, previous) is penalised
    as if the host held it."""
    rng = random.Random(7)
    vocab, rows = 30, 24
    logits = torch.randn(rows, vocab)
    histories = [random_history(rng, vocab) for _ in range(rows)]
    params = [random_params(rng, ("all", "frequency", "min_tokens", "none")[row % 4], vocab)
              for row in range(rows)]
    previous = torch.randint(0, vocab, (rows + 5,))
    sources = [rng.choice([-1, rng.randrange(rows + 5)]) for _ in range(rows)]
    for row in range(rows):
        logits[row, EOS] += 2.0
        if sources[row] >= 0:
            logits[row, int(previous[sources[row]])] += 3.0
        if row % 4 == 2:
            # min_tokens at the boundary: reached only by counting the token in flight.
            logits[row, EOS] += 20.0
            params[row].min_tokens = len(histories[row][1]) + (sources[row] >= 0)
            params[row].validate()
    lagging = TokenHistory([p + o for p, o in histories], [len(p) for p, _ in histories],
                           EOS, sources, previous)
    full = TokenHistory(
        [p + o + ([int(previous[s])] if s >= 0 else [])
         for (p, o), s in zip(histories, sources, strict=True)],
        [len(p) for p, _ in histories], EOS)
    got, _ = sample(logits, params, [None] * rows, lagging)
    want, _ = sample(logits, params, [None] * rows, full)
    assert torch.equal(got, want)
    for row in range(rows):
        prompt, output = histories[row]
        if sources[row] >= 0:
            output = [*output, int(previous[sources[row]])]
        x = reference_logits(logits[row].numpy(), prompt, output, params[row], EOS)
        if clear_argmax(x) is not None:
            assert got[row].item() == clear_argmax(x)


def test_random_rows_sample_the_penalised_distribution() -> None:
    vocab = 6
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.3])
    prompt, output = [0, 1], [4, 4, 2]
    params = SamplingParams(temperature=0.8, frequency_penalty=0.4, presence_penalty=0.3,
                            repetition_penalty=1.5)
    history = TokenHistory([prompt + output] * NUM_DRAWS, [len(prompt)] * NUM_DRAWS)
    tokens, _ = sample(row.expand(NUM_DRAWS, -1).contiguous(), [params] * NUM_DRAWS,
                       [None] * NUM_DRAWS, history)
    freq = torch.bincount(tokens, minlength=vocab).double() / NUM_DRAWS
    x = reference_logits(row.numpy(), prompt, output, params, None) / 0.8
    expected = torch.softmax(torch.from_numpy(x), dim=-1)
    assert torch.allclose(freq, expected, atol=0.035), (freq, expected)
    raw = torch.softmax(row.double() / 0.8, dim=-1)
    assert (expected - raw).abs().max() > 0.1  # the penalties do change the distribution


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    vocab, rows = 16, 400
    logits = torch.randn(rows, vocab)
    logits[:, EOS] += 6.0
    logits[:, 9] += 5.0
    stop = [9, 12]
    outputs = [[1] * (row % 5) for row in range(rows)]
    params = [SamplingParams(temperature=(row % 2) * 1.0, min_tokens=3, stop_token_ids=stop,
                             ignore_eos=row % 3 == 0) for row in range(rows)]
    history = TokenHistory([[5, *o] for o in outputs], [1] * rows, EOS)
    tokens, _ = sample(logits, params, [None] * rows, history)
    held = torch.tensor([len(o) < 3 for o in outputs])
    is_stop = (tokens == EOS) | (tokens == 9) | (tokens == 12)
    assert not is_stop[held].any()  # not even with ignore_eos: EOS stays masked
    greedy = torch.tensor([row % 2 == 0 for row in range(rows)])
    assert torch.equal(tokens[~held & greedy], logits[~held & greedy].argmax(dim=-1))
    # A row where only stop tokens are possible cannot honour min_tokens: it draws from
    # its raw logits rather than from nothing.
    only_stop = torch.full((2, vocab), -math.inf)
    only_stop[:, 9] = 1.0
    only_stop[1, EOS] = 2.0
    greedy_params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=stop)
    token_ids, _, finite = draw(only_stop, [greedy_params] * 2, [None, None],
                                TokenHistory([[5], [5]], [1, 1], EOS)).result()
    assert finite == [True, True] and token_ids == [9, EOS]


def test_penalties_keep_the_flags_and_the_raw_logprobs() -> None:
    vocab = 12
    logits = torch.randn(6, vocab)
    logits[0, 3] = math.nan
    logits[1, 7] = math.inf
    logits[2] = -math.inf
    logits[4, 5] = math.nan
    logits[5, 8] = 5.0  # a repetition penalty of 1e-38 overflows it: it stays the favourite
    params = [SamplingParams(temperature=t, repetition_penalty=1e-38, frequency_penalty=-2.0,
                             min_tokens=2, stop_token_ids=[1], logprobs=vocab)
              for t in (0.0, 0.0, 1.0, 1.0, 0.7, 1.0)]
    history = TokenHistory([[8, 8, 2]] * 6, [1] * 6, EOS)
    token_ids, logprobs, finite = draw(logits, params, [None] * 6, history).result()
    assert finite == [False, False, False, True, False, True]
    assert token_ids[5] == 8
    raw = torch.log_softmax(logits[5].double(), dim=-1)
    for token, value in logprobs[5].items():
        assert math.isclose(value, raw[token].item(), abs_tol=1e-5)


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_no_stop_before_min_tokens(ignore_eos: bool) -> None:
    """The scheduler's own guard: a stop token or EOS that reaches it (a row that could
    draw nothing else) does not stop the request before min_tokens tokens."""
    scheduler = Scheduler(BlockManager(16, 4, False), 4, 64, eos_token_id=EOS)
    params = SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[7],
                            ignore_eos=ignore_eos)
    seq = Sequence(0, [1, 2, 3], params)
    scheduler.add(seq)
    stops = [7, EOS, 7, EOS]  # the third token reaches min_tokens and stops
    for step, token in enumerate(stops):
        finished = scheduler.postprocess(scheduler.schedule(), {0: (token, {})})
        if step < 2:
            assert not finished and seq.finish_reason is None
        elif step == 2:
            assert finished == [seq] and seq.finish_reason == "stop"
            assert seq.status is SequenceStatus.FINISHED
            break
    assert seq.output_token_ids == stops[:3]


def test_penalties_need_a_history() -> None:
    for params in (SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=1)):
        with pytest.raises(ValueError, match="history"):
            sample(torch.zeros(1, 4), [params], [None])
    with pytest.raises(ValueError, match="one history entry per row"):
        sample(torch.zeros(2, 4), [SamplingParams(min_tokens=1)] * 2, [None] * 2,
               TokenHistory([[1]], [1]))


@pytest.mark.parametrize(("field", "value", "error", "expected"), [
    ("presence_penalty", "0.5", TypeError, "number"),
    ("presence_penalty", True, TypeError, "number"),
    ("presence_penalty", 2.5, ValueError, r"in \[-2, 2\]"),
    ("presence_penalty", -2.01, ValueError, r"in \[-2, 2\]"),
    ("presence_penalty", math.nan, ValueError, r"in \[-2, 2\]"),
    ("frequency_penalty", None, TypeError, "number"),
    ("frequency_penalty", 3, ValueError, r"in \[-2, 2\]"),
    ("frequency_penalty", -math.inf, ValueError, r"in \[-2, 2\]"),
    ("repetition_penalty", "1", TypeError, "number"),
    ("repetition_penalty", 0.0, ValueError, "finite and > 0"),
    ("repetition_penalty", -1.5, ValueError, "finite and > 0"),
    ("repetition_penalty", math.inf, ValueError, "finite and > 0"),
    ("repetition_penalty", math.nan, ValueError, "finite and > 0"),
    ("min_tokens", 1.0, TypeError, "int"),
    ("min_tokens", False, TypeError, "int"),
    ("min_tokens", -1, ValueError, r"in \[0, max_tokens\]"),
    ("min_tokens", 17, ValueError, r"in \[0, max_tokens\] = \[0, 16\]"),
])
def test_new_fields_are_validated(field: str, value: object, error: type[Exception],
                                  expected: str) -> None:
    with pytest.raises(error, match=rf"SamplingParams\.{field} must be .*{expected}") as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value) or str(value) in str(info.value)
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(error, match=field):
        params.validate()  # as LLM.generate re-checks a changed object


def test_new_fields_accept_their_bounds() -> None:
    for value in (-2, 2, 0, np.float32(1.5)):
        p = SamplingParams(presence_penalty=value, frequency_penalty=value)
        assert type(p.presence_penalty) is float and type(p.frequency_penalty) is float
    assert SamplingParams(repetition_penalty=1e-6).repetition_penalty == 1e-6
    assert SamplingParams(max_tokens=5, min_tokens=np.int64(5)).min_tokens == 5
    defaults = SamplingParams()
    assert (defaults.min_tokens, defaults.presence_penalty, defaults.frequency_penalty,
            defaults.repetition_penalty) == (0, 0.0, 0.0, 1.0)
    assert not defaults.has_penalties


# -- the engine --

OPTIONS = dict(num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
               enable_prefix_caching=False)
# On the GPU: the penalties' device path (pinned copies, scatters) and CUDA graphs.
DEVICES = {"cpu": dict(device="cpu", block_size=4),
           "cuda": dict(device="cuda", block_size=16, dtype=torch.float32)}


@pytest.fixture(scope="module", params=[
    "cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def engines(request, tmp_path_factory) -> dict[bool, LLM]:
    # The random tiny model: its greedy outputs loop, which the tests below need.
    path = str(write_tiny_checkpoint(tmp_path_factory.mktemp("random_tiny")))
    options = {**OPTIONS, **DEVICES[request.param]}
    return {ahead: LLM(path, async_scheduling=ahead, **options) for ahead in (False, True)}


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """generate(); with async scheduling, also that ahead steps were planned."""
    with ahead_steps(llm) as sizes:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert bool(sizes) == llm.async_scheduling
    return [out.outputs[0] for out in outs]


def repeating_prompt(llm: LLM, rng: random.Random, max_tokens: int) -> list[int]:
    """A random prompt whose unpenalised greedy continuation repeats a token."""
    vocab = llm.config.vocab_size
    for _ in range(40):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 8))]
        greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        if len(set(out)) < len(out):
            return prompt
    raise AssertionError("no random prompt repeats: the test needs a model that loops")


@pytest.mark.parametrize("ahead", [False, True])
def test_engine_large_repetition_penalty_stops_repeats(engines, ahead: bool) -> None:
    llm = engines[ahead]
    rng = random.Random(11 + ahead)
    prompts = [repeating_prompt(llm, rng, 16) for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    penalised = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                               repetition_penalty=1e4)
    outs = run(llm, [prompts[0], prompts[0], prompts[1], prompts[1]],
               [greedy, penalised, penalised, greedy])
    assert len(set(outs[0].token_ids)) < 16 and len(set(outs[3].token_ids)) < 16
    for out in outs[1:3]:
        assert len(out.token_ids) == 16 and len(set(out.token_ids)) == 16


@pytest.mark.parametrize("ahead", [False, True])
def test_engine_frequency_and_presence_penalties_match_the_reference(engines, ahead) -> None:
    """Greedy tokens against a float64 re-ranking of the step's raw logprobs (penalties
    shift the logits per token, so the log-softmax's argmax after them is the same)."""
    llm = engines[ahead]
    vocab = llm.config.vocab_size
    rng = random.Random(23 + ahead)
    prompts = [repeating_prompt(llm, rng, 24) for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=vocab,
                             frequency_penalty=rng.uniform(0.5, 2.0) * (i != 1),
                             presence_penalty=rng.uniform(-1, 2) * (i != 2))
              for i in range(4)]
    moved = 0
    for out, p in zip(run(llm, prompts, params), params, strict=True):
        assert len(out.token_ids) == 24
        for step, token in enumerate(out.token_ids):
            raw = np.full(vocab, -math.inf)
            for t, value in out.logprobs[step].items():
                raw[t] = value
            x = reference_logits(raw, [], out.token_ids[:step], p, None)
            want = clear_argmax(x, 1e-4)
            if want is not None:
                assert token == want, (step, p)
                moved += want != int(np.argmax(raw))
    assert moved >= 4


@pytest.mark.parametrize("ahead", [False, True])
def test_engine_min_tokens_holds_back_the_stop_token(engines, ahead: bool) -> None:
    llm = engines[ahead]
    vocab = llm.config.vocab_size
    rng = random.Random(37 + ahead)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(3)]
    firsts = [out.outputs[0].token_ids[0] for out in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)]
    stop_params = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first])
                   for first in firsts]
    for out in run(llm, prompts, stop_params):  # without min_tokens: stops at once
        assert out.token_ids == out.token_ids[:1] and out.finish_reason == "stop"
    held = [SamplingParams(temperature=0.0, max_tokens=12, min_tokens=3, logprobs=vocab,
                           stop_token_ids=[first, llm.scheduler.eos_token_id])
            for first in firsts]
    for out, first, p in zip(run(llm, prompts, held), firsts, held, strict=True):
        assert len(out.token_ids) >= 3
        assert first not in out.token_ids[:3]
        assert llm.scheduler.eos_token_id not in out.token_ids[:3]
        # The first token is the raw logprobs' best but for the held-back ones.
        ranked = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1])
        allowed = [t for t, _ in ranked if t not in p.stop_token_ids]
        assert out.token_ids[0] == allowed[0]
        assert out.finish_reason == "stop" or len(out.token_ids) == 12


def test_engine_async_matches_sync_with_penalties_and_seeds(engines) -> None:
    vocab = engines[False].config.vocab_size
    rng = random.Random(51)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(6)]
    kinds = ["all", "repetition", "presence", "min_tokens", "none", "frequency"]
    params = [random_params(rng, kind, vocab, max_tokens=rng.randint(4, 14),
                            temperature=rng.choice([0.0, 0.9]))
              for kind in kinds]
    for i, p in enumerate(params):
        p.seed = 1000 + i
        p.logprobs = 1
    sync, ahead = (run(engines[a], prompts, params) for a in (False, True))
    for a, b in zip(sync, ahead, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
