"""Argument checks shared by the attention entry points (dense and sparse)."""

from __future__ import annotations

import torch


def expect_tensor(name: str, value: object, shape: tuple[int, ...]) -> torch.Tensor:
    """`value` itself; TypeError unless it is a tensor, ValueError unless of `shape`."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(value.shape)}")
    return value


def output_buffer(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
                  ) -> torch.Tensor:
    """`out` checked (of `shape`, contiguous, `like`'s dtype and device), or a new
    tensor like that when None."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    expect_tensor("out", out, shape)
    if out.dtype != like.dtype or out.device != like.device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {like.dtype} tensor on {like.device}, got "
            f"{'a contiguous' if out.is_contiguous() else 'a strided'} {out.dtype} "
            f"tensor on {out.device}"
        )
    return out
