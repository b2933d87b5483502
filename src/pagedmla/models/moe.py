"""Feed-forward blocks of DeepSeek-V2/V3: the dense SwiGLU MLP and the routed MoE.

Routing follows the checkpoint's config: V2 scores experts with a softmax and picks
the top-k greedily, optionally only inside the `topk_group` groups holding the best
single expert (group_limited_greedy); V3 scores with a sigmoid, ranks groups by the sum
of their two best biased scores and picks experts by biased score, but weights them by
the unbiased one (noaux_tc). Router math is float32 whatever the model dtype.
`norm_topk_prob` renormalises the chosen weights for either router (transformers' V2
ignores it, which agrees because DeepSeek-V2 checkpoints set it False).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.models.config import DeepseekConfig
from pagedmla.models.linear import BlockSize, Linear
from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE, scale_grid
from pagedmla.ops.registry import get_backend


class DenseMLP(nn.Module):
    """x [T, H] -> down(silu(gate(x)) * up(x)) [T, H]; block-fp8 weights with
    `block_size`."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
        device: torch.device, block_size: BlockSize | None = None, backend: str = "auto",
    ) -> None:
        super().__init__()
        H, inter = hidden_size, intermediate_size
        self.gate_proj = Linear.empty(H, inter, dtype, device, block_size, backend)
        self.up_proj = Linear.empty(H, inter, dtype, device, block_size, backend)
        self.down_proj = Linear.empty(inter, H, dtype, device, block_size, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Chooses each token's k experts: x [T, H] -> (weights [T, k] float32, ids [T, k] int64).

    `weight` [E, H] and `e_score_correction_bias` [E] (noaux_tc only) are float32. The
    bias shifts the scores used to choose groups and experts; the weights are the
    unshifted scores of the chosen experts, renormalised to sum to 1 when norm_topk_prob,
    then multiplied by routed_scaling_factor.
    """

    def __init__(self, config: DeepseekConfig, device: torch.device) -> None:
        super().__init__()
        self.config = config
        E, H = config.n_routed_experts, config.hidden_size
        self.weight = nn.Parameter(torch.empty(E, H, dtype=torch.float32, device=device))
        bias = None
        if config.topk_method == "noaux_tc":
            bias = torch.empty(E, dtype=torch.float32, device=device)
        self.register_buffer("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        logits = nn.functional.linear(x.float(), self.weight)
        scores = logits.softmax(dim=-1) if c.scoring_func == "softmax" else logits.sigmoid()
        bias = self.e_score_correction_bias
        choice = scores if bias is None else scores + bias
        if c.topk_method != "greedy" and c.topk_group < c.n_group:
            grouped = choice.view(x.shape[0], c.n_group, -1)
            if c.topk_method == "noaux_tc":
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.amax(dim=-1)
            kept = group_scores.topk(c.topk_group, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        ids = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts plus always-on shared experts: x [T, H] -> [T, H].

    Expert weights are stacked: w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I],
    in the model dtype, or for a block-fp8 checkpoint (config.weight_block_size) in fp8
    with `w13_scale_inv` [E, 2, ceil(I / bn), ceil(H / bk)] and `w2_scale_inv` [E,
    ceil(H / bn), ceil(I / bk)] (`ops/block_fp8.py`).
    """

    def __init__(
        self, config: DeepseekConfig, dtype: torch.dtype, device: torch.device,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.backend = backend
        E, H, inter = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate = Router(config, device)
        block = self.block_size = config.weight_block_size
        weight_dtype = dtype if block is None else FP8_WEIGHT_DTYPE
        self.w13 = nn.Parameter(torch.empty(E, 2 * inter, H, dtype=weight_dtype, device=device))
        self.w2 = nn.Parameter(torch.empty(E, H, inter, dtype=weight_dtype, device=device))
        w13_scale = w2_scale = None
        if block is not None:
            w13_scale = torch.empty(E, 2, *scale_grid((inter, H), block), device=device)
            w2_scale = torch.empty(E, *scale_grid((H, inter), block), device=device)
        self.register_buffer("w13_scale_inv", w13_scale)
        self.register_buffer("w2_scale_inv", w2_scale)
        self.shared_experts = (
            DenseMLP(H, inter * config.n_shared_experts, dtype, device, block, backend)
            if config.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sum over each token's k experts of weight * expert(x): x [T, H] -> [T, H]; an
        id >= E (an expert another rank holds, under tensor parallelism) is skipped.
        The backend's `fused_experts` does the work (the Triton one without a host
        synchronisation, so that decode steps with experts can be captured in graphs)."""
        ops = get_backend(self.backend, x.device)
        if self.block_size is None:
            return ops.fused_experts(x, self.w13, self.w2, weights, ids)
        return ops.fused_experts(
            x, self.w13, self.w2, weights, ids, w13_scale_inv=self.w13_scale_inv,
            w2_scale_inv=self.w2_scale_inv, block_size=self.block_size,
        )
