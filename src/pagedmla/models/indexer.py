"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): per query
token, the top-k earlier positions its MLA layer attends to.

Module and parameter names mirror the Hugging Face checkpoints (`self_attn.indexer.*`):

    q      = wq_b(q_latent)                  [T, H, D]   q_latent = q_a_layernorm(q_a_proj(x))
    k      = k_norm(wk(x))                   [T, D]      k_norm a LayerNorm (weight, bias), eps 1e-6
    q, k  <- rope on their FIRST R dims      (the main attention ropes its LAST R dims)
    w      = weights_proj(x) * H^-0.5 * D^-0.5   [T, H]
    top-k  = ops/reference_indexer.indexer_topk(q, w, key cache, ...)

The indexer's rope pairs dims (i, i + R/2) in DeepSeek-V3.2 ("rotate half", unlike its
main attention's interleaved pairs (2i, 2i + 1)) and (2i, 2i + 1) in GLM-5, as transformers
and the config's `indexer_rope_interleave` say; cos/sin are the main attention's tables
(same positions, frequencies and YaRN magnitude). GLM-5 runs the indexer only on
"full" layers (`indexer_types`); a "shared" layer has no indexer weights and reuses the
top-k of the nearest full layer before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedmla.metadata import BatchSpec
from pagedmla.models.config import _flag, _optional_int, _required_int
from pagedmla.models.linear import BlockSize, Linear
from pagedmla.ops.reference import apply_rope
from pagedmla.ops.reference_indexer import indexer_topk, write_indexer_cache

DSA_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
# transformers hard-codes each model's indexer rope layout; vLLM reads it from config.json.
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
        types = [{"F": FULL, "S": SHARED}[c] for c in pattern] if isinstance(pattern, str) \
            else list(pattern)
    if types is None:
        freq = max(_optional_int(d, "index_topk_freq", 1), 1)
        offset = _optional_int(d, "index_skip_topk_offset", 2, minimum=0)
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
        config = cls(
            hidden_size=_required_int(d, "hidden_size"),
            q_lora_rank=_required_int(d, "q_lora_rank"),
            num_heads=_required_int(d, "index_n_heads"),
            head_dim=_required_int(d, "index_head_dim"),
            rope_dim=_required_int(d, "qk_rope_head_dim", minimum=0),
            topk=_required_int(d, "index_topk"),
            rope_interleaved=_flag(d, "indexer_rope_interleave",
                                   _INDEXER_ROPE_INTERLEAVE[model_type]),
            layer_types=indexer_types(d, _required_int(d, "num_hidden_layers")),
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


@dataclass
class IndexerMetadata:
    """What `Indexer.forward` needs of a step, on the device: block_table [B, max_blocks]
    int32 (the latent cache's), seq_lens [B] int32, query_start_loc [B + 1] int32,
    slot_mapping [T] int64 (-1: no write), and max_seq_len (host int)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int

    @classmethod
    def from_spec(cls, spec: BatchSpec, device: str | torch.device = "cpu") -> IndexerMetadata:
        starts = [0]
        for q_len in spec.query_lens:
            starts.append(starts[-1] + q_len)
        return cls(
            block_table=spec.block_table.to(device, torch.int32),
            seq_lens=torch.tensor(list(spec.seq_lens), dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            slot_mapping=spec.slot_mapping.to(device, torch.int64),
            max_seq_len=max(spec.seq_lens, default=0),
        )


class Indexer(nn.Module):
    """hidden [T, hidden_size], q_latent [T, q_lora_rank] -> top-k positions [T, topk]
    int32 (-1: unused slot), writing this step's keys into the layer's key cache first.

    `block_size` (rows, columns) makes wq_b and wk block-fp8 layers, as in the released
    checkpoints; weights_proj and k_norm stay in the model dtype.
    """

    def __init__(
        self, config: IndexerConfig, dtype: torch.dtype, device: str | torch.device,
        block_size: BlockSize | None = None, backend: str = "auto",
    ) -> None:
        super().__init__()
        c = config
        self.config = c
        self.wq_b = Linear.empty(c.q_lora_rank, c.num_heads * c.head_dim, dtype, device,
                                 block_size, backend)
        self.wk = Linear.empty(c.hidden_size, c.head_dim, dtype, device, block_size, backend)
        self.k_norm = nn.LayerNorm(c.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.weights_proj = Linear.empty(c.hidden_size, c.num_heads, dtype, device)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, ..., D] with its first R dims rotated (this model's pairing)."""
        R = self.config.rope_dim
        if R == 0:
            return x
        rotated = apply_rope(x[..., :R], cos, sin, self.config.rope_interleaved)
        return torch.cat([rotated, x[..., R:]], dim=-1)

    def project(
        self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [T, H, D], k [T, D], weights [T, H] float32), rope applied."""
        c = self.config
        q = self.wq_b(q_latent).view(-1, c.num_heads, c.head_dim)
        k = self.k_norm(self.wk(hidden))
        weights = self.weights_proj(hidden).float() * c.weights_scale
        return self.rope(q, cos, sin), self.rope(k, cos, sin), weights

    @torch.no_grad()
    def forward(
        self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
        sin: torch.Tensor, cache: torch.Tensor, meta: IndexerMetadata,
    ) -> torch.Tensor:
        """cos/sin [T, R/2] float32 (the model's rope tables at the tokens' positions);
        cache the layer's key cache (`allocate_indexer_cache`)."""
        q, k, weights = self.project(hidden, q_latent, cos, sin)
        write_indexer_cache(cache, k, meta.slot_mapping)
        return indexer_topk(q, weights, cache, meta.block_table, meta.seq_lens,
                            meta.query_start_loc, meta.max_seq_len, self.config.topk)

