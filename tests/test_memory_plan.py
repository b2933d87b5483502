"""benchmarks/memory_plan.py: the weights a rank holds, counted on the meta device, and the
KV cache that the rest of a card holds.

Expectations are independent of the count: DeepSeek-V3's rank share spelled out tensor
by tensor, the loader's plan of tiny checkpoints (shapes checked against the files'
headers), and KV arithmetic done by hand.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from benchmarks import memory_plan
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import shard_for
from pagedmla.models.loader import plan_model
from pagedmla.models.tiny import write_tiny_checkpoint

MIB, GIB = 2**20, 2**30
H, VOCAB, TP = 7168, 129280, 8


def _v3_rank_bytes(weight: int) -> int:
    """One TP 8 rank's bytes of DeepSeek-V3 by hand, `weight` bytes per element of the
    linear weights (1: block fp8 with a float32 scale per 128 x 128 block; 2: bf16)."""

    def linear(n: int, k: int) -> int:
        scales = math.ceil(n / 128) * math.ceil(k / 128) * 4 if weight == 1 else 0
        return n * k * weight + scales

    heads = 128 // TP
    attention = (
        linear(1536, H) + 1536 * 2  # q_a_proj (whole on every rank) and its norm
        + linear(heads * 192, 1536)  # q_b_proj: this rank's heads
        + linear(576, H) + 512 * 2  # kv_a_proj_with_mqa (whole) and its norm
        + heads * 256 * 512 * 2  # kv_b_proj, held in bf16
        + 2 * heads * 128 * 512 * 2  # W_UK and W_UV derived from it, bf16
        + linear(H, heads * 128)  # o_proj: this rank's columns
        + 2 * H * 2  # the layer's two norms
    )
    dense = 2 * linear(18432 // TP, H) + linear(H, 18432 // TP)
    experts = 256 // TP * (2 * linear(2048, H) + linear(H, 2048))
    shared = 2 * linear(2048 // TP, H) + linear(H, 2048 // TP)
    moe = 256 * H * 4 + 256 * 4 + experts + shared  # float32 router weight and bias
    vocab = -(-VOCAB // TP) * H * 2  # embedding and LM head rows, each
    return 61 * attention + 3 * dense + 58 * moe + 2 * vocab + H * 2


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
def test_deepseek_v3_rank_share_by_hand(fmt: str) -> None:
    config = memory_plan.deepseek_v3(fp8=fmt == "fp8")
    expected = _v3_rank_bytes(1 if fmt == "fp8" else 2)
    assert memory_plan.rank_weight_bytes(config, 0, TP) == expected
    assert memory_plan.rank_weight_bytes(config, TP - 1, TP) == expected


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("memory_plan")
    return {"bf16": write_tiny_checkpoint(root / "bf16", dtype=torch.bfloat16),
            "fp8": write_tiny_checkpoint(root / "fp8", fp8=True)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_count_equals_the_loader_plan(checkpoints: dict[str, Path], fmt: str, tp: int) -> None:
    """The count equals `ModelPlan.weight_bytes` of a checkpoint on disk (block-fp8
    shapes that are not multiples of 128: at TP 2 some slices start inside a block)."""
    directory = checkpoints[fmt]
    config = json.loads((directory / "config.json").read_text())
    for rank in range(tp):
        state = ParallelState(rank, tp, 0, 1, torch.device("cpu"), None, None, None)
        plan = plan_model(directory, torch.bfloat16, shard=shard_for(state) if tp > 1 else None)
        assert memory_plan.rank_weight_bytes(config, rank, tp) == plan.weight_bytes


def test_kv_capacity_by_hand() -> None:
    block = 64 * 61 * 1152  # 64 tokens of a bf16 latent (576 wide) over 61 layers
    kv = memory_plan.kv_capacity(100 * MIB, 0.9, 50 * MIB, 10 * MIB, block, 64)
    # 90 - 50 - 10 = 30 MiB = 31,457,280 B hold 6 blocks of 4,497,408 B
    assert kv == {"fits": True, "blocks": 6, "tokens": 384, "cache_gib": 6 * block / GIB}
    short = memory_plan.kv_capacity(100 * MIB, 0.9, 85 * MIB, 10 * MIB, block, 64)
    assert not short["fits"]
    assert short["missing_gib"] == pytest.approx((2 * block - 0.9 * 100 * MIB + 95 * MIB) / GIB)


def test_the_committed_plan_is_what_the_code_computes() -> None:
    """docs/results/memory_plan.json holds today's plan; its H200 row checked by hand."""
    committed = json.loads((Path(__file__).parents[1] / "docs/results/memory_plan.json")
                           .read_text())
    computed = memory_plan.plan()
    assert {k: committed[k] for k in computed} == json.loads(json.dumps(computed))
    workspace = 65536 * (576 + 16 * 256 + 16 * 192) * 2  # latent rows, K and V, queries
    assert computed["workspace_gib"] * GIB == workspace
    assert computed["kv_bytes_per_token"] == {"bf16": 61 * 576 * 2, "fp8": 61 * 576}
    h200 = next(p for p in computed["plans"] if p["card"] == "8 x H200" and p["weights"] == "fp8")
    budget = 0.9 * 143771 * MIB - _v3_rank_bytes(1) - workspace
    for cache, per_token in computed["kv_bytes_per_token"].items():
        tokens = math.floor(budget / (64 * per_token)) * 64
        kv = h200["cache"][cache]
        assert (kv["tokens"], kv["node_tokens"], kv["node_tokens_dcp"]) == (
            tokens, tokens, 8 * tokens)
    h100 = next(p for p in computed["plans"] if p["card"] == "8 x H100" and p["weights"] == "fp8")
    assert not h100["cache"]["fp8"]["fits"]  # 79.8 GiB of weights; 71.7 GiB usable


def test_measured_weights_must_match_the_count(tmp_path: Path) -> None:
    """--measured: a bench_v3_layers result whose weight GiB differ from the count is
    refused; a matching one gives the 61-layer step-time extrapolation."""
    runs = {}
    for fmt in ("fp8", "bf16"):
        gib = {n: memory_plan.rank_weight_bytes(
            memory_plan.deepseek_v3(fmt == "fp8", n, dense=0)) / GIB for n in (2, 1)}
        runs[fmt] = {"full": {"weight_gib": gib[2], "load_s": 1.0},
                     "one_layer": {"weight_gib": gib[1], "load_s": 1.0},
                     "layer_weight_gib": gib[2] - gib[1],
                     "layer_step_ms": {"1": 0.5, "32": 1.0, "128": 2.0}}
    path = tmp_path / "v3_layers.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "args": {"layers": 2}, "runs": runs}))
    measured = memory_plan.check_measured(path)
    assert measured["runs"]["fp8"]["step_ms_61_layers_estimate"] == {
        "1": 30.5, "32": 61.0, "128": 122.0}
    runs["bf16"]["one_layer"]["weight_gib"] += 1e-5
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "args": {"layers": 2}, "runs": runs}))
    with pytest.raises(SystemExit, match="bf16 one_layer"):
        memory_plan.check_measured(path)


def test_sparse_models_count_latents_and_indexer_keys() -> None:
    """DeepSeek-V3.2 and GLM-5 as served: a token's fp8_ds_mla entry (656 B) on every
    layer plus its fp8 indexer key (128 codes and a 4-byte scale) on each layer with an
    indexer (V3.2: all 61; GLM-5: 21 of 78), and the tokens that fit in whole blocks."""
    rows = {(r["model"], r["card"]): r for r in memory_plan.sparse_plan()}
    per_token = {"DeepSeek-V3.2": (61 * 656, 61 * 132), "GLM-5": (78 * 656, 21 * 132)}
    for (model, card), row in rows.items():
        assert (row["latent_bytes_per_token"], row["index_bytes_per_token"]) == per_token[model]
        held = (row["weight_gib"] + row["workspace_gib"]) * GIB
        budget = 0.9 * memory_plan.CARDS[card] - held
        blocks = math.floor(budget / (sum(per_token[model]) * 64))
        assert row["cache"]["fits"] == (blocks >= 2)
        if blocks >= 2:
            assert row["cache"]["tokens"] == blocks * 64
    glm, v32 = rows["GLM-5", "8 x H200"], rows["DeepSeek-V3.2", "8 x H200"]
    assert glm["weight_gib"] > v32["weight_gib"]
