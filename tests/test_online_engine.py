"""The online engine (`OnlineEngine`): requests added while others run, streamed,
aborted, stopped by stop strings, n completions; checked against offline
`LLM.generate` on a second LLM of the same model, and against the text of the tokens
(incremental detokenization)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.detokenize import IncrementalDetokenizer, find_stop
from pagedmla.engine.online import OnlineEngine
from pagedmla.engine.outputs import EngineStats
from pagedmla.tokenizer import ByteTokenizer, FileTokenizer

OPTIONS = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4,
           "max_num_batched_tokens": 32}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


_GPU = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                             reason="needs a CUDA GPU")]


@pytest.fixture(scope="module", params=[
    ("cpu", False), ("cpu", True),
    pytest.param(("cuda", False), marks=_GPU), pytest.param(("cuda", True), marks=_GPU)],
    ids=["sync", "async", "cuda-sync", "cuda-async"])
def llms(request) -> tuple[LLM, LLM]:
    """An LLM for the online engine and one for offline generate, same model (on the
    GPU: float32, CUDA graphs)."""
    device, ahead = request.param
    options = {**OPTIONS, "device": device, "dtype": torch.float32, "async_scheduling": ahead}
    return LLM("tiny", **options), LLM("tiny", **options)


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    return [[rng.randrange(3, 259) for _ in range(rng.randint(3, 40))] for _ in range(count)]


def _collect(engine: OnlineEngine, prompt, params: SamplingParams) -> list:
    return list(engine.stream(prompt, params))


def _assert_idle(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished()
    manager = llm.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_requests_added_while_others_run_match_offline(llms) -> None:
    online_llm, offline = llms
    rng = random.Random(1)
    prompts = _prompts(rng, 7)
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 14), ignore_eos=True)
              for _ in prompts]
    want = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    results: dict[int, list] = {}
    with OnlineEngine(online_llm) as engine:
        threads = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            thread = threading.Thread(target=lambda i=i, prompt=prompt, p=p: results.__setitem__(
                i, _collect(engine, prompt, p)))
            thread.start()
            threads.append(thread)
            time.sleep(rng.random() * 0.02)  # arrivals while earlier requests run
        for thread in threads:
            thread.join()
    assert len(results) == len(prompts)  # no thread failed
    for i, outs in results.items():
        assert [t for out in outs for t in out.token_ids] == want[i]
        assert [out.finish_reason for out in outs][:-1] == [None] * (len(outs) - 1)
        assert outs[-1].finish_reason == "length"
    _assert_idle(online_llm)


def test_streamed_text_is_the_text_of_the_tokens(llms) -> None:
    online_llm, _ = llms
    tokenizer = online_llm.tokenizer
    with OnlineEngine(online_llm) as engine:
        outs = _collect(engine, "Multi-head latent attention", GREEDY)
    ids = [t for out in outs for t in out.token_ids]
    assert "".join(out.text for out in outs) == tokenizer.decode(ids)
    assert len(ids) == GREEDY.max_tokens


def test_abort_frees_the_blocks_and_the_engine_goes_on(llms) -> None:
    online_llm, offline = llms
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    prompt = list(range(3, 60))
    with OnlineEngine(online_llm) as engine:
        first = threading.Event()
        outs: list = []

        def record(out) -> None:
            outs.append(out)
            first.set()

        request_id = engine.add(prompt, long, record)
        assert first.wait(30)
        engine.abort(request_id)
        follow = _collect(engine, [5, 6, 7], GREEDY)
        deadline = time.time() + 30
        while not (outs and outs[-1].finish_reason) and time.time() < deadline:
            time.sleep(0.01)
        assert outs[-1].finish_reason == "abort"
        assert sum(len(o.token_ids) for o in outs) < 400
    want = offline.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for out in follow for t in out.token_ids] == want
    _assert_idle(online_llm)


def test_a_stop_string_ends_the_text_before_it(llms) -> None:
    online_llm, offline = llms
    prompt = "The paged latent cache"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    rng = random.Random(2)
    start = rng.randrange(4, len(full) - 4)
    stop = full[start:start + 3]
    cut = full.find(stop)
    with OnlineEngine(online_llm) as engine:
        outs = _collect(engine, prompt, SamplingParams(
            temperature=0.0, max_tokens=24, ignore_eos=True, stop=["\x00never", stop]))
    assert "".join(out.text for out in outs) == full[:cut]
    assert outs[-1].finish_reason == "stop"
    assert all(out.finish_reason is None for out in outs[:-1])
    _assert_idle(online_llm)


def test_n_completions_share_the_prompt_and_draw_apart(llms) -> None:
    online_llm, _ = llms
    # Three full blocks of 16 and one token, in no other test's prompts.
    prompt = [258 - (i * 5) % 97 for i in range(49)]
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=7)
    online_llm.stats = EngineStats()
    with OnlineEngine(online_llm) as engine:
        outs = _collect(engine, prompt, params)
        # The other two completions found the first one's three blocks in the cache.
        assert online_llm.stats.prefill_tokens == 49 + 2
        again = _collect(engine, prompt, params)
    tokens = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
    assert all(len(t) == 10 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) == 3  # seeds seed, seed + 1, seed + 2
    assert tokens == {i: [t for o in again if o.index == i for t in o.token_ids]
                      for i in range(3)}
    _assert_idle(online_llm)


def test_a_bad_request_is_refused_before_queueing(llms) -> None:
    online_llm, offline = llms
    with OnlineEngine(online_llm) as engine:
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add([3] * 10, SamplingParams(max_tokens=online_llm.max_model_len))
        with pytest.raises(TypeError):
            engine.add(3.5, GREEDY)  # type: ignore[arg-type]
        got = _collect(engine, [9, 8, 7, 6], GREEDY)
    want = offline.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for out in got for t in out.token_ids] == want


def _bpe(kind: str) -> FileTokenizer:
    """A BPE tokenizer with merges, trained here on the README: byte-level (as DeepSeek's)
    or SentencePiece-style (Metaspace: a token's leading space dropped at a decode's start)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if kind == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<s>", "</s>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    readme = Path(__file__).resolve().parents[1] / "README.md"
    tok.train_from_iterator([readme.read_text(encoding="utf-8")], trainer)
    return FileTokenizer(tok, None, None)


@pytest.mark.parametrize("kind", ["bytes", "tokenizers", "bpe-bytelevel", "bpe-metaspace"])
def test_incremental_detokenizer_matches_decoding_the_whole(kind) -> None:
    tokenizer = {"bytes": ByteTokenizer,
                 "tokenizers": lambda: FileTokenizer(ByteTokenizer().to_tokenizers(), 1, 2),
                 "bpe-bytelevel": lambda: _bpe("bytelevel"),
                 "bpe-metaspace": lambda: _bpe("metaspace")}[kind]()
    rng = random.Random(3)
    words = ["a", "é", "ß", "→", " ", "\n", "語", "😀", " the", " cache", "latent", " MLA"]
    text = "".join(rng.choice(words) for _ in range(300))
    if kind == "bpe-metaspace":  # its alphabet is the README's characters only
        text = "".join(rng.choice([" the", " cache", "latent", " MLA", "s", " "])
                       for _ in range(300))
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = []
    at = 0
    while at < len(ids):
        step = rng.randint(1, 3)
        pieces.append(detok.add(ids[at:at + step]))
        assert "\ufffd" not in pieces[-1]
        at += step
    pieces.append(detok.flush())
    # The whole decode, which for SentencePiece-style tokenizers drops the text's first
    # space; the others give the text back.
    assert "".join(pieces) == tokenizer.decode(ids) == detok.text
    assert kind == "bpe-metaspace" or detok.text == text


def test_find_stop_finds_the_earliest_new_match() -> None:
    assert find_stop("abcSTOPdefEND", ["END", "STOP"], 0) == 3
    assert find_stop("abcSTOPdefEND", ["END"], 11) == 10  # a match across the old end
    assert find_stop("abcdef", ["x"], 0) == -1


def test_generate_offline_takes_n_and_stop_strings(llms) -> None:
    _, offline = llms
    prompt = "Multi-head latent attention"
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    cut = full.text.find(stop)
    out = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, n=2,
                                                    ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0]
    assert [c.text for c in out.outputs] == [full.text[:cut]] * 2
    assert [c.finish_reason for c in out.outputs] == ["stop", "stop"]
    # The token ids end with the token that completed the stop string.
    ids = out.outputs[0].token_ids
    assert ids == full.token_ids[:len(ids)]
    assert stop in offline.tokenizer.decode(ids) and stop not in offline.tokenizer.decode(ids[:-1])
    _assert_idle(offline)


def test_a_failed_step_fails_its_requests_and_the_next_runs_as_fresh(llms, monkeypatch) -> None:
    online_llm, offline = llms
    launch = online_llm.launch
    calls = {"n": 0}

    def failing_launch(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return launch(*args, **kwargs)

    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with OnlineEngine(online_llm) as engine:
        monkeypatch.setattr(online_llm, "launch", failing_launch)
        failed = _collect(engine, [11, 12, 13], long)
        monkeypatch.setattr(online_llm, "launch", launch)
        assert failed[-1].finish_reason == "error" and "injected" in failed[-1].error
        _assert_idle(online_llm)
        got = _collect(engine, [9, 8, 7, 6], GREEDY)
    want = offline.generate([[9, 8, 7, 6]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert [t for out in got for t in out.token_ids] == want


def test_stop_strings_count_only_from_min_tokens_on(llms) -> None:
    online_llm, offline = llms
    prompt = "MLA (DeepSeek-V2) caches"
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    full = offline.generate([prompt], base, use_tqdm=False)[0].outputs[0].text
    stop = full[1:3]  # in the text of the first few tokens
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                            min_tokens=8)
    offline_text = offline.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    with OnlineEngine(online_llm) as engine:
        online_text = "".join(o.text for o in _collect(engine, prompt, params))
    assert online_text == offline_text
    # A match is looked for once 8 tokens are out, in text past the first 7 tokens' (one
    # byte, one character each here): one that ends inside those 7 does not count.
    assert full[:8].isascii()
    after = full.find(stop, 7 - len(stop) + 1)
    assert offline_text == (full[:after] if after != -1 else full)


def test_a_top_k_past_the_vocabulary_keeps_every_token(llms) -> None:
    _, offline = llms
    outs = offline.generate([[5, 6], [7, 8]], [
        SamplingParams(top_k=10**20, max_tokens=4, seed=1, ignore_eos=True),
        SamplingParams(max_tokens=4, seed=1, ignore_eos=True)], use_tqdm=False)
    assert outs[0].outputs[0].token_ids and outs[0].outputs[0].finish_reason == "length"
    # The same draw as with top_k off (seeded, so the other row does not matter).
    again = offline.generate([[5, 6]], SamplingParams(max_tokens=4, seed=1, ignore_eos=True),
                             use_tqdm=False)
    assert outs[0].outputs[0].token_ids == again[0].outputs[0].token_ids
