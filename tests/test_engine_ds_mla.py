"""The engine with an fp8_ds_mla cache (`LLM(..., kv_cache_dtype="fp8_ds_mla")`, CPU,
reference backend) on a tiny float32 DeepSeek-V3 checkpoint of DeepSeek's latent widths
(L = 512, R = 64), against Hugging Face transformers teacher-forced on our tokens, as
tests/test_engine_parity.py checks the engine with a float32 cache (within 2e-3 there).

Tolerance. e4m3 keeps three mantissa bits: a cached latent is off by up to 2^-4 of
itself, and to first order so is what attention reads from it; tokens may therefore
differ from the float32 model's and logprobs are compared, not tokens. The per-tensor
fp8 cache rounds each latent the same way (scale 1 suits these N(0, 1) latents), so it
calibrates the bound: over the generated tokens, the fp8_ds_mla cache's median logprob
error must stay within 1.5x the fp8 cache's (+0.01) and below 0.05 nats (measured
0.016-0.037 for both caches over five prompt sets, with and without chunking), its
worst below 2.5 nats (measured up to 1.55, and 1.0 for the fp8 cache: the rare step
where two logits nearly tie amplifies the rounding, which makes the mean and the worst
poor calibrators). A misread entry (a wrong scale, field or offset) moves the typical
logprob by several nats.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pagedmla import LLM, SamplingParams
from tests.tiny_hf import hf_logprobs, make_hf_model, save_hf_checkpoint

PROMPT_LENS = [3, 17, 40, 9, 64]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
MEDIAN_TOL, WORST_TOL = 0.05, 2.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_model("v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2,
                       q_lora_rank=24, rope_interleave=True, n_group=4, topk_group=2)
    return hf, str(save_hf_checkpoint(hf, tmp_path_factory.mktemp("ds_mla")))


def _prompts(lens: list[int], seed: int, shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, 97, (shared_prefix,), generator=gen).tolist()
    return [prefix + torch.randint(0, 97, (n,), generator=gen).tolist() for n in lens]


def _llm(path: str, kv_cache_dtype: str = "fp8_ds_mla", **kwargs) -> LLM:
    options = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=128,
                   kv_cache_dtype=kv_cache_dtype)
    options.update(kwargs)
    return LLM(model=path, **options)


def _errors(hf, prompts: list[list[int]], outputs, max_tokens: int) -> torch.Tensor:
    """|our logprob - transformers' logprob| of every generated token, transformers run
    on prompt + our tokens."""
    errors = []
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        assert len(completion.token_ids) == len(completion.logprobs) == max_tokens
        ref = hf_logprobs(hf, prompt + completion.token_ids)
        for i, (token, step) in enumerate(zip(completion.token_ids, completion.logprobs)):
            errors.append(abs(step[token] - float(ref[len(prompt) - 1 + i, token])))
    return torch.tensor(errors)


def _check(hf, path: str, prompts: list[list[int]], llm: LLM, outputs,
           params: SamplingParams = GREEDY) -> None:
    """The bounds of the module docstring, the fp8 cache run on the same prompts."""
    ours = _errors(hf, prompts, outputs, params.max_tokens)
    fp8 = _errors(hf, prompts, _llm(path, "fp8").generate(prompts, params, use_tqdm=False),
                  params.max_tokens)
    assert ours.median() <= min(MEDIAN_TOL, 1.5 * fp8.median() + 0.01), (
        ours.median(), fp8.median())
    assert ours.max() <= WORST_TOL, ours.max()
    assert all(c.data.dtype == torch.uint8 and c.data.shape[-1] == 656 for c in llm.caches)


def test_batch_and_memory_report(checkpoint) -> None:
    hf, path = checkpoint
    llm = _llm(path)
    prompts = _prompts(PROMPT_LENS, seed=1)
    _check(hf, path, prompts, llm, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert "fp8_ds_mla, 656 bytes per token and layer" in str(llm.memory)
    assert llm.memory.kv_cache_bytes == 128 * 8 * 656 * 2  # blocks x page x entry x layers


def test_chunked_prefill_small_budget_and_workspace(checkpoint) -> None:
    """Prompts over several steps (16 tokens a step), contexts gathered in 16-row chunks."""
    hf, path = checkpoint
    llm = _llm(path, max_num_batched_tokens=16, workspace_rows=16)
    prompts = _prompts(PROMPT_LENS, seed=2)
    _check(hf, path, prompts, llm, llm.generate(prompts, GREEDY, use_tqdm=False))
    assert llm.stats.steps > 10


def test_prefix_caching(checkpoint) -> None:
    """A 27-token prefix written once and read back by the later prompts."""
    hf, path = checkpoint
    llm = _llm(path)
    prompts = _prompts([5, 11, 2], seed=3, shared_prefix=27)
    outputs = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    outputs += llm.generate(prompts[1:], GREEDY, use_tqdm=False)
    _check(hf, path, prompts, llm, outputs)
    assert llm.stats.prefill_tokens < sum(len(p) for p in prompts[1:])


def test_preemption_by_recompute(checkpoint) -> None:
    """15 usable 8-token blocks cannot hold the five requests at once."""
    hf, path = checkpoint
    llm = _llm(path, num_kv_blocks=16, enable_prefix_caching=False)
    prompts = _prompts(PROMPT_LENS, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    _check(hf, path, prompts, llm, llm.generate(prompts, params, use_tqdm=False), params)
    assert llm.stats.preemptions > 0


def test_other_widths_refused_before_loading() -> None:
    # The built-in tiny model has L = 64, R = 16.
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_ds_mla'.*kv_lora_rank 64"):
        LLM("tiny", dtype=torch.float32, device="cpu", kv_cache_dtype="fp8_ds_mla")
