"""Tensor parallelism as a post-build step: shard a loaded single-GPU model in place.

Every rank loads the full weights, then `parallelize` keeps its share:

* attention: heads [r * N / tp, (r + 1) * N / tp): q_proj / q_b_proj and kv_b_proj
  keep those heads' rows (column parallel), MLAAttention is rebuilt for N / tp heads,
  o_proj keeps their columns and all-reduces (row parallel). The latent path
  (q_a_proj, kv_a_proj_with_mqa and their norms) stays whole: MLA has one latent per
  token, so the latent cache is the same on every rank and never split by heads.
* dense MLP: a slice of the intermediate units (gate/up rows, down columns + all-reduce).
* MoE: routing on every rank, a contiguous range of the routed experts per rank, the
  shared experts split like the MLP, one all-reduce for the sum.
* embedding and LM head: vocabulary shards (masked lookup + all-reduce; all-gathered
  logits).

The ranges need not divide evenly (intermediate units, experts, vocabulary); only the
heads must, since every rank runs the same attention shapes.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from pagedmla.attention import MLAAttention
from pagedmla.cache import LatentKVCache
from pagedmla.dims import MLADims
from pagedmla.distributed.layers import (
    ParallelLMHead,
    ParallelMoE,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedmla.distributed.state import ParallelState
from pagedmla.metadata import MLAMetadata
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekAttention, DeepseekForCausalLM
from pagedmla.models.moe import DenseMLP, MoE


def check_heads_divisible(config: DeepseekConfig, tensor_parallel_size: int) -> None:
    """ValueError unless every rank can hold the same number of attention heads."""
    heads = config.num_attention_heads
    if heads % tensor_parallel_size:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by tensor_parallel_size "
            f"({tensor_parallel_size})"
        )


class TensorParallelLM(nn.Module):
    """A DeepseekForCausalLM sharded over the TP group, with the engine's model interface:
    forward(input_ids [T], positions [T], caches, meta) -> hidden [T, H] (replicated),
    compute_logits(hidden [B, H]) -> [B, vocab] float32 (all-gathered), dims (this
    rank's: N / tp heads) and config."""

    def __init__(self, model: DeepseekForCausalLM, lm_head: ParallelLMHead, dims: MLADims):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.dims = dims
        self.config = model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[LatentKVCache],
        meta: MLAMetadata,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @property
    def decoder(self) -> DeepseekForCausalLM:
        """The sharded layers' owner (`PiecewiseGraphs` runs them piece by piece)."""
        return self.model


def _share(total: int, state: ParallelState) -> slice:
    """This rank's contiguous, balanced part of range(total)."""
    r, tp = state.tp_rank, state.tp_size
    return slice(r * total // tp, (r + 1) * total // tp)


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free nn.Linear owning a copy of `weight` (so the full tensor can be freed)."""
    layer = nn.utils.skip_init(
        nn.Linear, weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype,
        device=weight.device,
    )
    layer.weight.requires_grad_(False).copy_(weight)
    return layer


def _head_rows(weight: torch.Tensor, heads: slice, per_head: int) -> torch.Tensor:
    return weight[heads.start * per_head : heads.stop * per_head]


def _shard_attention(attn: DeepseekAttention, state: ParallelState) -> None:
    d = attn.dims
    heads = _share(d.num_heads, state)  # an equal share: heads divide by tp
    if d.q_lora_rank is None:
        attn.q_proj = _linear(_head_rows(attn.q_proj.weight, heads, d.qk_head_dim))
    else:
        attn.q_b_proj = _linear(_head_rows(attn.q_b_proj.weight, heads, d.qk_head_dim))
    kv_b = _head_rows(attn.kv_b_proj.weight, heads, d.qk_nope_head_dim + d.v_head_dim)
    attn.kv_b_proj = _linear(kv_b)
    columns = slice(heads.start * d.v_head_dim, heads.stop * d.v_head_dim)
    attn.o_proj = RowParallelLinear(attn.o_proj.weight[:, columns].clone(), state)
    attn.dims = replace(d, num_heads=heads.stop - heads.start)
    old = attn.attn
    attn.attn = MLAAttention(attn.dims, old.softmax_scale, attn.kv_b_proj.weight, old.backend)


def _shard_mlp(mlp: DenseMLP, state: ParallelState, reduce: bool) -> None:
    units = _share(mlp.gate_proj.weight.shape[0], state)
    mlp.gate_proj = _linear(mlp.gate_proj.weight[units])
    mlp.up_proj = _linear(mlp.up_proj.weight[units])
    down = mlp.down_proj.weight[:, units].clone()
    mlp.down_proj = RowParallelLinear(down, state) if reduce else _linear(down)


def _shard_moe(moe: MoE, state: ParallelState) -> ParallelMoE:
    experts = _share(moe.w13.shape[0], state)
    moe.w13 = nn.Parameter(moe.w13[experts].clone(), requires_grad=False)
    moe.w2 = nn.Parameter(moe.w2[experts].clone(), requires_grad=False)
    if moe.shared_experts is not None:
        _shard_mlp(moe.shared_experts, state, reduce=False)  # ParallelMoE reduces once
    return ParallelMoE(moe, experts.start, state)


def _vocab_shard(weight: torch.Tensor, state: ParallelState) -> tuple[torch.Tensor, int]:
    """(rows [r * shard, (r + 1) * shard) of weight [vocab, H], zero padded; first id)."""
    shard = -(-weight.shape[0] // state.tp_size)
    first = state.tp_rank * shard
    local = weight.new_zeros(shard, weight.shape[1])
    rows = weight[first : first + shard]
    local[: rows.shape[0]] = rows
    return local, first


@torch.no_grad()
def parallelize(model: DeepseekForCausalLM, state: ParallelState) -> TensorParallelLM:
    """Shard a loaded model (process_weights_after_loading done) for this TP rank."""
    config = model.config
    check_heads_divisible(config, state.tp_size)
    for layer in model.layers:
        _shard_attention(layer.self_attn, state)
        if isinstance(layer.mlp, MoE):
            layer.mlp = _shard_moe(layer.mlp, state)
        else:
            _shard_mlp(layer.mlp, state, reduce=True)
    embed_shard, first = _vocab_shard(model.embed_tokens.weight, state)
    tied = model.lm_head is None
    head_shard = embed_shard if tied else _vocab_shard(model.lm_head.weight, state)[0]
    model.embed_tokens = VocabParallelEmbedding(embed_shard, first, state)
    model.lm_head = None  # the wrapper's ParallelLMHead replaces it
    dims = replace(model.dims, num_heads=config.num_attention_heads // state.tp_size)
    return TensorParallelLM(model, ParallelLMHead(head_shard, config.vocab_size, state), dims)
