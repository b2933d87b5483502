"""DeepseekConfig: the fields of a DeepSeek-V2/V3/V3.2 or GLM-5 (`glm_moe_dsa`)
`config.json` that the model needs.

Parsed from the plain dict, so that serving a checkpoint never imports `transformers`.
Both spellings of the RoPE settings are read: `rope_scaling` (DeepSeek's own configs)
and `rope_parameters` (what transformers 5 writes, with `rope_theta` inside it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedmla.dims import MLADims, softmax_scale
from pagedmla.models.config_values import (
    checked_int,
    flag,
    optional_int,
    positive_number,
    required_int,
)
from pagedmla.models.dsa_config import DSA_MODEL_TYPES, IndexerConfig
from pagedmla.ops.block_fp8 import DEFAULT_BLOCK_SIZE

SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", *DSA_MODEL_TYPES)
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SCORING_FUNCS = ("softmax", "sigmoid")

# V2 and V3 share field names but not router defaults: a transformers-5 V3 config has
# no `topk_method`/`scoring_func` keys, because its router is always noaux_tc + sigmoid.
_ROUTER_DEFAULTS = {"deepseek_v2": ("greedy", "softmax"), "deepseek_v3": ("noaux_tc", "sigmoid"),
                    "deepseek_v32": ("noaux_tc", "sigmoid"), "glm_moe_dsa": ("noaux_tc", "sigmoid")}
_MLP_LAYER_TYPES = ("dense", "sparse")
# The YaRN settings that models/rope.py and dims.py compute with.
_YARN_NUMBERS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "mscale", "mscale_all_dim", "attention_factor")


@dataclass(frozen=True)
class DeepseekConfig:
    """A DeepSeek-V2/V3 decoder's hyper-parameters (names as in config.json).

    `rope_scaling` is None for plain RoPE, else the scaling dict with `rope_type` set
    (e.g. "yarn" with factor, original_max_position_embeddings, beta_fast, beta_slow,
    mscale, mscale_all_dim). `n_routed_experts` 0 means every layer is dense.
    `weight_block_size` is the (rows, columns) of a block-fp8 checkpoint's scale blocks
    (`quantization_config`), None for weights in the model dtype. `mlp_layer_types`
    ("dense" or "sparse" per layer, as transformers writes it for V3.2 and GLM-5)
    overrides first_k_dense_replace and moe_layer_freq where given. `indexer` is the
    lightning indexer of a sparse-attention model (DeepSeek-V3.2, GLM-5), None for
    dense MLA.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    architectures: tuple[str, ...] = field(default_factory=tuple)
    weight_block_size: tuple[int, int] | None = None
    mlp_layer_types: tuple[str, ...] | None = None
    indexer: IndexerConfig | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeepseekConfig:
        """Parse a config.json dict.

        ValueError for an unsupported architecture or option, a missing required key, or
        a value of the wrong type or range, naming the key. Optional keys that are absent
        or null take their defaults.
        """
        architectures = d.get("architectures") or []
        if not isinstance(architectures, list | tuple) or not all(
            isinstance(a, str) for a in architectures
        ):
            raise ValueError(f"'architectures' must be a list of strings, got {architectures!r}")
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r} (architectures {list(architectures)}); "
                f"supported: {SUPPORTED_MODEL_TYPES} / {SUPPORTED_ARCHITECTURES}"
            )
        unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
        if unsupported:
            raise ValueError(
                f"unsupported architecture {unsupported[0]!r}; supported: {SUPPORTED_ARCHITECTURES}"
            )
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise ValueError(f"{key}=True is not supported (no DeepSeek checkpoint uses it)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act must be 'silu', got {d['hidden_act']!r}")

        rope_theta, rope_scaling = _rope_settings(d)
        default_topk, default_scoring = _ROUTER_DEFAULTS[model_type]
        config = cls(
            model_type=model_type,
            vocab_size=required_int(d, "vocab_size"),
            hidden_size=required_int(d, "hidden_size"),
            intermediate_size=required_int(d, "intermediate_size"),
            num_hidden_layers=required_int(d, "num_hidden_layers"),
            num_attention_heads=required_int(d, "num_attention_heads"),
            kv_lora_rank=required_int(d, "kv_lora_rank"),
            qk_nope_head_dim=required_int(d, "qk_nope_head_dim"),
            qk_rope_head_dim=required_int(d, "qk_rope_head_dim", minimum=0),
            v_head_dim=required_int(d, "v_head_dim"),
            q_lora_rank=optional_int(d, "q_lora_rank", None),
            moe_intermediate_size=optional_int(d, "moe_intermediate_size", 0, minimum=0),
            n_routed_experts=optional_int(d, "n_routed_experts", 0, minimum=0),
            n_shared_experts=optional_int(d, "n_shared_experts", 0, minimum=0),
            num_experts_per_tok=optional_int(d, "num_experts_per_tok", 0, minimum=0),
            first_k_dense_replace=optional_int(d, "first_k_dense_replace", 0, minimum=0),
            moe_layer_freq=optional_int(d, "moe_layer_freq", 1),
            routed_scaling_factor=positive_number(d, "routed_scaling_factor", 1.0),
            topk_method=d.get("topk_method") or default_topk,
            scoring_func=d.get("scoring_func") or default_scoring,
            n_group=optional_int(d, "n_group", 1),
            topk_group=optional_int(d, "topk_group", 1),
            norm_topk_prob=flag(d, "norm_topk_prob", False),
            rms_norm_eps=positive_number(d, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            # DeepSeek's V2 code has no such switch: its checkpoints are always interleaved.
            rope_interleave=flag(d, "rope_interleave", True),
            max_position_embeddings=optional_int(d, "max_position_embeddings", 4096),
            tie_word_embeddings=flag(d, "tie_word_embeddings", False),
            bos_token_id=optional_int(d, "bos_token_id", None, minimum=0),
            eos_token_id=_eos_token_id(d),
            architectures=tuple(architectures),
            weight_block_size=weight_block_size(d),
            mlp_layer_types=_mlp_layer_types(d),
            indexer=IndexerConfig.from_dict(d) if model_type in DSA_MODEL_TYPES else None,
        )
        config._validate_moe()
        return config

    def _validate_moe(self) -> None:
        if not self.n_routed_experts:
            return
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method must be one of {TOPK_METHODS}, got {self.topk_method!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}"
            )
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts ({self.n_routed_experts}) must be a multiple of n_group "
                f"({self.n_group})"
            )
        per_group = self.n_routed_experts // self.n_group
        # Greedy routing ignores groups; the grouped methods choose among topk_group groups.
        grouped = self.topk_method != "greedy"
        selectable = per_group * self.topk_group if grouped else self.n_routed_experts
        if grouped and not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group must be in [1, {self.n_group}], got {self.topk_group}")
        if not 1 <= self.num_experts_per_tok <= selectable:
            raise ValueError(
                f"num_experts_per_tok must be in [1, {selectable}] (the experts routing can "
                f"choose from), got {self.num_experts_per_tok}"
            )
        if self.topk_method == "noaux_tc" and per_group < 2:
            raise ValueError("noaux_tc ranks groups by their top-2 experts: n_group too large")
        if not self.moe_intermediate_size:
            raise ValueError("moe_intermediate_size must be set when n_routed_experts > 0")

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has routed experts (else a dense MLP)."""
        if self.mlp_layer_types is not None:
            return self.n_routed_experts > 0 and self.mlp_layer_types[layer] == "sparse"
        return (
            self.n_routed_experts > 0
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def dims(self) -> MLADims:
        """The MLA widths of one layer (all heads)."""
        return MLADims(
            num_heads=self.num_attention_heads,
            kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim,
            qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            q_lora_rank=self.q_lora_rank,
        )

    @property
    def softmax_scale(self) -> float:
        """(P + R) ** -0.5, sharpened by YaRN's mscale_all_dim when RoPE is scaled."""
        return softmax_scale(self.qk_nope_head_dim + self.qk_rope_head_dim, self.rope_scaling)


def _rope_settings(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either `rope_scaling` or `rope_parameters`."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = d.get(key) or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{key!r} must be an object or null, got {params!r}")
    params = dict(params)
    theta = positive_number(params, "rope_theta", None) or positive_number(
        d, "rope_theta", 10000.0
    )
    params.pop("rope_theta", None)
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ValueError(f"rope type {kind!r} is not supported (DeepSeek uses 'yarn' or none)")
    for name in _YARN_NUMBERS:
        value = params.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not math.isfinite(value)):
            raise ValueError(f"'{key}.{name}' must be a finite number, got {value!r}")
    params["rope_type"] = kind
    return theta, params


def weight_block_size(d: Mapping[str, Any]) -> tuple[int, int] | None:
    """The fp8 block shape of `quantization_config` (128 x 128 when it names none), None
    without one; other quantization schemes are refused."""
    quant = d.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"unsupported quantization_config.quant_method {method!r}; "
            "only DeepSeek's block fp8 ('fp8') is supported"
        )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK_SIZE))
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            "'quantization_config.weight_block_size' must be two positive integers, "
            f"got {block!r}"
        )
    return block[0], block[1]


def _mlp_layer_types(d: Mapping[str, Any]) -> tuple[str, ...] | None:
    types = d.get("mlp_layer_types")
    if types is None:
        return None
    layers = required_int(d, "num_hidden_layers")
    if not isinstance(types, list) or len(types) < layers or any(
            t not in _MLP_LAYER_TYPES for t in types):
        raise ValueError(f"'mlp_layer_types' must give one of {_MLP_LAYER_TYPES} for each "
                         f"of the {layers} layers, got {types!r}")
    return tuple(types[:layers])


def _eos_token_id(d: Mapping[str, Any]) -> int | list[int] | None:
    """One id, a list of ids (any of which ends a sequence) or null."""
    value = d.get("eos_token_id")
    if isinstance(value, list):
        return [checked_int("eos_token_id", v, 0) for v in value]
    return optional_int(d, "eos_token_id", None, minimum=0)
