"""The lightning indexer's hyper-parameters (DeepSeek Sparse Attention: DeepSeek-V3.2,
GLM-5), parsed from config.json.

The indexer's rope pairs dims (i, i + R/2) in DeepSeek-V3.2 ("rotate half", unlike its
main attention's interleaved pairs (2i, 2i + 1)) and (2i, 2i + 1) in GLM-5, as
transformers hard-codes per model and `indexer_rope_interleave` may state. GLM-5 runs
the indexer only on "full" layers (`indexer_types`); a "shared" layer has no indexer
weights and reuses the top-k of the nearest full layer before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedmla.models.config_values import flag, optional_int, required_int

DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
_INDEXER_ROPE_INTERLEAVE = {"deepseek_v32": False, "glm_moe_dsa": True}
FULL, SHARED = "full", "shared"


def indexer_types(d: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per layer "full" (runs its indexer) or "shared" (reuses the top-k of the nearest
    full layer before it), as transformers' GlmMoeDsaConfig derives it: `indexer_types`
    if given; else `index_topk_pattern` ("F"/"S" per layer); else layer i is full when
    max(i - offset + 1, 0) % freq == 0 (freq = `index_topk_freq`, default 1: every layer;
    offset = `index_skip_topk_offset`, default 2). DeepSeek-V3.2: every layer is full."""
    if d.get("model_type") != "glm_moe_dsa":
        return (FULL,) * num_layers
    types = d.get("indexer_types")
    if types is None and d.get("index_topk_pattern") is not None:
        pattern = d["index_topk_pattern"]
        types = [{"F": FULL, "S": SHARED}.get(c, c) for c in pattern] \
            if isinstance(pattern, str) else list(pattern)
    if types is None:
        freq = max(optional_int(d, "index_topk_freq", 1), 1)
        offset = optional_int(d, "index_skip_topk_offset", 2, minimum=0)
        types = [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED
                 for i in range(num_layers)]
    types = tuple(types)
    if len(types) < num_layers or any(t not in (FULL, SHARED) for t in types):
        raise ValueError(f"indexer_types must give 'full' or 'shared' for each of the "
                         f"{num_layers} layers, got {list(types)!r}")
    if num_layers and types[0] != FULL:
        raise ValueError(f"indexer_types[0] must be 'full' (a shared layer reuses an "
                         f"earlier layer's top-k), got {types[0]!r}")
    return types[:num_layers]


@dataclass(frozen=True)
class IndexerConfig:
    """The indexer's hyper-parameters (config.json names in the comments)."""

    hidden_size: int  # hidden_size
    q_lora_rank: int  # q_lora_rank (the indexer's queries come from the q latent)
    num_heads: int  # index_n_heads, H
    head_dim: int  # index_head_dim, D
    rope_dim: int  # qk_rope_head_dim, R <= D
    topk: int  # index_topk
    rope_interleaved: bool  # indexer_rope_interleave
    layer_types: tuple[str, ...]  # indexer_types

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> IndexerConfig:
        """Parse a `deepseek_v32` or `glm_moe_dsa` config.json dict (ValueError naming
        the key for a missing or out-of-range value)."""
        model_type = d.get("model_type")
        if model_type not in DSA_MODEL_TYPES:
            raise ValueError(f"an indexer needs model_type in {DSA_MODEL_TYPES}, "
                             f"got {model_type!r}")
        if d.get("q_lora_rank") is None:
            raise ValueError("missing required key 'q_lora_rank' (the indexer's queries "
                             "come from the q latent)")
        config = cls(
            hidden_size=required_int(d, "hidden_size"),
            q_lora_rank=required_int(d, "q_lora_rank"),
            num_heads=required_int(d, "index_n_heads"),
            head_dim=required_int(d, "index_head_dim"),
            rope_dim=required_int(d, "qk_rope_head_dim", minimum=0),
            topk=required_int(d, "index_topk"),
            rope_interleaved=flag(d, "indexer_rope_interleave",
                                  _INDEXER_ROPE_INTERLEAVE[model_type]),
            layer_types=indexer_types(d, required_int(d, "num_hidden_layers")),
        )
        if config.rope_dim > config.head_dim or config.rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even and <= index_head_dim "
                             f"{config.head_dim}, got {config.rope_dim}")
        return config

    def has_indexer(self, layer: int) -> bool:
        """Whether `layer` computes its own top-k (else it reuses an earlier layer's)."""
        return self.layer_types[layer] == FULL

    @property
    def weights_scale(self) -> float:
        """H^-0.5 * D^-0.5: folded into the head weights."""
        return (self.num_heads * self.head_dim) ** -0.5
