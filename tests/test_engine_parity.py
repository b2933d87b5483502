"""The engine (`LLM.generate`) against Hugging Face transformers on tiny checkpoints.

Each completion is checked teacher-forced: transformers runs prompt + generated tokens
once, and at every generated position its argmax must be our greedy token and its
log-probability of that token must match ours. float32 tolerance: 2e-3 per logprob
(observed ~1e-6; the slack covers summation-order differences across the stack).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from pagedmla import LLM, SamplingParams
from tests.engine_helpers import ahead_steps
from tests.tiny_hf import V3, hf_logprobs, make_hf_model, save_hf_checkpoint

LOGPROB_TOL = 2e-3
PROMPT_LENS = [3, 17, 40, 9, 64]


def _prompts(vocab: int, lens: list[int], seed: int, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens]


def _check_against_hf(hf, prompts, outputs, tol=LOGPROB_TOL, exact_tokens=True) -> float:
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        assert len(completion.token_ids) == len(completion.logprobs) > 0
        ref = hf_logprobs(hf, prompt + completion.token_ids)
        for i, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs,
                                              strict=True)):
            row = ref[len(prompt) - 1 + i]
            if exact_tokens:
                assert token == int(row.argmax()), f"step {i}: greedy token differs"
            worst = max(worst, abs(step[token] - float(row[token])))
    assert worst <= tol, f"logprob error {worst:.2e} > {tol}"
    return worst


@pytest.fixture(scope="module", params=["v3", "v2"])
def checkpoint(request, tmp_path_factory):
    overrides = (
        V3
        if request.param == "v3"
        else dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2)
    )
    hf = make_hf_model(request.param, **overrides)
    path = save_hf_checkpoint(hf, tmp_path_factory.mktemp(request.param))
    return hf, str(path)


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=128)
    options.update(kwargs)
    return LLM(model=path, **options)


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


def test_batch_of_prompts(checkpoint):
    hf, path = checkpoint
    prompts = _prompts(97, PROMPT_LENS, seed=1)
    _check_against_hf(hf, prompts, _llm(path).generate(prompts, GREEDY, use_tqdm=False))


def test_chunked_prefill_small_budget_and_workspace(checkpoint):
    """Prompts span several steps (token budget 16) and contexts several chunks (16 rows)."""
    hf, path = checkpoint
    llm = _llm(path, max_num_batched_tokens=16, workspace_rows=16)
    prompts = _prompts(97, PROMPT_LENS, seed=2)
    _check_against_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats.steps > 10


def test_prefix_caching_shared_prefix(checkpoint):
    hf, path = checkpoint
    llm = _llm(path)
    prompts = _prompts(97, [5, 11, 2], seed=3, shared_prefix=27)
    first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    hits_before = llm.block_manager.num_free_blocks
    rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    _check_against_hf(hf, prompts, first + rest)
    assert hits_before == llm.block_manager.num_free_blocks  # every block came back
    assert llm.stats.prefill_tokens < sum(len(p) for p in prompts[1:])  # the prefix was reused


def test_preemption_by_recompute(checkpoint):
    """A cache of 15 usable 8-token blocks cannot hold all five requests at once."""
    hf, path = checkpoint
    llm = _llm(path, num_kv_blocks=16, enable_prefix_caching=False)
    prompts = _prompts(97, PROMPT_LENS, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats.preemptions > 0
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    _check_against_hf(hf, prompts, outputs)


def test_fp8_kv_cache_logprobs_close(checkpoint):
    """fp8 latents perturb the logits: tokens may differ, so logprobs are compared only
    (teacher-forced on our tokens) with a loose tolerance."""
    hf, path = checkpoint
    llm = _llm(path, kv_cache_dtype="fp8")
    prompts = _prompts(97, PROMPT_LENS, seed=5)
    _check_against_hf(hf, prompts, llm.generate(prompts, GREEDY, use_tqdm=False), tol=0.25,
                      exact_tokens=False)


def test_sampling_seed_reproducible(checkpoint):
    _, path = checkpoint
    llm = _llm(path)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=8, seed=7)
    prompts = _prompts(97, [6, 30], seed=6)
    alone = llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    together = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together


def test_async_scheduling_matches_sync(checkpoint):
    """Steps planned ahead (their token ids read on the device) give the synchronous
    engine's completions, also when rows leave mid-flight: staggered max_tokens, and stop
    tokens that are only seen after the next step was launched."""
    hf, path = checkpoint
    prompts = _prompts(97, PROMPT_LENS, seed=7)
    params = [
        SamplingParams(temperature=0.0, max_tokens=m, logprobs=1, ignore_eos=True)
        for m in (3, 9, 5, 9, 7)
    ]
    probe = _llm(path, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    for row, index in ((1, 3), (3, 1)):  # stop on the token drawn at this index
        params[row] = replace(params[row], stop_token_ids=[probe[row].outputs[0].token_ids[index]])
    sync = _llm(path, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = _llm(path)
    with ahead_steps(llm) as ahead:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert len(ahead) >= 4 and len(set(ahead)) > 1  # ran ahead, with rows leaving
    for mine, theirs in zip(outputs, sync, strict=True):
        ours, ref = mine.outputs[0], theirs.outputs[0]
        assert ours.token_ids == ref.token_ids and ours.finish_reason == ref.finish_reason
        for step, ref_step in zip(ours.logprobs, ref.logprobs, strict=True):
            assert step.keys() == ref_step.keys()
            assert all(abs(step[t] - ref_step[t]) <= 1e-5 for t in step)
    assert [o.outputs[0].finish_reason for o in outputs].count("stop") == 2
    _check_against_hf(hf, prompts, outputs)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_usable_blocks


def test_async_scheduling_seeded_sampling_matches_sync(checkpoint):
    """Seeded random rows draw from their own generators: ahead or not, the same tokens."""
    _, path = checkpoint
    prompts = _prompts(97, [6, 30, 11], seed=8)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=11)
    sync = _llm(path, async_scheduling=False).generate(prompts, params, use_tqdm=False)
    llm = _llm(path)
    with ahead_steps(llm) as ahead:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert ahead
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in sync]
