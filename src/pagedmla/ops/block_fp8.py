"""DeepSeek's block-scaled fp8 weights: their layout and their dequantization.

A weight W [N, K] is stored as float8_e4m3fn with a float32 `scale_inv` of one scale per
bn x bk block ([ceil(N / bn), ceil(K / bk)], blocks at the bottom and right edges may be
partial): W = W_fp8 * scale_inv[n // bn, k // bk]. DeepSeek-V3's checkpoints use 128 x
128 blocks for every linear layer but the embedding, the LM head and the router.

Routed experts are stacked (`models/moe.py`): w13 [E, 2I, H] (gate rows, then up rows)
and w2 [E, H, I]. Their scales keep each checkpoint tensor's own blocks: w13's are
[E, 2, ceil(I / bn), ceil(H / bk)] (the gate's, then the up projection's, so that an I
that is not a multiple of bn needs no padding) and w2's are [E, ceil(H / bn),
ceil(I / bk)].

Activations are quantized per token and bk-channel group, as DeepSeek's inference does:
s = amax(|x_group|) / 448 (float32), x_fp8 = x / s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

FP8_WEIGHT_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
DEFAULT_BLOCK_SIZE = (128, 128)


def scale_grid(shape: Sequence[int], block_size: Sequence[int]) -> tuple[int, int]:
    """The scale grid [ceil(N / bn), ceil(K / bk)] of a weight of shape [N, K]."""
    return math.ceil(shape[0] / block_size[0]), math.ceil(shape[1] / block_size[1])


def dequantize_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
    origin: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """weight.float() * the scale of each element's block, formed in float32, then cast
    to `dtype`.

    weight [r, c] (fp8) is the part of a quantized weight that starts at row and column
    `origin`; scale_inv holds the blocks that part touches, [ceil((o_r + r) / bn) -
    o_r // bn, likewise for columns] (for origin (0, 0), the weight's scale grid).
    """
    rows, cols = weight.shape
    index = []
    for start, size, block in zip(origin, (rows, cols), block_size):
        index.append((torch.arange(start, start + size) // block) - start // block)
    grid = (int(index[0][-1]) + 1 if rows else 0, int(index[1][-1]) + 1 if cols else 0)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"scale_inv for a {rows}x{cols} weight at {origin} with {block_size[0]}x"
            f"{block_size[1]} blocks must have shape {grid}, got {tuple(scale_inv.shape)}"
        )
    index = [i.to(scale_inv.device) for i in index]
    scale = scale_inv.float()[index[0][:, None], index[1][None, :]]
    return (weight.float() * scale).to(dtype)


def dequantize_w13(
    w13: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One expert's w13 [2I, H] (fp8) with its scales [2, ceil(I / bn), ceil(H / bk)]
    (the gate's blocks, then the up projection's) -> [2I, H] in `dtype`."""
    gate, up = w13.chunk(2, dim=0)
    return torch.cat([dequantize_blocks(gate, scale_inv[0], block_size, dtype),
                      dequantize_blocks(up, scale_inv[1], block_size, dtype)])


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether no element is NaN or inf; for float8_e4m3fn (no inf, and torch has no
    isfinite for it) whether no element has the NaN bit pattern S.1111.111."""
    if tensor.dtype == FP8_WEIGHT_DTYPE:
        return not ((tensor.view(torch.uint8) & 0x7F) == 0x7F).any().item()
    return bool(torch.isfinite(tensor).all())


def quantize_activations(
    x: torch.Tensor, group: int = DEFAULT_BLOCK_SIZE[1]
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32), with
    x ~= x_fp8 * scales[:, k // group]: one scale per token and group, amax / 448.

    A group of zeros gets scale 0 and zeros; a group holding NaN gets NaN. The
    executable specification of the Triton kernels' activation quantization (the last
    group may be partial).
    """
    M, K = x.shape
    groups = math.ceil(K / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - K))
    grouped = padded.view(M, groups, group)
    amax = grouped.abs().amax(dim=-1, keepdim=True)
    scales = amax / E4M3_MAX
    # Zero groups divide by 1 (their values are 0 whatever the scale); NaN stays NaN.
    q = (grouped / torch.where(scales == 0, 1.0, scales)).to(FP8_WEIGHT_DTYPE)
    return q.view(M, groups * group)[:, :K], scales.squeeze(-1)
