"""Bias-free linear layers whose weight is in the model dtype or block-scaled fp8.

A DeepSeek-V3 checkpoint ships its linear weights as float8_e4m3fn with a float32
`weight_scale_inv` per 128 x 128 block (`ops/block_fp8.py`). `Linear` keeps them so:
`weight` [N, K] fp8 and `weight_scale_inv` [ceil(N / bn), ceil(K / bk)] in its
state_dict, and the backend's `fp8_linear` multiplies (the Triton one quantizes the
activations per token and group and runs an fp8 GEMM; the reference one dequantizes the
weight on every call, exactly the dequantized checkpoint). Without a block size the
weight is in the model dtype and the layer is `torch.nn.functional.linear`.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE, scale_grid
from pagedmla.ops.registry import get_backend

BlockSize = tuple[int, int]


class Linear(nn.Module):
    """x [T, K] -> x @ W.T [T, N], W in the model dtype or block-fp8 (`block_size` set)."""

    def __init__(
        self, weight: torch.Tensor, scale_inv: torch.Tensor | None = None,
        block_size: BlockSize | None = None, backend: str = "auto",
    ) -> None:
        super().__init__()
        if (scale_inv is None) != (block_size is None):
            raise ValueError("a block-fp8 weight needs both scale_inv and block_size")
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.register_buffer("weight_scale_inv", scale_inv)
        self.block_size = block_size
        self.backend = backend

    @classmethod
    def empty(
        cls, in_features: int, out_features: int, dtype: torch.dtype,
        device: torch.device | str, block_size: BlockSize | None = None, backend: str = "auto",
    ) -> Linear:
        """A layer whose tensors are left uninitialised (the checkpoint fills them):
        fp8 with its scales when `block_size` is given, else in `dtype`."""
        if block_size is None:
            return cls(torch.empty(out_features, in_features, dtype=dtype, device=device))
        weight = torch.empty(out_features, in_features, dtype=FP8_WEIGHT_DTYPE, device=device)
        grid = scale_grid((out_features, in_features), block_size)
        scale_inv = torch.empty(grid, dtype=torch.float32, device=device)
        return cls(weight, scale_inv, block_size, backend)

    @property
    def is_fp8(self) -> bool:
        return self.block_size is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block_size is None:
            return nn.functional.linear(x, self.weight)
        ops = get_backend(self.backend, x.device)
        return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.block_size)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        fp8 = f", fp8 blocks {self.block_size}" if self.block_size else ""
        return f"in_features={inp}, out_features={out}{fp8}"
