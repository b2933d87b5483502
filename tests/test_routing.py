"""Routing requests between the absorbed MQA path and the MHA path by predicted cost."""

from __future__ import annotations

import pytest

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.engine.scheduler import Scheduler
from pagedmla.routing import PathCostModel
from pagedmla.testing import make_paged_batch, relative_error

V3 = MLADims(128, 512, 128, 64, 128)
V2_LITE = MLADims(16, 512, 128, 64, 128)


def test_short_extends_route_to_mqa_long_ones_to_mha() -> None:
    model = PathCostModel()
    for dims in (V3, V2_LITE):
        for context in (512, 8192, 131072):
            assert model.prefers_mqa(dims, 1, context)
            assert model.prefers_mqa(dims, 8, context)
            assert not model.prefers_mqa(dims, 1024, context)
            crossover = model.crossover(dims, context, limit=1024)
            # Equal-rate algebra puts it near L(P+V)/(2L+R-(P+R+V)) ~ 170; the MHA path's
            # memory passes over the up-projected keys push it up. benchmarks/bench_routing
            # puts it between 256 and 512 at 4k and 32k contexts (docs/PERFORMANCE.md); a
            # short context has less up-projection to amortise.
            assert (128 if context < 4096 else 256) <= crossover < 512
            assert all(model.prefers_mqa(dims, q, context) for q in range(1, crossover + 1))


def test_fresh_prompts_stay_on_mha() -> None:
    assert not PathCostModel().prefers_mqa(MLADims(4, 64, 32, 16, 32), 8, 0)


def test_routed_extend_matches_oracle() -> None:
    """A 24-token extend over a 700-token context takes the MQA path and stays exact."""
    dims = MLADims(4, 64, 32, 16, 32)
    query_lens, seq_lens = [1, 24, 40], [90, 724, 40]
    batch = make_paged_batch(dims, query_lens, seq_lens, block_size=16, seed=11)
    builder = MLAMetadataBuilder(dims, block_size=16, router=PathCostModel())
    meta = builder.build(batch.spec)
    assert meta.num_decodes == 2 and meta.num_decode_tokens == 25 and meta.num_prefills == 1
    attn = MLAAttention(dims, batch.softmax_scale, batch.kv_b_proj, backend="reference")
    out = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
    # float32 on both paths: the oracle's tolerance for float32 (2e-4).
    assert relative_error(out, batch.oracle()) < 2e-4


def test_builder_rejects_routed_request_after_prefill() -> None:
    dims = MLADims(4, 64, 32, 16, 32)
    batch = make_paged_batch(dims, [40, 24], [40, 724], block_size=16, seed=12)
    builder = MLAMetadataBuilder(dims, block_size=16, router=PathCostModel())
    with pytest.raises(ValueError, match="decodes first"):
        builder.build(batch.spec)


def test_scheduler_orders_by_the_routing_rule() -> None:
    from pagedmla.engine.block_manager import BlockManager
    from pagedmla.engine.sampling_params import SamplingParams
    from pagedmla.engine.sequence import Sequence

    manager = BlockManager(64, 16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, 8, 64, uses_mqa=lambda q, context: context > 0 and q <= 8)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    long_prompt = Sequence(0, list(range(3, 71)), params)  # 68 tokens: 64, then 4
    scheduler.add(long_prompt)
    first = scheduler.schedule()
    assert first.num_new_tokens == [64]
    scheduler.postprocess(first, {})
    scheduler.add(Sequence(1, list(range(3, 23)), params))
    second = scheduler.schedule()
    # The 4-token remainder has context: routed to MQA, so it comes first.
    assert [s.seq_id for s in second.seqs] == [0, 1]
    assert second.num_new_tokens == [4, 20]
