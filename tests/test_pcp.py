"""Prefill context parallelism: the split of a step, and MLAAttention on 2 and 4 gloo
ranks against the float64 dense oracle.

Every rank of the layer test runs its share of one paged batch (`plan_shares`: two
chunks of each prompt, decodes on rank 0) over a cache that holds the context only
(every other slot NaN); its rows' outputs must match the oracle's rows, and after the
layer every rank's cache must hold every new token (the gathered write). With decode
context parallelism (2 x 2 ranks) each rank holds its DCP share of the cache and its
TP share of the heads. float32 tolerance as in test_attention_oracle.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import pytest
import torch

from pagedmla import LatentKVCache, MLAAttention, MLADims
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.dcp_metadata import DCPMetadataBuilder
from pagedmla.distributed.pcp import PrefillContextParallel, plan_shares
from pagedmla.distributed.state import ParallelState
from pagedmla.metadata import MLAMetadataBuilder
from pagedmla.testing import _bits, make_paged_batch, relative_error
from tests.dist_helpers import run_ranks, shard_cache

FLOAT32_TOL = 2e-4
DIMS = MLADims(num_heads=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16)


def _prefill_only(q: int, c: int) -> bool:
    return q <= 1


@pytest.mark.parametrize("size", [2, 3, 4])
def test_shares_cover_every_token_once_and_balance_the_causal_work(size: int) -> None:
    query_lens = [1, 1, 1000, 37, 1, 4 * size + 3]
    seq_lens = [5, 90, 1000, 300, 2, 4 * size + 3]
    shares = plan_shares(query_lens, seq_lens, size, _prefill_only)
    assert shares is not None and len(shares) == size
    seen = [[0] * q for q in query_lens]
    keys = [0] * size  # causal work: keys each query row attends to
    for rank, share in enumerate(shares):
        for b, a, e in share:
            assert 0 <= a < e <= query_lens[b]
            for i in range(a, e):
                seen[b][i] += 1
                keys[rank] += seq_lens[b] - query_lens[b] + i + 1
    assert all(count == 1 for row in seen for count in row)
    # Decodes run on rank 0, first; the last row of every prompt is rank 0's too.
    assert shares[0][:3] == [(0, 0, 1), (1, 0, 1), (4, 0, 1)]
    assert all(query_lens[b] > 1 for share in shares[1:] for b, _, _ in share)
    for b in (2, 3, 5):
        assert any(p[0] == b and p[2] == query_lens[b] for p in shares[0])
    # The 1000-token prompt dominates: every rank's causal work within 2% of the mean.
    mean = sum(keys) / size
    assert max(abs(k - mean) for k in keys) < 0.02 * mean, keys
    # Rank i holds chunks i and 2P - 1 - i of the long prompt (the middle ones merged).
    bounds = [k * 1000 // (2 * size) for k in range(2 * size + 1)]
    for rank, share in enumerate(shares):
        mine = sorted((a, e) for b, a, e in share if b == 2)
        chunks = sorted({rank, 2 * size - 1 - rank})
        if len(chunks) == 2 and chunks[1] == chunks[0] + 1:
            assert mine == [(bounds[chunks[0]], bounds[chunks[1] + 1])]
        else:
            assert mine == [(bounds[k], bounds[k + 1]) for k in chunks]


def test_steps_that_are_not_split() -> None:
    assert plan_shares([1, 1, 1], [4, 9, 2], 2, _prefill_only) is None  # decodes only
    # A 2-token prompt gives ranks 2 and 3 of 4 nothing: the step runs whole everywhere.
    assert plan_shares([2], [2], 4, _prefill_only) is None
    assert plan_shares([2], [2], 2, _prefill_only) == [[(0, 1, 2)], [(0, 0, 1)]]


def test_mqa_pieces_come_first_in_each_share() -> None:
    """A builder routes short pieces over long contexts to the MQA path; a rank's batch
    must list them before its MHA pieces."""
    def short_over_context(q: int, c: int) -> bool:
        return q <= 3 and c >= 8

    shares = plan_shares([1, 16], [10, 16], 2, short_over_context)
    assert shares is not None
    for share in shares:
        mqa = [short_over_context(e - a, [9, 0][b] + a) for b, a, e in share]
        assert mqa == sorted(mqa, reverse=True)


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    sample_rows: tuple[int, ...] = ()
    block_size: int = 4
    workspace_rows: int | None = None


CASES = [
    Case("prompts without context", [23, 9], [23, 9], sample_rows=(22, 31)),
    Case("decodes and prompts with context", [1, 1, 17, 30, 6], [7, 40, 29, 30, 50],
         sample_rows=(0, 1, 18, 48, 54)),
    # A workspace of a few rows: late chunks read earlier chunks' rows in many pieces.
    Case("chunked context", [1, 26, 11], [9, 60, 11], sample_rows=(0, 26, 37),
         workspace_rows=8),
]


def _run_case(state: ParallelState, case: Case, seed: int) -> tuple[float, int, float]:
    """(relative error of this rank's rows and heads, cache slots wrong, largest error of
    the gathered sample rows)."""
    D, tp = state.dcp_size, state.tp_size
    layout = DCPLayout(D, state.dcp_rank, 1, case.block_size)
    batch = make_paged_batch(DIMS, case.query_lens, case.seq_lens,
                             block_size=layout.virtual_block_size, seed=seed)
    heads = DIMS.num_heads // tp
    mine = slice(state.tp_rank * heads, (state.tp_rank + 1) * heads)
    dims = replace(DIMS, num_heads=heads)
    cache = LatentKVCache(batch.cache.num_blocks, case.block_size, DIMS.kv_lora_rank,
                          DIMS.qk_rope_head_dim, dtype=torch.float32)
    if D > 1:
        builder = DCPMetadataBuilder(dims, layout, state, workspace_rows=case.workspace_rows)
        cache.data.copy_(shard_cache(batch.cache.data, layout))
        local_slots = layout.local_slots
    else:
        builder = MLAMetadataBuilder(dims, case.block_size, workspace_rows=case.workspace_rows)
        cache.data.copy_(batch.cache.data)

        def local_slots(slots: torch.Tensor) -> torch.Tensor:
            return slots

    pcp = PrefillContextParallel(state, builder.uses_mqa, local_slots, torch.device("cpu"))
    step = pcp.plan(batch.spec, list(case.sample_rows))
    assert step is not None
    meta = builder.build(step.spec)
    meta.pcp = step.latents
    latent = DIMS.kv_lora_rank
    kv_b_proj = batch.kv_b_proj.view(DIMS.num_heads, -1, latent)[mine].reshape(-1, latent)
    attn = MLAAttention(dims, softmax_scale=batch.softmax_scale, kv_b_proj=kv_b_proj)
    rows = step.rows
    out = attn(batch.q[rows][:, mine].contiguous(), batch.kv_c[rows], batch.k_pe[rows], cache,
               meta)
    ref = batch.oracle().view(batch.num_tokens, DIMS.num_heads, -1)[rows][:, mine]
    expected = batch.expected_cache()
    if D > 1:
        expected = shard_cache(expected, layout)
    wrong = int((_bits(cache.data) != _bits(expected)).any(dim=-1).sum())
    # Row features known to every rank: the gather must return the sample rows in order.
    features = torch.randn(batch.num_tokens, 5, generator=torch.Generator().manual_seed(seed))
    gathered = pcp.gather_samples(features[rows], step)
    sample_err = float((gathered - features[list(case.sample_rows)]).abs().max())
    return relative_error(out, ref), wrong, sample_err


def _all_cases(tp: int, dcp: int, pcp: int) -> list[tuple[float, int, float]]:
    state = ParallelState.connect(tp, dcp, torch.device("cpu"), pcp)
    assert (state.pcp_size, state.tp_size) == (pcp, tp)
    return [_run_case(state, case, seed) for seed, case in enumerate(CASES)]


@pytest.mark.parametrize(("tp", "dcp", "pcp"), [(1, 1, 2), (1, 1, 4), (2, 2, 2)])
def test_pcp_layer_matches_oracle(tp: int, dcp: int, pcp: int) -> None:
    per_rank = run_ranks(_all_cases, tp * pcp, tp, dcp, pcp)
    for (index, case), rank in itertools.product(enumerate(CASES), range(tp * pcp)):
        err, wrong, sample_err = per_rank[rank][index]
        assert err < FLOAT32_TOL, f"{case.name}, rank {rank}: error {err:.3g}"
        assert wrong == 0, f"{case.name}, rank {rank}: {wrong} cache slots differ"
        assert sample_err == 0.0, f"{case.name}, rank {rank}: sample rows misplaced"
