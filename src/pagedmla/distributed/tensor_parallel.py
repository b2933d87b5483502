"""Tensor parallelism: this rank's share of a DeepseekForCausalLM, in place.

`parallelize` keeps this rank's share of a model's tensors:

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
heads must, since every rank runs the same attention shapes. A block-fp8 linear layer
keeps its rank's part in fp8, with the scales of the blocks that part covers, when the
part starts on a block boundary (DeepSeek-V3's widths do at tp 2, 4 and 8); a part that
starts inside a block would need scales of another phase than the kernels read, and is
held dequantized in the model dtype instead. Each share is a `Shard`
of a whole-model tensor, recorded by its state_dict key (`TensorParallelLM.shards`).
Run on a model built on the meta device (`shard_for`, the loader's `Sharder`), the same
code gives the rank's module shapes and the shards the checkpoint loader reads, so a
rank never holds the whole model; run on a loaded model (the built-in tiny one), it
cuts the loaded tensors.
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
from pagedmla.models.linear import Linear
from pagedmla.models.loader import Sharder
from pagedmla.models.moe import DenseMLP, MoE
from pagedmla.models.shards import RankShards, Shard
from pagedmla.ops.block_fp8 import dequantize_blocks


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
    rank's: N / tp heads) and config. `shards`: the part of each sharded tensor this
    rank holds, by the whole model's state_dict key."""

    def __init__(
        self, model: DeepseekForCausalLM, lm_head: ParallelLMHead, dims: MLADims,
        shards: dict[str, Shard],
    ):
        super().__init__()
        self.model = model
        self.lm_head = lm_head
        self.dims = dims
        self.config = model.config
        self.shards = shards

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

    def full_key(self, key: str) -> str:
        """The whole model's state_dict key of this module's tensor `key`."""
        if key == "lm_head.weight":
            return "embed_tokens.weight" if self.config.tie_word_embeddings else key
        return key.removeprefix("model.").replace(".mlp.moe.", ".mlp.")

    def rank_shards(self) -> RankShards:
        """How this rank holds the whole model's tensors (for the checkpoint loader)."""
        return RankShards(self.shards, {key: self.full_key(key) for key in self.state_dict()})


class _Cut:
    """This rank's contiguous, balanced parts of ranges, and the Shard taken of each
    whole-model tensor (by state_dict key). `dtype`: the model's, for block-fp8 parts
    held dequantized."""

    def __init__(self, state: ParallelState, dtype: torch.dtype) -> None:
        self.state = state
        self.dtype = dtype
        self.shards: dict[str, Shard] = {}

    def share(self, total: int, unit: int = 1) -> slice:
        """This rank's part of range(total), in `unit`s."""
        r, tp = self.state.tp_rank, self.state.tp_size
        return slice(r * total // tp * unit, (r + 1) * total // tp * unit)

    def padded_share(self, total: int) -> slice:
        """This rank's part of range(total) cut in tp equal parts, the last ones reaching
        past total."""
        size = -(-total // self.state.tp_size)
        return slice(self.state.tp_rank * size, (self.state.tp_rank + 1) * size)

    def take(self, key: str, weight: torch.Tensor, dim: int, part: slice) -> torch.Tensor:
        """A new tensor holding `part` of `weight` (whole-model key `key`) along `dim`,
        zero padded past its end."""
        shard = self.shards[key] = Shard(dim, part.start, part.stop)
        return shard.take(weight)

    def linear(self, key: str, layer: Linear, dim: int, part: slice) -> Linear:
        """`part` of a linear layer's weight (`key`: its whole-model key, without
        ".weight") along `dim`: fp8 with its blocks' scales where `part` starts on a
        block boundary, else dequantized to the model dtype."""
        weight, block = layer.weight, layer.block_size
        if block is None:
            return Linear(self.take(f"{key}.weight", weight, dim, part))
        if part.start % block[dim] == 0:
            blocks = slice(part.start // block[dim], -(-part.stop // block[dim]))
            scale_inv = self.take(f"{key}.weight_scale_inv", layer.weight_scale_inv, dim, blocks)
            return Linear(self.take(f"{key}.weight", weight, dim, part), scale_inv, block,
                          layer.backend)
        if not weight.is_meta:
            weight = dequantize_blocks(weight, layer.weight_scale_inv, block, self.dtype)
        return Linear(self.take(f"{key}.weight", weight.to(self.dtype), dim, part))


def _shard_attention(attn: DeepseekAttention, prefix: str, cut: _Cut) -> None:
    d = attn.dims
    heads = cut.share(d.num_heads)  # an equal share: heads divide by tp
    q_name = "q_proj" if d.q_lora_rank is None else "q_b_proj"
    rows = cut.share(d.num_heads, d.qk_head_dim)
    setattr(attn, q_name, cut.linear(f"{prefix}.{q_name}", getattr(attn, q_name), 0, rows))
    rows = cut.share(d.num_heads, d.qk_nope_head_dim + d.v_head_dim)
    attn.kv_b_proj = cut.linear(f"{prefix}.kv_b_proj", attn.kv_b_proj, 0, rows)
    columns = cut.share(d.num_heads, d.v_head_dim)
    o_proj = cut.linear(f"{prefix}.o_proj", attn.o_proj, 1, columns)
    attn.o_proj = RowParallelLinear(o_proj, cut.state)
    attn.dims = replace(d, num_heads=heads.stop - heads.start)
    old = attn.attn
    attn.attn = MLAAttention(attn.dims, old.softmax_scale, attn.kv_b_proj.weight, old.backend)


def _shard_mlp(mlp: DenseMLP, prefix: str, cut: _Cut, reduce: bool) -> None:
    units = cut.share(mlp.gate_proj.weight.shape[0])
    mlp.gate_proj = cut.linear(f"{prefix}.gate_proj", mlp.gate_proj, 0, units)
    mlp.up_proj = cut.linear(f"{prefix}.up_proj", mlp.up_proj, 0, units)
    down = cut.linear(f"{prefix}.down_proj", mlp.down_proj, 1, units)
    mlp.down_proj = RowParallelLinear(down, cut.state) if reduce else down


def _shard_moe(moe: MoE, prefix: str, cut: _Cut) -> ParallelMoE:
    experts = cut.share(moe.w13.shape[0])
    moe.w13 = nn.Parameter(cut.take(f"{prefix}.w13", moe.w13, 0, experts), requires_grad=False)
    moe.w2 = nn.Parameter(cut.take(f"{prefix}.w2", moe.w2, 0, experts), requires_grad=False)
    if moe.block_size is not None:
        moe.w13_scale_inv = cut.take(f"{prefix}.w13_scale_inv", moe.w13_scale_inv, 0, experts)
        moe.w2_scale_inv = cut.take(f"{prefix}.w2_scale_inv", moe.w2_scale_inv, 0, experts)
    if moe.shared_experts is not None:  # ParallelMoE reduces once
        _shard_mlp(moe.shared_experts, f"{prefix}.shared_experts", cut, reduce=False)
    return ParallelMoE(moe, experts.start, cut.state)


@torch.no_grad()
def parallelize(model: DeepseekForCausalLM, state: ParallelState) -> TensorParallelLM:
    """Shard a model for this TP rank: a loaded one (process_weights_after_loading
    done), or one on the meta device, whose shapes and shards the loader then fills."""
    config = model.config
    check_heads_divisible(config, state.tp_size)
    cut = _Cut(state, model.embed_tokens.weight.dtype)
    for i, layer in enumerate(model.layers):
        _shard_attention(layer.self_attn, f"layers.{i}.self_attn", cut)
        if isinstance(layer.mlp, MoE):
            layer.mlp = _shard_moe(layer.mlp, f"layers.{i}.mlp", cut)
        else:
            _shard_mlp(layer.mlp, f"layers.{i}.mlp", cut, reduce=True)
    vocab = config.vocab_size
    rows = cut.padded_share(vocab)
    embed = cut.take("embed_tokens.weight", model.embed_tokens.weight, 0, rows)
    tied = model.lm_head is None
    head = embed if tied else cut.take("lm_head.weight", model.lm_head.weight, 0, rows)
    model.embed_tokens = VocabParallelEmbedding(embed, rows.start, state)
    model.lm_head = None  # the wrapper's ParallelLMHead replaces it
    dims = replace(model.dims, num_heads=config.num_attention_heads // state.tp_size)
    lm_head = ParallelLMHead(head, vocab, state)
    return TensorParallelLM(model, lm_head, dims, cut.shards)


def shard_for(state: ParallelState) -> Sharder:
    """The loader's Sharder for this rank: `parallelize` and the shards it took."""

    def shard(model: DeepseekForCausalLM) -> tuple[TensorParallelLM, RankShards]:
        sharded = parallelize(model, state)
        return sharded, sharded.rank_shards()

    return shard
