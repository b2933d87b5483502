"""Sampler: greedy, top-k, top-p, temperature, per-request seeds, logprobs, rows whose
logits are not finite."""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.engine.sampler import draw, sample
from pagedmla.engine.sampling_params import GREEDY_TEMPERATURE, SamplingParams

NUM_DRAWS = 4000  # rows of one batch; frequency tolerances below are ~4 standard deviations


@pytest.fixture(autouse=True)
def fixed_global_seed() -> None:
    """Unseeded rows draw from torch's global generator: fix it so no test is flaky."""
    torch.manual_seed(1234)


def draw_many(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sample one distribution NUM_DRAWS times in a single batch."""
    logits = logits_row.expand(NUM_DRAWS, -1).contiguous()
    tokens, _ = sample(logits, [params] * NUM_DRAWS, [None] * NUM_DRAWS)
    return tokens


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_greedy_is_argmax_whatever_the_filters() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [
        SamplingParams(temperature=0.0, top_k=k, top_p=p) for k in (-1, 3) for p in (1, 0.2, 0.9)
    ]
    tokens, logprobs = sample(logits, params, [None] * 6)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert logprobs == [{}] * 6


def test_top_k_one_is_greedy_even_with_ties() -> None:
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1.0  # exact tie: lowest id wins, as argmax
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 10.0)] * 2
    tokens, _ = sample(logits, params, [None] * 8)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert tokens[0].item() == 5


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 30)
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.0)]
    params.append(SamplingParams(top_p=0.5))
    tokens, _ = sample(logits, params, [None] * 4)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()
    # 0.5 < 0.7 <= 0.5 + 0.3: the nucleus is {1, 3}, renormalised to 0.625 / 0.375.
    freq = frequencies(draw_many(logits, SamplingParams(top_p=0.7)), 4)
    assert freq[0] == 0 and freq[2] == 0
    assert abs(freq[1].item() - 0.625) < 0.03
    # Just above 0.8 the third token joins.
    freq = frequencies(draw_many(logits, SamplingParams(top_p=0.85)), 4)
    assert freq[0] == 0 and freq[2] > 0
    assert abs(freq[2].item() - 0.15 / 0.95) < 0.03
    # A tiny top_p still keeps the most likely token.
    assert torch.all(draw_many(logits, SamplingParams(top_p=1e-6)) == 1)


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    freq = frequencies(draw_many(logits, SamplingParams(top_k=2)), 4)
    assert freq[0] == 0 and freq[2] == 0
    assert abs(freq[1].item() - 0.625) < 0.03


def test_top_k_then_top_p_on_the_renormalised_distribution() -> None:
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()
    # top_k=3 renormalises to 0.5/0.95, 0.3/0.95, 0.15/0.95; top_p=0.6 then keeps {1, 3}.
    freq = frequencies(draw_many(logits, SamplingParams(top_k=3, top_p=0.6)), 4)
    assert freq[0] == 0 and freq[2] == 0 and freq[3] > 0


def test_temperature_scales_the_distribution() -> None:
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    for temperature in (0.5, 1.0, 3.0):
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        freq = frequencies(draw_many(logits, SamplingParams(temperature=temperature)), 5)
        assert torch.allclose(freq, expected, atol=0.035), (temperature, freq, expected)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_seeded_requests_do_not_depend_on_the_batch() -> None:
    torch.manual_seed(3)
    vocab = 1000
    row = torch.randn(vocab) * 0.1  # nearly flat: every draw depends on the noise
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123)

    alone_gen = seeded(123)
    alone = [sample(row[None], [params], [alone_gen])[0].item() for _ in range(6)]

    others = torch.randn(4, vocab)
    batch_gen = seeded(123)
    in_batch = []
    for step in range(6):
        torch.manual_seed(100 + step)  # the unseeded rows' noise changes from run to run
        logits = torch.cat([others[:2], row[None], others[2:]])
        batch_params = [SamplingParams(), SamplingParams(temperature=0.0), params]
        batch_params += [SamplingParams(top_k=5), SamplingParams(seed=7)]
        gens = [None, None, batch_gen, None, seeded(7 + step)]
        in_batch.append(sample(logits, batch_params, gens)[0][2].item())
    assert in_batch == alone

    other_seed = seeded(124)
    assert [sample(row[None], [params], [other_seed])[0].item() for _ in range(6)] != alone


def test_logprobs_are_raw_log_softmax_with_the_sampled_token() -> None:
    torch.manual_seed(4)
    vocab = 20
    logits = torch.randn(5, vocab)
    raw = torch.log_softmax(logits.double(), dim=-1)
    params = [
        SamplingParams(temperature=0.7, top_k=3, logprobs=vocab),
        SamplingParams(temperature=2.0, logprobs=3),
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(logprobs=None),
        SamplingParams(temperature=5.0, top_p=0.3, logprobs=1),
    ]
    tokens, logprobs = sample(logits, params, [None] * 5)
    full = logprobs[0]
    assert len(full) == vocab
    assert math.isclose(sum(math.exp(v) for v in full.values()), 1.0, rel_tol=1e-5)
    for row, (entries, p) in enumerate(zip(logprobs, params, strict=True)):
        if p.logprobs is None:
            assert entries == {}
            continue
        token = tokens[row].item()
        assert token in entries
        top = raw[row].topk(p.logprobs).indices.tolist()
        assert set(entries) == {*top, token}
        for token_id, value in entries.items():
            assert math.isclose(value, raw[row, token_id].item(), abs_tol=1e-5)
    assert logprobs[2] == {tokens[2].item(): pytest.approx(raw[2].max().item(), abs=1e-5)}


def test_rejects_mismatched_inputs() -> None:
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample(torch.zeros(4), [SamplingParams()], [None])
    with pytest.raises(ValueError, match="one SamplingParams and one generator per row"):
        sample(torch.zeros(2, 4), [SamplingParams()], [None, None])


def test_rows_whose_largest_logit_is_not_finite_are_flagged() -> None:
    vocab = 11
    logits = torch.randn(6, vocab)
    logits[0, 3] = math.nan  # a NaN anywhere
    logits[1, 7] = math.inf
    logits[2] = -math.inf  # nothing to sample from
    logits[3, :5] = -math.inf  # some tokens masked: still a distribution
    logits[4, 2] = -math.nan
    params = [SamplingParams(temperature=t, max_tokens=1) for t in (0.0, 0.0, 1.0, 1.0, 0.7, 0.0)]
    drawn = draw(logits, params, [None] * 6)
    token_ids, _, finite = drawn.result()
    assert finite == [False, False, False, True, False, True]
    assert token_ids[5] == int(logits[5].argmax())
    assert 5 <= token_ids[3] < vocab  # sampled among the unmasked tokens


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, 1e-6])
def test_temperatures_below_the_greedy_threshold_are_greedy(temperature: float) -> None:
    assert temperature < GREEDY_TEMPERATURE
    logits = torch.randn(4, 50) * 30
    params = [SamplingParams(temperature=temperature, max_tokens=1, seed=s) for s in range(4)]
    token_ids, _, finite = draw(logits, params, [seeded(s) for s in range(4)]).result()
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert all(finite)


def test_the_greedy_threshold_itself_samples() -> None:
    # Flat logits: a sampled row differs from argmax (token 0) almost surely over 64 rows.
    logits = torch.zeros(64, 100)
    params = [SamplingParams(temperature=GREEDY_TEMPERATURE, max_tokens=1)] * 64
    token_ids, _, _ = draw(logits, params, [None] * 64).result()
    assert any(token != 0 for token in token_ids)
