"""The engine with asynchronous scheduling against the synchronous engine, end to end.

Random workloads on the built-in tiny model (float32, CPU, reference backend): a few
prompts of random lengths, random max_tokens, stop tokens taken from what the model
generates (so that rows stop one step before the host learns it) and a cache small
enough to preempt. Both engines must give the same tokens, finish reasons and logprobs.
Prefix caching is off so that the two engines' block choices, which differ once an
ahead step allocates a block for a row that then stops, cannot change what is computed.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedmla import LLM, SamplingParams
from tests.engine_helpers import ahead_steps

OPTIONS = dict(device="cpu", block_size=4, num_kv_blocks=10, max_num_seqs=4,
               max_num_batched_tokens=16, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {ahead: LLM("tiny", async_scheduling=ahead, **OPTIONS) for ahead in (False, True)}


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_async_engine_matches_sync_on_random_workloads(engines, data) -> None:
    vocab = engines[False].config.vocab_size
    num = data.draw(st.integers(1, 6), label="requests")
    prompts = [data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=20))
               for _ in range(num)]
    params = [SamplingParams(temperature=0.0, logprobs=1, ignore_eos=data.draw(st.booleans()),
                             max_tokens=data.draw(st.integers(1, 10))) for _ in range(num)]
    probe = engines[False].generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(probe):
        tokens = out.outputs[0].token_ids
        if tokens and data.draw(st.booleans(), label="stop token"):
            stop = tokens[data.draw(st.integers(0, len(tokens) - 1))]
            params[i] = replace(params[i], stop_token_ids=[stop])
    sync = engines[False].generate(prompts, params, use_tqdm=False)
    with ahead_steps(engines[True]) as sizes:
        ahead = engines[True].generate(prompts, params, use_tqdm=False)
    event(f"ahead steps: {bool(sizes)}")
    event(f"preempted: {engines[True].stats.preemptions > 0}")
    for want, got in zip(sync, ahead, strict=True):
        a, b = want.outputs[0], got.outputs[0]
        assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
        for token, lp_a, lp_b in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
            assert abs(lp_a[token] - lp_b[token]) <= 1e-5
    for llm in engines.values():
        manager = llm.block_manager
        assert manager.num_free_blocks == manager.num_usable_blocks  # nothing leaked
        assert not llm.scheduler.has_unfinished()
