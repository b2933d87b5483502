"""Rotary position embedding for the R rotated dims of MLA, with DeepSeek's YaRN scaling.

DeepSeek checkpoints store q_pe / k_pe *interleaved*: dims (2i, 2i+1) form the pair that
frequency i rotates (DeepSeek-V2 writes this as a complex product over adjacent pairs).
Non-interleaved checkpoints pair dim i with dim i + R/2 (the "rotate half" layout).
Either way the rotation (the backend op `rotary`) returns the rotated pairs as [first
members | second members].
For interleaved inputs that permutes the output relative to the V2 complex form, but
q_pe and k_pe get the same permutation, so every q·k and the attention are unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pagedmla.dims import yarn_mscale


def yarn_inv_freq(
    dim: int, theta: float, scaling: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """YaRN inverse frequencies [dim // 2] (float32) and the cos/sin magnitude scale.

    Low frequencies (many rotations' worth of wavelength beyond the original context)
    are interpolated by `factor`, high ones kept, with a linear ramp between the dims
    where beta_fast and beta_slow rotations fit in the original context. The magnitude
    is yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim), DeepSeek's
    definition, unless the config gives `attention_factor` directly.
    """
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor") or max_position_embeddings / original
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # keeps the ramp finite when both bounds land on one dim
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1.0 - ramp  # 1: keep the original frequency, 0: interpolate fully
    inv_freq = (1.0 / (factor * base)) * ramp + (1.0 / base) * extrapolate

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = yarn_mscale(factor, scaling.get("mscale") or 1.0) / yarn_mscale(
            factor, scaling.get("mscale_all_dim") or 0.0
        )
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_position_embeddings), built on first use.

    forward(positions [T] int64) -> (cos [T, R/2], sin [T, R/2]) in float32, already
    multiplied by the YaRN magnitude scale. The table lives on the device of the first
    positions seen; positions must be below max_position_embeddings (not checked, so a
    step never waits for the device).
    """

    def __init__(
        self,
        rope_dim: int,
        theta: float,
        max_position_embeddings: int,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if rope_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {rope_dim}")
        self.rope_dim = rope_dim
        self.max_position_embeddings = max_position_embeddings
        if scaling is None:
            inv_freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
            self.magnitude = 1.0
        else:
            inv_freq, self.magnitude = yarn_inv_freq(
                rope_dim, theta, scaling, max_position_embeddings
            )
        self.inv_freq = inv_freq
        # Buffers, not plain attributes: torch.compile takes them as inputs of the graph
        # rather than baking (and copying) a constant table into it.
        self._cos: torch.Tensor | None
        self._sin: torch.Tensor | None
        self.register_buffer("_cos", None, persistent=False)
        self.register_buffer("_sin", None, persistent=False)

    def build(self, device: torch.device) -> None:
        """Make the cos / sin tables on `device` unless they are there already."""
        if self._cos is not None and self._cos.device == device:
            return
        positions = torch.arange(self.max_position_embeddings, dtype=torch.float32, device=device)
        angles = positions[:, None] * self.inv_freq.to(device)[None, :]
        self._cos = angles.cos() * self.magnitude
        self._sin = angles.sin() * self.magnitude

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.build(positions.device)
        return self._cos[positions], self._sin[positions]

