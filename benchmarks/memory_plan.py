"""The memory plan of DeepSeek-V3/R1 (61 layers) on one node of 8 GPUs, tensor parallel 8,
and of the sparse-attention DeepSeek-V3.2 and GLM-5.

For DeepSeek-V3's config (61 layers, the first 3 dense; 256 routed experts of 2048 and
one shared; vocabulary 129280; hidden 7168; 128 heads; q_lora 1536, L 512, R 64, P 128,
V 128), with block-fp8 (128 x 128) and with bf16 weights, on 8 x H200 and 8 x H100:

* weights per GPU: each TP rank's model is built on the meta device and sharded as the
  engine shards it (`shard_for`), and its tensors' bytes are summed with those
  `process_weights_after_loading` derives: what `ModelPlan.weight_bytes` counts and
  `LLM.memory` reports. The largest rank's share is the GPU's.
* KV cache tokens per GPU at block 64, bf16 and fp8 caches: the budget the engine
  sizes the cache from (`LLM`: gpu_memory_utilization of the card less the weights
  and the chunked-prefill workspace at the engine's defaults), in whole blocks of
  `cache_block_bytes` over 61 layers. The CUDA context, activations and CUDA graph
  pools are not counted: the engine sizes the cache from the free memory after them,
  so a real run holds fewer tokens.
* tokens the node holds: without decode context parallelism every TP rank holds every
  token's latent (node = one GPU's); with DCP 8 each token's latent lives on one rank
  of the group (node = 8 x one GPU's).

* DeepSeek-V3.2 (V3's shapes and a 64-head indexer on every layer) and GLM-5 (78 layers,
  64 heads, P 192, V 256, a 32-head indexer on 21 layers) as they are served: block-fp8
  weights, the fp8_ds_mla cache (656 B per token and layer) and fp8 indexer keys (D 128
  codes and a float32 scale per token on each layer with an indexer), no decode context
  parallelism (they refuse it).

Nothing is allocated and no GPU is needed: the plan is computed, not measured. With
`--measured`, a `bench_v3_layers` result (one GPU, TP 1, N MoE layers and 1), the same
count for those two models must equal the weight GiB the engine reported on the GPU
(to 1e-6 GiB), and the measured decode ms per layer is kept for step-time estimates
(per-layer ms x 61: a single-GPU, TP 1 extrapolation, not a multi-GPU measurement).

    python -m benchmarks.memory_plan --out docs/results/memory_plan.json
    python -m benchmarks.memory_plan --measured docs/results/v3_layers_h200.json \\
        --out docs/results/memory_plan.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_v3_layers import v3_config
from pagedmla.cache import resolve_cache_dtype
from pagedmla.distributed.state import ParallelState
from pagedmla.distributed.tensor_parallel import shard_for
from pagedmla.engine.args import EngineArgs
from pagedmla.engine.memory import (
    GIB,
    cache_block_bytes,
    index_key_block_bytes,
    workspace_bytes,
)
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM
from pagedmla.planner import determine_workspace_rows

MIB = 2**20
LAYERS = 61
DENSE_LAYERS = 3
TENSOR_PARALLEL = 8
CARDS = {"8 x H200": 143771 * MIB, "8 x H100": 81559 * MIB}  # each GPU's memory
WEIGHTS = ("fp8", "bf16")
CACHES = {"bf16": "auto", "fp8": "fp8"}  # cache dtype -> kv_cache_dtype
MODEL_DTYPE = torch.bfloat16
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
TOLERANCE_GIB = 1e-6


def engine_default(name: str) -> Any:
    """EngineArgs' default of field `name`."""
    (field,) = [f for f in fields(EngineArgs) if f.name == name]
    return field.default


def deepseek_v3(fp8: bool, layers: int = LAYERS, dense: int = DENSE_LAYERS) -> dict:
    """DeepSeek-V3/R1's config.json fields at `layers` layers, the first `dense` dense;
    with DeepSeek's block-fp8 `quantization_config` when `fp8`."""
    config = v3_config(layers)
    config["first_k_dense_replace"] = dense
    if fp8:
        config["quantization_config"] = dict(FP8_QUANTIZATION)
    return config


def sparse_model(name: str) -> dict:
    """The config.json fields of DeepSeek-V3.2 or GLM-5 (block-fp8)."""
    config = deepseek_v3(fp8=True)
    config.update(model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
                  index_topk=2048)
    if name == "GLM-5":
        config.update(
            model_type="glm_moe_dsa", vocab_size=154880, hidden_size=6144,
            intermediate_size=12288, num_hidden_layers=78, num_attention_heads=64,
            num_key_value_heads=64, q_lora_rank=2048, qk_nope_head_dim=192, v_head_dim=256,
            n_group=1, topk_group=1, index_n_heads=32, index_topk_freq=4,
            index_skip_topk_offset=3, max_position_embeddings=202752, rope_scaling=None,
            rope_parameters={"rope_theta": 8000000, "rope_type": "default"})
    return config


SPARSE_MODELS = ("DeepSeek-V3.2", "GLM-5")


def rank_weight_bytes(config: dict, tp_rank: int = 0, tp_size: int = 1) -> int:
    """The bytes of TP rank `tp_rank`'s weights (derived ones included) of the model of
    `config` in bf16, counted on the meta device as `plan_model` counts them."""
    whole = DeepseekForCausalLM(DeepseekConfig.from_dict(config), MODEL_DTYPE, "meta")
    keys = {key: key for key in whole.state_dict()}
    module: torch.nn.Module = whole
    if tp_size > 1:
        state = ParallelState(tp_rank, tp_size, 0, 1, torch.device("meta"), None, None, None)
        module, rank = shard_for(state)(whole)
        keys = dict(rank.full_keys)
    decoder = module.decoder
    decoder.process_weights_after_loading()
    tensors = module.state_dict()
    held = {key: tensors[rank_key] for rank_key, key in keys.items()}  # one per model tensor
    return sum(t.numel() * t.element_size() for t in (*held.values(), *decoder.derived_weights()))


def kv_capacity(
    card_bytes: int, utilization: float, weights: int, workspace: int, block_bytes: int,
    block_size: int,
) -> dict[str, Any]:
    """The cache the engine would size on a card of `card_bytes` holding nothing else:
    whole blocks of `block_bytes` (all layers) in utilization x card - weights -
    workspace. Fits when two blocks do (the fewest the engine accepts); else the GiB
    missing for them."""
    budget = utilization * card_bytes - weights - workspace
    blocks = max(0, math.floor(budget / block_bytes))
    if blocks < 2:
        return {"fits": False, "missing_gib": (2 * block_bytes - budget) / GIB}
    return {"fits": True, "blocks": blocks, "tokens": blocks * block_size,
            "cache_gib": blocks * block_bytes / GIB}


def plan(tp_size: int = TENSOR_PARALLEL) -> dict[str, Any]:
    """Weights and KV capacity per GPU for each card and weight format at `tp_size`."""
    utilization = engine_default("gpu_memory_utilization")
    block_size = engine_default("block_size")
    config = DeepseekConfig.from_dict(deepseek_v3(fp8=False))
    rows = determine_workspace_rows(config.max_position_embeddings,
                                    engine_default("max_num_seqs"), block_size)
    dims = replace(config.dims, num_heads=config.num_attention_heads // tp_size)  # a rank's
    workspace = workspace_bytes(dims, rows, MODEL_DTYPE)
    block_bytes = {cache: cache_block_bytes(dims, block_size,
                                            resolve_cache_dtype(name, MODEL_DTYPE), LAYERS)
                   for cache, name in CACHES.items()}
    weights = {}
    for fmt in WEIGHTS:
        by_rank = [rank_weight_bytes(deepseek_v3(fmt == "fp8"), r, tp_size)
                   for r in range(tp_size)]
        weights[fmt] = {"gib_by_rank": [b / GIB for b in by_rank], "bytes": max(by_rank)}
    plans = []
    for card, card_bytes in CARDS.items():
        for fmt in WEIGHTS:
            row: dict[str, Any] = {"card": card, "weights": fmt, "card_gib": card_bytes / GIB,
                                   "weight_gib": weights[fmt]["bytes"] / GIB, "cache": {}}
            for cache, nbytes in block_bytes.items():
                kv = kv_capacity(card_bytes, utilization, weights[fmt]["bytes"], workspace,
                                 nbytes, block_size)
                if kv["fits"]:
                    kv["node_tokens"] = kv["tokens"]
                    kv["node_tokens_dcp"] = kv["tokens"] * tp_size
                else:  # whether any gpu_memory_utilization would do
                    whole = kv_capacity(card_bytes, 1.0, weights[fmt]["bytes"], workspace,
                                        nbytes, block_size)
                    kv["missing_gib_whole_card"] = whole.get("missing_gib", 0.0)
                row["cache"][cache] = kv
            plans.append(row)
    return {
        "tensor_parallel": tp_size, "dcp": tp_size, "layers": LAYERS,
        "dense_layers": DENSE_LAYERS, "block_size": block_size,
        "gpu_memory_utilization": utilization, "model_dtype": "bfloat16",
        "workspace_rows": rows, "workspace_gib": workspace / GIB,
        "kv_bytes_per_token": {c: b // block_size for c, b in block_bytes.items()},
        "weight_gib_by_rank": {fmt: w["gib_by_rank"] for fmt, w in weights.items()},
        "plans": plans,
    }


def sparse_plan(tp_size: int = TENSOR_PARALLEL) -> list[dict[str, Any]]:
    """Weights and KV capacity per GPU of the sparse-attention models as served (block-fp8
    weights, fp8_ds_mla latents, fp8 indexer keys) on each card at `tp_size`."""
    utilization = engine_default("gpu_memory_utilization")
    block_size = engine_default("block_size")
    rows = []
    for name in SPARSE_MODELS:
        config_dict = sparse_model(name)
        config = DeepseekConfig.from_dict(config_dict)
        dims = replace(config.dims, num_heads=config.num_attention_heads // tp_size)
        workspace = workspace_bytes(
            dims, determine_workspace_rows(config.max_position_embeddings,
                                           engine_default("max_num_seqs"), block_size),
            MODEL_DTYPE)
        latent = cache_block_bytes(dims, block_size, resolve_cache_dtype("fp8_ds_mla",
                                   MODEL_DTYPE), config.num_hidden_layers)
        index = index_key_block_bytes(config, block_size, MODEL_DTYPE, fp8=True)
        weights = max(rank_weight_bytes(config_dict, r, tp_size) for r in range(tp_size))
        for card, card_bytes in CARDS.items():
            kv = kv_capacity(card_bytes, utilization, weights, workspace, latent + index,
                             block_size)
            rows.append({"model": name, "card": card, "weights": "fp8",
                         "weight_gib": weights / GIB, "layers": config.num_hidden_layers,
                         "latent_bytes_per_token": latent // block_size,
                         "index_bytes_per_token": index // block_size,
                         "workspace_gib": workspace / GIB, "cache": kv})
    return rows


def check_measured(path: Path) -> dict[str, Any]:
    """The same count for `path`'s models (bench_v3_layers: TP 1, N MoE layers and 1)
    against the GiB measured; SystemExit on a mismatch. Returns the measured figures."""
    data = json.loads(path.read_text())
    layers = data["args"]["layers"]
    out: dict[str, Any] = {"source": path.name, "gpu": data["gpu"], "layers": layers,
                           "runs": {}}
    for fmt, run in data["runs"].items():
        for key, n in (("full", layers), ("one_layer", 1)):
            counted = rank_weight_bytes(deepseek_v3(fmt == "fp8", n, dense=0)) / GIB
            measured = run[key]["weight_gib"]
            if abs(counted - measured) > TOLERANCE_GIB:
                raise SystemExit(f"{path}: {fmt} {key} ({n} layers): measured "
                                 f"{measured:.6f} GiB of weights, counted {counted:.6f}")
        per_layer = {str(b): ms for b, ms in run["layer_step_ms"].items()}
        out["runs"][fmt] = {
            "weight_gib": run["full"]["weight_gib"], "load_s": run["full"]["load_s"],
            "layer_weight_gib": run["layer_weight_gib"], "layer_step_ms": per_layer,
            "step_ms_61_layers_estimate": {b: ms * LAYERS for b, ms in per_layer.items()},
        }
    return out


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", type=Path, default=None,
                        help="a bench_v3_layers result to check the count against")
    parser.add_argument("--out", default="memory_plan.json")
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    result = {
        "about": "Computed on the CPU from the model's shapes, not measured: weights per "
        "GPU counted on the meta device as the engine plans them; KV capacity from "
        "gpu_memory_utilization of the card less the weights and the workspace (CUDA "
        "context, activations and CUDA graph pools not counted).",
        "gpu": "none (computed on the CPU, not measured)",
        "date": datetime.date.today().isoformat(),
        "commit": _commit(), "command": " ".join(["python -m benchmarks.memory_plan", *argv]),
        **plan(),
        "sparse": sparse_plan(),
        "measured": None if args.measured is None else check_measured(args.measured),
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    for row in result["plans"]:
        caches = ", ".join(f"{c} cache {kv['tokens']:,} tokens" if kv["fits"]
                           else f"{c} cache: does not fit, {kv['missing_gib']:.2f} GiB missing"
                           for c, kv in row["cache"].items())
        print(f"{row['card']}, {row['weights']} weights: {row['weight_gib']:.2f} GiB per GPU; "
              f"{caches}")
    for row in result["sparse"]:
        kv = row["cache"]
        room = (f"{kv['tokens']:,} tokens" if kv["fits"]
                else f"does not fit, {kv['missing_gib']:.2f} GiB missing")
        print(f"{row['model']} on {row['card']}: {row['weight_gib']:.2f} GiB per GPU; "
              f"fp8_ds_mla cache and fp8 indexer keys {room}")


if __name__ == "__main__":
    main()
