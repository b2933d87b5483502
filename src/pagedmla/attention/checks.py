"""Argument checks shared by the attention entry points (dense and sparse)."""

from __future__ import annotations

import torch

from pagedmla.ops.output_quant import QuantizedOutput


def expect_tensor(name: str, value: object, shape: tuple[int, ...]) -> torch.Tensor:
    """`value` itself; TypeError unless it is a tensor, ValueError unless of `shape`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
    return value


def output_buffer(out: torch.Tensor | QuantizedOutput | None, shape: tuple[int, int],
                  like: torch.Tensor) -> torch.Tensor | QuantizedOutput:
    """`out` checked (of `shape`, contiguous, `like`'s dtype and device; or quantized
    codes of `shape` on that device), or a new tensor like that when None."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if isinstance(out, QuantizedOutput):
        expect_tensor("out.codes", out.codes, shape)
        out.quant.check_width(shape[1])
        if out.codes.device != like.device or out.codes.stride(1) != 1:
            raise ValueError(f"out.codes must be rows of contiguous channels on {like.device}")
        return out
    expect_tensor("out", out, shape)
    if out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {like.dtype} tensor on {like.device}, got "
            f"{'a contiguous' if out.is_contiguous() else 'a strided'} {out.dtype} "
            f"tensor on {out.device}"
        )
    return out
