"""Steps run as pieces around attention (PiecewiseGraphs) give what whole steps give.

On the CPU the pieces are called instead of replayed, which checks everything but the
capture itself: the static buffers crossing each attention, the padding of T up to a
bucket, the eager fallback above the largest bucket. On a GPU the engine captures them
(tests/test_cuda_graph.py compares graph engines, pieces included, with eager ones).
"""

from __future__ import annotations

import pytest
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.piecewise import MAX_TOKENS, PiecewiseGraphs, token_buckets

GREEDY = SamplingParams(temperature=0.0, max_tokens=7, logprobs=1, ignore_eos=True)
OPTIONS = dict(dtype=torch.float32, device="cpu", block_size=8, num_kv_blocks=64,
               max_num_batched_tokens=40)


def test_token_buckets() -> None:
    assert token_buckets(1) == [16]
    assert token_buckets(16) == [16]
    assert token_buckets(40) == [16, 32, 64]
    assert token_buckets(1 << 20)[-1] == MAX_TOKENS


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, 259, (24,), generator=gen).tolist()
    lengths = (1, 5, 13, 31, 70, 9)
    fresh = [torch.randint(0, 259, (n,), generator=gen).tolist() for n in lengths]
    # Shared prefixes: later prompts start from cached blocks (context, no recompute).
    return [*fresh, prefix + fresh[1], prefix + fresh[3]]


@pytest.mark.parametrize("buckets", [token_buckets(40), [16]])
def test_pieces_match_whole_steps(buckets: list[int]) -> None:
    """Greedy tokens identical and logprobs within 1e-4 (float32: padded GEMMs may sum in
    another order). The 40-token budget makes mixed and chunked steps of 1-40 tokens;
    with buckets [16] the larger ones fall back to whole eager steps."""
    prompts = _prompts()
    reference = LLM("tiny", **OPTIONS)
    expected = [reference.generate(prompts, GREEDY, use_tqdm=False) for _ in range(2)]

    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, buckets)
    llm.runner.pieces = pieces
    sizes: list[int] = []
    run = pieces.run

    def counted(token_ids, *args):
        sizes.append(token_ids.shape[0])
        return run(token_ids, *args)

    pieces.run = counted
    outputs = [llm.generate(prompts, GREEDY, use_tqdm=False) for _ in range(2)]
    assert sizes and all(n <= buckets[-1] for n in sizes)
    assert any(n not in buckets for n in sizes)  # padded steps ran
    assert llm.stats.steps > len(sizes) or buckets[-1] >= OPTIONS["max_num_batched_tokens"]
    for ref_set, out_set in zip(expected, outputs, strict=True):
        for ref, out in zip(ref_set, out_set, strict=True):
            want, got = ref.outputs[0], out.outputs[0]
            assert got.token_ids == want.token_ids
            for token, a, b in zip(got.token_ids, want.logprobs, got.logprobs, strict=True):
                assert abs(a[token] - b[token]) <= 1e-4


def test_more_tokens_than_the_largest_bucket_is_an_error() -> None:
    llm = LLM("tiny", **OPTIONS)
    pieces = PiecewiseGraphs(llm.model, llm.caches, [16])
    with pytest.raises(ValueError, match="largest bucket"):
        pieces.run(torch.zeros(17, dtype=torch.int64), torch.zeros(17, dtype=torch.int64),
                   None, [0])
