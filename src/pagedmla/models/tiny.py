"""The built-in tiny model: DeepSeek-V3 architecture, small enough for a 2-core CPU.

Every feature of the architecture is on: q LoRA, YaRN RoPE in the interleaved layout, a
dense first layer, then MoE with a shared expert and the V3 router (sigmoid,
group-limited, bias-corrected, renormalised, scaled). Two versions exist:

* the trained one, shipped with the package in `tiny_trained/` (a checkpoint directory
  with a chat template that `scripts/train_tiny.py` writes, trained on the project's own
  documentation): `model="tiny"` loads it when it is there (`trained_tiny_dir`);
* the random one, `tiny_config()` with weights made here from a fixed seed
  (`tiny_weights`), which `model="tiny"` falls back to without the trained one, and
  which tests compare against Hugging Face; `write_tiny_checkpoint` saves it as a
  checkpoint directory for tests and benchmarks that need one on disk.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagedmla.models.config import DeepseekConfig
from pagedmla.tokenizer import ByteTokenizer

FP8 = torch.float8_e4m3fn
FP8_BLOCK = (128, 128)

TRAINED_DIR = Path(__file__).with_name("tiny_trained")
"""Where the package keeps the trained tiny model (see `trained_tiny_dir`)."""


def trained_tiny_dir() -> Path | None:
    """The trained tiny model's checkpoint directory, or None when the package holds none
    (no config.json there; then "tiny" is the random model of `tiny_config`)."""
    return TRAINED_DIR if (TRAINED_DIR / "config.json").is_file() else None


def tiny_config() -> dict[str, Any]:
    """The random tiny model's config.json, as a Hugging Face DeepSeek-V3 checkpoint has it."""
    tok = ByteTokenizer
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": tok.vocab_size,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "hidden_size": 128,
        "intermediate_size": 256,
        "moe_intermediate_size": 64,
        "num_hidden_layers": 3,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def weight_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face tensor names and shapes of a DeepSeek-V2/V3 checkpoint for `config`
    (DeepSeek-V3.2 / GLM-5: with the lightning indexer of every layer that has one).

    Linear weights are [out_features, in_features]. The router bias
    (`e_score_correction_bias`) exists for the V3 (noaux_tc) router only.
    """
    c = DeepseekConfig.from_dict(config)
    h, heads = c.hidden_size, c.num_attention_heads
    qk_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h)}
    for i in range(c.num_hidden_layers):
        attn = f"model.layers.{i}.self_attn"
        if c.q_lora_rank is None:
            shapes[f"{attn}.q_proj.weight"] = (heads * qk_dim, h)
        else:
            shapes[f"{attn}.q_a_proj.weight"] = (c.q_lora_rank, h)
            shapes[f"{attn}.q_a_layernorm.weight"] = (c.q_lora_rank,)
            shapes[f"{attn}.q_b_proj.weight"] = (heads * qk_dim, c.q_lora_rank)
        shapes[f"{attn}.kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, h)
        shapes[f"{attn}.kv_a_layernorm.weight"] = (c.kv_lora_rank,)
        kv_b_rows = heads * (c.qk_nope_head_dim + c.v_head_dim)
        shapes[f"{attn}.kv_b_proj.weight"] = (kv_b_rows, c.kv_lora_rank)
        shapes[f"{attn}.o_proj.weight"] = (h, heads * c.v_head_dim)
        if c.indexer is not None and c.indexer.has_indexer(i):
            x = c.indexer
            shapes.update({
                f"{attn}.indexer.wq_b.weight": (x.num_heads * x.head_dim, c.q_lora_rank),
                f"{attn}.indexer.wk.weight": (x.head_dim, h),
                f"{attn}.indexer.k_norm.weight": (x.head_dim,),
                f"{attn}.indexer.k_norm.bias": (x.head_dim,),
                f"{attn}.indexer.weights_proj.weight": (x.num_heads, h),
            })
        mlp = f"model.layers.{i}.mlp"
        if c.is_moe_layer(i):
            shapes[f"{mlp}.gate.weight"] = (c.n_routed_experts, h)
            if c.topk_method == "noaux_tc":
                shapes[f"{mlp}.gate.e_score_correction_bias"] = (c.n_routed_experts,)
            for e in range(c.n_routed_experts):
                shapes.update(_mlp_shapes(f"{mlp}.experts.{e}", h, c.moe_intermediate_size))
            if c.n_shared_experts:
                width = c.moe_intermediate_size * c.n_shared_experts
                shapes.update(_mlp_shapes(f"{mlp}.shared_experts", h, width))
        else:
            shapes.update(_mlp_shapes(mlp, h, c.intermediate_size))
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (h,)
        shapes[f"model.layers.{i}.post_attention_layernorm.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.gate_proj.weight": (width, hidden),
        f"{prefix}.up_proj.weight": (width, hidden),
        f"{prefix}.down_proj.weight": (hidden, width),
    }


def tiny_weights(
    config: Mapping[str, Any], seed: int = 0, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic float32 weights for `config`, as (Hugging Face name, tensor), drawn
    on `device` (a GPU draws real-size shapes fast; the values depend on the device).

    Linear weights are N(0, 1/fan_in) so activations keep unit scale and test
    tolerances can be tight; embeddings N(0, 1); norm weights ones; the router bias
    small but non-zero so that it changes which experts are picked.
    """
    gen = torch.Generator(device).manual_seed(seed)

    def randn(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device)

    for name, shape in weight_shapes(config).items():
        if name.endswith("e_score_correction_bias"):
            yield name, 0.05 * randn(shape)
        elif name.endswith(".bias"):  # the indexer's k_norm
            yield name, torch.zeros(shape, device=device)
        elif len(shape) == 1:
            yield name, torch.ones(shape, device=device)
        elif name == "model.embed_tokens.weight":
            yield name, randn(shape)
        else:
            yield name, randn(shape) / math.sqrt(shape[1])


def _is_fp8_candidate(name: str, tensor: torch.Tensor) -> bool:
    """Linear weights DeepSeek-V3 ships in fp8: not embeddings, the head, routers or the
    indexer's head weights."""
    excluded = ("model.embed_tokens.weight", "lm_head.weight")
    return (tensor.dim() == 2 and name not in excluded
            and not name.endswith(("mlp.gate.weight", "indexer.weights_proj.weight")))


def _quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 weight and float32 `weight_scale_inv` [ceil(out/128), ceil(in/128)]."""
    rows, cols = weight.shape
    br, bc = FP8_BLOCK
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    # Zero padding to whole blocks leaves each block's amax unchanged.
    padded = weight.new_zeros(grid[0] * br, grid[1] * bc)
    padded[:rows, :cols] = weight
    blocks = padded.view(grid[0], br, grid[1], bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)
    scale_inv = amax / torch.finfo(FP8).max
    quantized = (blocks / scale_inv[:, None, :, None]).to(FP8)
    return quantized.view(grid[0] * br, grid[1] * bc)[:rows, :cols].contiguous(), scale_inv


def write_tiny_checkpoint(
    directory: str | Path,
    fp8: bool = False,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Path:
    """Save the tiny model as a Hugging Face style checkpoint directory; return its path.

    Writes config.json, two safetensors shards with model.safetensors.index.json, and
    tokenizer.json (the byte tokenizer). With `fp8`, 2-D linear weights are stored as
    float8_e4m3fn with `weight_scale_inv` over 128x128 blocks (several tiny shapes are
    not multiples of 128, so partial edge blocks occur), config.json gets DeepSeek's
    `quantization_config`, and every scale goes into the second shard so that a
    loader must find companions across shards. `config` replaces the tiny config (random
    weights of any DeepSeek shape, e.g. for benchmarks). `dtype`: the dtype the tensors
    that are not fp8 are stored in (e.g. bfloat16 for a 16-bit checkpoint). `device`:
    where the weights are drawn and quantized, one tensor at a time.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(config) if config is not None else tiny_config()
    if fp8:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(FP8_BLOCK),
        }
    half = len(weight_shapes(config)) // 2
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    shards: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    for index, (name, tensor) in enumerate(tiny_weights(config, seed, device)):
        shard = shards[0] if index < half else shards[1]
        if fp8 and _is_fp8_candidate(name, tensor):
            tensor, scale_inv = _quantize_fp8_blocks(tensor)
            shards[1][f"{name}_scale_inv"] = scale_inv.cpu()
        shard[name] = (tensor if tensor.dtype == FP8 else tensor.to(dtype)).cpu()
    weight_map = {}
    for file, shard in zip(files, shards):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total_size = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    index_json = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    ByteTokenizer().to_tokenizers().save(str(directory / "tokenizer.json"))
    return directory
