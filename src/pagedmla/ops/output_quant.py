"""The attention output handed to o_proj already quantized to fp8.

`OutputQuant` names one of two formats, both float8_e4m3fn codes of the output
x [T, C] (C = N * V) with float32 scales:

- per token and group of `group` channels (DeepSeek's block-fp8 o_proj: group 128, its
  K block), power-of-two scales: s = 2^ceil(log2(amax / 448)), the smallest power of
  two that keeps the group's codes within +-448 (UE8M0, as DeepGEMM's scales), so that
  x / s is exact and only the rounding to e4m3 loses bits. An all-zero group gets s = 0
  and zero codes, a group holding NaN a NaN scale. The scales are stored [G, T], each
  group's contiguous across tokens as the block-fp8 GEMM's K step loads them, and seen
  as the transposed view [T, G].
- per tensor with a static scale s (float32 [1], e.g. a checkpoint's input_scale):
  codes = x / s saturated to +-448; NaN stays NaN.

`quantize_output` is the executable specification (plain PyTorch). The Triton backend
writes the same codes and scales from the epilogues of the kernels that write the
output last (the decode's V up-projection, the prefill merge), or in one pass where no
kernel of ours does (a prefill without context, whose attention kernel may be cuDNN's,
replaces its copy into the output by that pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedmla.ops import reference
from pagedmla.ops.block_fp8 import E4M3_MAX, FP8_WEIGHT_DTYPE, dequantize_blocks


@dataclass(frozen=True)
class OutputQuant:
    """One of the two formats: `group` (a power of two >= 16) or `scale` (a float32
    tensor of one positive finite value, on the output's device)."""

    group: int | None = None
    scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.group is None) == (self.scale is None):
            raise ValueError("OutputQuant takes exactly one of group (per token and group) "
                             "and scale (per tensor, static)")
        if self.group is not None:
            g = self.group
            if isinstance(g, bool) or not isinstance(g, int) or g < 16 or g & (g - 1):
                raise ValueError(f"group must be a power of two >= 16, got {g!r}")
            return
        s = self.scale
        if (not isinstance(s, torch.Tensor) or s.numel() != 1 or s.dtype != torch.float32
                or not bool(torch.isfinite(s).all() and (s > 0).all())):
            raise ValueError(f"scale must be a float32 tensor of one positive finite value, "
                             f"got {s!r}")

    def check_width(self, width: int) -> None:
        """ValueError unless the group divides the output's width C."""
        if self.group is not None and width % self.group:
            raise ValueError(f"the output's width {width} (N * V) is not a multiple of the "
                             f"quantization group {self.group}")


@dataclass
class QuantizedOutput:
    """codes [T, C] float8_e4m3fn and scales: [T, C / group] float32 (a transposed view
    of [C / group, T]) per group, or the static scale [1] per tensor."""

    codes: torch.Tensor
    scales: torch.Tensor
    quant: OutputQuant

    @classmethod
    def empty(cls, num_tokens: int, width: int, quant: OutputQuant,
              device: torch.device) -> QuantizedOutput:
        quant.check_width(width)
        codes = torch.empty(num_tokens, width, dtype=FP8_WEIGHT_DTYPE, device=device)
        if quant.group is None:
            assert quant.scale is not None
            return cls(codes, quant.scale.reshape(1).to(device), quant)
        scales = torch.empty(width // quant.group, num_tokens, dtype=torch.float32,
                             device=device)
        return cls(codes, scales.t(), quant)

    def rows(self, rows: slice) -> QuantizedOutput:
        """The tokens `rows` (views)."""
        scales = self.scales if self.quant.group is None else self.scales[rows]
        return QuantizedOutput(self.codes[rows], scales, self.quant)

    def dequantize(self) -> torch.Tensor:
        """codes * scales, float32 [T, C]."""
        codes = self.codes.float()
        if self.quant.group is None:
            return codes * self.scales
        T, C = codes.shape
        return (codes.view(T, -1, self.quant.group) * self.scales[..., None]).view(T, C)


def power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(amax / 448)) in float32, exactly (from the bits: a quotient that is not
    a power of two rounds its exponent up); 0 for amax 0, NaN for NaN."""
    ratio = amax.float() / E4M3_MAX
    bits = ratio.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    up = exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    scales = (up << 23).view(torch.float32)
    return torch.where(ratio.isnan(), ratio, scales)


def quantize_output(x: torch.Tensor, out: QuantizedOutput) -> None:
    """x [T, C] (any float dtype) -> out's codes and scales, in its format."""
    x = x.float()
    if out.quant.group is None:
        codes = (x / out.scales).clamp(-E4M3_MAX, E4M3_MAX)  # clamp keeps NaN
        out.codes.copy_(codes.to(FP8_WEIGHT_DTYPE))
        return
    T, C = x.shape
    grouped = x.view(T, -1, out.quant.group)
    scales = power_of_two_scales(grouped.abs().amax(dim=-1))
    divisor = torch.where(scales == 0, 1.0, scales)[..., None]
    out.codes.copy_((grouped / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_WEIGHT_DTYPE)
                    .view(T, C))
    out.scales.copy_(scales)


def v_up_proj_quant(latent: torch.Tensor, W_UV: torch.Tensor, out: QuantizedOutput) -> None:
    """latent [T, N, L] @ W_UV [N, L, V] per head -> out ([T, N * V] quantized): the
    decode output's up-projection, quantized from its float32 products."""
    heads = torch.bmm(latent.float().transpose(0, 1), W_UV.float())  # [N, T, V]
    quantize_output(heads.transpose(0, 1).reshape(latent.shape[0], -1), out)


def merge_attn_states_quant(
    prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor, out: QuantizedOutput,
) -> None:
    """`reference.merge_attn_states` of two partials [T, N, D] (lse [N, T]) into out
    ([T, N * D] quantized), from the float32 merge."""
    merged = torch.empty(prefix_output.shape, dtype=torch.float32, device=prefix_output.device)
    reference.merge_attn_states(prefix_output, prefix_lse, suffix_output, suffix_lse, merged, None)
    quantize_output(merged.view(merged.shape[0], -1), out)


def fp8_linear_quantized(
    x: QuantizedOutput, weight: torch.Tensor, scale_inv: torch.Tensor,
    block_size: tuple[int, int], dtype: torch.dtype,
) -> torch.Tensor:
    """A block-fp8 linear layer on quantized activations: x [M, K] (dequantized exactly,
    in float32) @ W.T -> [M, N] in `dtype` (W dequantized, `block_fp8`)."""
    w = dequantize_blocks(weight, scale_inv, block_size)
    return torch.nn.functional.linear(x.dequantize(), w).to(dtype)
