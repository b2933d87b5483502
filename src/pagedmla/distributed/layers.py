"""Tensor parallel layers: each holds this rank's shard of a weight and communicates.

They replace single-GPU modules after the model is built (tensor_parallel.py), so the
model code stays the single-GPU code. Column-parallel layers need no module of their
own: a smaller nn.Linear whose output stays sharded feeds a RowParallelLinear (or the
per-head attention), and one all-reduce per block restores the full activation.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.distributed.state import ParallelState
from pagedmla.models.linear import Linear
from pagedmla.models.moe import MoE


class RowParallelLinear(Linear):
    """x [T, in / tp] (this rank's input columns) -> all-reduced x @ W.T, [T, out]; W
    this rank's columns of the weight, in the model dtype or block-fp8 (as `Linear`)."""

    def __init__(self, layer: Linear, state: ParallelState) -> None:
        super().__init__(layer.weight, layer.weight_scale_inv, layer.block_size, layer.backend)
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.state.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """ids [T] -> [T, H]; this rank holds rows [first, first + shard) of the table, zero
    padded past the vocabulary, and contributes zeros for ids outside its rows."""

    def __init__(self, weight: torch.Tensor, first: int, state: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.first = first
        self.state = state

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return self.state.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


class ParallelLMHead(nn.Module):
    """hidden [B, H] -> logits [B, vocab] float32: this rank's vocabulary shard [shard, H]
    (rank r holds ids [r * shard, (r + 1) * shard)), all-gathered over the TP group."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, state: ParallelState) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size
        self.state = state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = nn.functional.linear(hidden, self.weight).float()  # [B, shard]
        if hidden.shape[0] == 0:  # the same on every rank: nobody joins a collective
            return local.new_empty(0, self.vocab_size)
        shards = self.state.tp_all_gather(local)  # [tp, B, shard]
        return shards.permute(1, 0, 2).reshape(hidden.shape[0], -1)[:, : self.vocab_size]


class ParallelMoE(nn.Module):
    """x [T, H] -> [T, H]: routing on every rank, this rank's experts and its share of the
    shared experts, one all-reduce.

    `moe` holds routed experts [first, first + E_local) only (ids outside are another
    rank's: MoE.experts skips them) and shared experts sharded like a dense MLP whose
    down projection is a plain, not all-reduced, linear.
    """

    def __init__(self, moe: MoE, first: int, state: ParallelState) -> None:
        super().__init__()
        self.moe = moe
        self.first = first
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.moe.gate(x)
        local = ids - self.first
        num_local = self.moe.w13.shape[0]
        mine = (local >= 0) & (local < num_local)
        out = self.moe.experts(x, weights, torch.where(mine, local, num_local))
        if self.moe.shared_experts is not None:
            out = out + self.moe.shared_experts(x)
        return self.state.all_reduce(out)
