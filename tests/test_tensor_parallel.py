"""Tensor parallelism on 2 gloo ranks, against the unsharded model.

A V2-style variant of the tiny model exercises what the engine tests' V3-style model
does not: q_proj without q LoRA, the softmax greedy router, tied embeddings, and
sizes that do not split evenly (vocabulary 97, 7 routed experts, 91 intermediate
units). Each rank shards its copy, runs a prefill then a decode step and must give
the unsharded logits to float32 rounding (relative 1e-5; observed ~1e-7). Written as
a checkpoint and read by each rank's slices, the variant must give bitwise the logits
of the loaded model sharded in place.
"""

from __future__ import annotations

import pytest
import torch

from pagedmla import BatchSpec, LatentKVCache, MLAMetadataBuilder
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import check_heads_divisible, parallelize, shard_for
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM
from pagedmla.models.loader import load_planned, plan_model
from pagedmla.models.tiny import tiny_config, tiny_weights, write_tiny_checkpoint
from pagedmla.testing import relative_error
from tests.dist_helpers import run_ranks

TOL = 1e-5
BLOCK = 4


def _config() -> dict:
    config = tiny_config()
    config.update(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
        topk_method="greedy", scoring_func="softmax", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=True,
        vocab_size=97, intermediate_size=91, n_routed_experts=7, n_shared_experts=2,
        moe_intermediate_size=30, num_experts_per_tok=3,
    )
    return config


def _model() -> DeepseekForCausalLM:
    raw = _config()
    model = DeepseekForCausalLM(DeepseekConfig.from_dict(raw))
    model.load_weights(tiny_weights(raw, seed=3))
    model.process_weights_after_loading()
    return model


def _steps(model: torch.nn.Module) -> list[torch.Tensor]:
    """Logits of a 2-request prefill, then a decode of both, over fresh caches."""
    d = model.dims
    builder = MLAMetadataBuilder(d, block_size=BLOCK)
    caches = [LatentKVCache(8, BLOCK, d.kv_lora_rank, d.qk_rope_head_dim, dtype=torch.float32)
              for _ in range(model.config.num_hidden_layers)]
    table = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0]], dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    lens, logits = [9, 5], []
    for step in range(2):
        q = lens if step == 0 else [1, 1]
        seq = lens if step == 0 else [n + 1 for n in lens]
        positions = [p for s, n in zip(seq, q) for p in range(s - n, s)]
        slots = [int(table[b, p // BLOCK]) * BLOCK + p % BLOCK
                 for b, (s, n) in enumerate(zip(seq, q)) for p in range(s - n, s)]
        ids = torch.randint(0, 97, (len(positions),), generator=gen)
        spec = BatchSpec(q, seq, table, torch.tensor(slots))
        hidden = model(ids, torch.tensor(positions), caches, builder.build(spec))
        last = torch.tensor([sum(q[: b + 1]) - 1 for b in range(2)])
        logits.append(model.compute_logits(hidden[last]))
    return logits


def _compare(world: int) -> list[float]:
    state = ParallelState.connect(world, 1, torch.device("cpu"))
    with torch.inference_mode():
        expected = _steps(_model())
        got = _steps(parallelize(_model(), state))
    return [relative_error(g, e) for g, e in zip(got, expected, strict=True)]


def test_sharded_model_matches_unsharded() -> None:
    for rank, errors in enumerate(run_ranks(_compare, 2, 2)):
        assert max(errors) < TOL, f"rank {rank}: errors {errors}"


def _compare_loaded(directory: str) -> bool:
    """Whether this rank's model read from the checkpoint gives bitwise the logits of the
    loaded model sharded by parallelize."""
    state = ParallelState.connect(2, 1, torch.device("cpu"))
    with torch.inference_mode():
        expected = _steps(parallelize(_model(), state))
        got = _steps(load_planned(plan_model(directory, torch.float32, "auto",
                                             shard_for(state))))
    return all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_sharded_checkpoint_loads_what_parallelize_keeps(tmp_path) -> None:
    """The same variant written as a checkpoint and read by each rank's slices: tied
    embeddings (one tensor for the embedding and the head), q_proj rows, uneven experts,
    units and vocabulary."""
    directory = write_tiny_checkpoint(tmp_path, seed=3, config=_config())
    assert all(run_ranks(_compare_loaded, 2, str(directory)))


def test_heads_must_divide() -> None:
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible"):
        check_heads_divisible(DeepseekConfig.from_dict(_config()), 3)
