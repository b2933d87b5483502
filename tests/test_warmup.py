"""The start-up warm-up (`engine/warmup.py`) and report (`engine/startup.py`).

On the CPU: the warm-up's cases and decode shapes stay inside the engine's limits, and an
engine after the warm-up answers exactly as a fresh one (tokens, logprobs, seeded and
unseeded sampling, request ids, an empty prefix cache). The kernels built after start-up
on a GPU are counted by `benchmarks/bench_startup.py` (`--fail-on-compile`).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagedmla import LLM, MLADims, MLAMetadataBuilder, SamplingParams
from pagedmla.engine.block_manager import BlockManager
from pagedmla.engine.sequence import Sequence
from pagedmla.engine.startup import StartupReport, use_compile_cache
from pagedmla.engine.warmup import run_cases, warmup_cases
from pagedmla.metadata import BatchSpec

LIMITS = dict(max_model_len=320, max_num_seqs=6, max_num_batched_tokens=48)
OPTIONS = dict(LIMITS, device="cpu", dtype=torch.float32, block_size=16, num_kv_blocks=200)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("max_model_len, max_num_seqs, budget, cache_tokens", [
    (8, 4, 16, 800), (33, 4, 16, 800), (320, 6, 48, 3200), (8192, 256, 8192, 10**6),
    (163840, 64, 2048, 40000)])
def test_cases_stay_inside_the_limits(max_model_len, max_num_seqs, budget, cache_tokens,
                                      prefix_caching) -> None:
    cases = warmup_cases(max_model_len, max_num_seqs, budget, prefix_caching, cache_tokens)
    assert any(len(c.lengths) == max_num_seqs for c in cases)
    assert any(c.prefix for c in cases) == prefix_caching
    for case in cases:
        max_tokens = case.params.max_tokens if case.params else case.max_tokens
        assert all(case.prefix + n + max_tokens <= max_model_len for n in case.lengths)
        # (Prefix caching shares the prefix's blocks between the prompts.)
        assert case.prefix + sum(case.lengths) <= cache_tokens // 2, case.name


def test_cases_of_one_prefix_length_share_the_prefix() -> None:
    calls: list[list[list[int]]] = []
    cases = warmup_cases(4096, 8, 4096, True, 10**6)
    run_cases(lambda prompts, params, use_tqdm: calls.append(prompts), cases, 250,
              show_progress=False)
    assert len(calls) == len(cases)
    seen: dict[int, list[int]] = {}
    for case, prompts in zip(cases, calls, strict=True):
        assert [len(p) - case.prefix for p in prompts] == case.lengths
        for prompt in prompts:
            assert seen.setdefault(case.prefix, prompt[:case.prefix]) == prompt[:case.prefix]
    assert sum(1 for c in cases if c.prefix == 256) >= 3  # a prefix, then its extends


def test_decode_bound_fixes_the_decode_rows_max_seq_len() -> None:
    """The engine's eager decode rows are planned for max_model_len, as its graphs are."""
    dims = MLADims(4, 64, 16, 16, 16)
    spec = BatchSpec(query_lens=[1, 2, 30], seq_lens=[40, 7, 30],
                     block_table=torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]],
                                              dtype=torch.int32),
                     slot_mapping=torch.tensor([39 + 16, 4 * 16 + 5, 4 * 16 + 6]
                                               + [5 * 16 + i for i in range(16)]
                                               + [6 * 16 + i for i in range(14)]))
    for bound, want in ((None, 40), (4096, 4096), (8, 40)):
        builder = MLAMetadataBuilder(dims, block_size=16, decode_threshold=2,
                                     decode_bound=bound)
        meta = builder.build(spec)
        assert meta.decode.max_seq_len == want
        assert meta.prefill is not None and meta.num_decode_tokens == 3


def _outputs(llm: LLM) -> list[tuple]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 40, 70, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=9, logprobs=3),
              SamplingParams(temperature=1.0, max_tokens=9),  # the engine's generator
              SamplingParams(temperature=0.9, top_k=5, seed=7, max_tokens=9),
              SamplingParams(temperature=0.0, max_tokens=9, presence_penalty=1.0)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.request_id, c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def test_an_engine_after_the_warmup_answers_as_a_fresh_one() -> None:
    fresh, warmed = LLM("tiny", **OPTIONS), LLM("tiny", **OPTIONS)
    warmed.warm_up(show_progress=False)
    manager = warmed.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    # The prompts the warm-up sent (the same random tokens: run_cases is seeded) are not
    # found in the prefix cache: they would be computed afresh.
    sent: list[list[int]] = []
    cases = warmup_cases(warmed.max_model_len, 6, 48, True,
                         manager.num_usable_blocks * manager.block_size)
    run_cases(lambda prompts, params, use_tqdm: sent.extend(prompts), cases,
              warmed.config.vocab_size, show_progress=False)
    long = [p for p in sent if len(p) >= 2 * manager.block_size]
    assert long
    assert all(manager.match_prefix(Sequence(0, p, SamplingParams())) == 0 for p in long)
    assert warmed.scheduler.num_preemptions == 0 and warmed.stats.steps == 0
    assert _outputs(warmed) == _outputs(fresh)
    assert warmed.stats.steps == fresh.stats.steps


def test_block_manager_reset_needs_every_block_free() -> None:
    manager = BlockManager(8, 4)
    seq = Sequence(0, [1, 2, 3, 4, 5], SamplingParams())
    manager.append_slots(seq, 5)
    with pytest.raises(ValueError, match="every block free"):
        manager.reset()
    manager.free(seq)
    manager.reset()
    assert manager.num_free_blocks == 7


def test_startup_report_and_compile_cache_dir(tmp_path, monkeypatch) -> None:
    # (setenv first: monkeypatch then restores the variable, which LLM() sets, as it was.)
    monkeypatch.setenv("TRITON_CACHE_DIR", "unset")
    monkeypatch.delenv("TRITON_CACHE_DIR")
    assert use_compile_cache(None).endswith(os.path.join(".triton", "cache"))
    llm = LLM("tiny", compile_cache_dir=tmp_path / "kernels", **OPTIONS)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "kernels")
    assert llm.startup.compile_cache_dir == str(tmp_path / "kernels")
    assert list(llm.startup.phases) == ["load", "kv_cache"]  # no graphs, no warm-up on CPU
    assert str(tmp_path / "kernels") in str(llm.startup)
    report = StartupReport({"load": 1.5, "warmup": 2.0}, 7, "/x")
    assert str(report) == ("start-up 3.5 s (load 1.5 s, warmup 2.0 s); 7 kernel variants "
                           "built; compiled kernels kept in /x")
    with pytest.raises(TypeError, match="compile_cache_dir"):
        LLM("tiny", compile_cache_dir=3, **OPTIONS)
    with pytest.raises(ValueError, match="compile_cache_dir"):
        LLM("tiny", compile_cache_dir="", **OPTIONS)
