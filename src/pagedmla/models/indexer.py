"""The lightning indexer of DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): per query
token, the top-k earlier positions its MLA layer attends to.

Module and parameter names mirror the Hugging Face checkpoints (`self_attn.indexer.*`):

    q      = wq_b(q_latent)                  [T, H, D]   q_latent = q_a_layernorm(q_a_proj(x))
    k      = k_norm(wk(x))                   [T, D]      k_norm a LayerNorm (weight, bias), eps 1e-6
    q, k  <- rope on their FIRST R dims      (the main attention ropes its LAST R dims)
    w      = weights_proj(x) * H^-0.5 * D^-0.5   [T, H]
    top-k  = the backend's indexer_topk(q, w, key cache, ...)

x is the layer's normed input. The rope pairing is the model's (`IndexerConfig`); cos
and sin are the main attention's tables (same positions, frequencies and YaRN
magnitude).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.metadata import SparseMetadata
from pagedmla.models.dsa_config import IndexerConfig
from pagedmla.models.linear import BlockSize, Linear
from pagedmla.ops.reference import apply_rope
from pagedmla.ops.registry import get_backend


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
        self.backend = backend
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

    def forward(
        self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor | None,
        sin: torch.Tensor | None, keys: torch.Tensor, slot_mapping: torch.Tensor,
        sparse: SparseMetadata,
    ) -> torch.Tensor | None:
        """Write this step's keys (at slot_mapping [T], -1: none) into `keys`, the layer's
        key cache (`allocate_indexer_cache`), and return each token's top-k positions;
        None where the batch is dense (`sparse.dense`: every token selects its whole
        context). cos/sin [T, R/2] float32: the model's rope tables at the tokens'
        positions."""
        c = self.config
        k = self.k_norm(self.wk(hidden))
        if cos is not None:
            k = self.rope(k, cos, sin)
        ops = get_backend(self.backend, k.device)
        ops.write_indexer_cache(keys, k, slot_mapping)
        if sparse.dense:
            return None
        q = self.wq_b(q_latent).view(-1, c.num_heads, c.head_dim)
        if cos is not None:
            q = self.rope(q, cos, sin)
        weights = self.weights_proj(hidden).float() * c.weights_scale
        return ops.indexer_topk(q, weights, keys, sparse.block_table, sparse.seq_lens,
                                sparse.query_start_loc, sparse.max_seq_len, sparse.topk)
