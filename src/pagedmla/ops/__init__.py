"""Kernels behind a small registry: one function per op, one implementation per backend.

`reference` (plain PyTorch) runs everywhere and is the oracle for the others; faster
backends register themselves under their own name. `auto` picks the fastest backend
available for a device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedmla.ops import reference


@dataclass(frozen=True)
class Backend:
    """The ops one MLA model step needs (signatures as in `pagedmla.ops.reference`)."""

    name: str
    write_cache: Callable[..., None]
    gather_cache: Callable[..., None]
    mla_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    merge_attn_states: Callable[..., None]
    merge_partials: Callable[..., torch.Tensor]
    # The model's other per-token ops, fused where the backend can.
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., torch.Tensor]
    fused_experts: Callable[..., torch.Tensor]
    # Decode ops neither synchronise with the host nor allocate by device values, so
    # a decode step can be captured in a CUDA graph.
    graph_safe: bool = False


REFERENCE = Backend(
    name="reference",
    write_cache=reference.write_cache,
    gather_cache=reference.gather_cache,
    mla_decode=reference.mla_decode,
    varlen_attention=reference.varlen_attention,
    merge_attn_states=reference.merge_attn_states,
    merge_partials=reference.merge_partials,
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    rotary=reference.rotary,
    fused_experts=reference.fused_experts,
)

_LOADERS: dict[str, Callable[[], Backend]] = {"reference": lambda: REFERENCE}
# Preference order for backend="auto" on CUDA devices.
_CUDA_PREFERENCE: list[str] = []


def register_backend(
    name: str, loader: Callable[[], Backend], prefer_on_cuda: bool = False
) -> None:
    """Make a backend selectable by name; `loader` imports it on first use."""
    _LOADERS[name] = loader
    if prefer_on_cuda and name not in _CUDA_PREFERENCE:
        _CUDA_PREFERENCE.append(name)
    _resolve.cache_clear()


def available_backends() -> list[str]:
    return ["auto", *_LOADERS]


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The backend called `name`, or for "auto" the best one for `device`."""
    if name != "auto" and name not in _LOADERS:
        raise ValueError(f"backend must be one of {available_backends()}, got {name!r}")
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return _resolve(name, device_type)


@functools.cache  # every layer asks on every step: resolve each (name, device type) once
def _resolve(name: str, device_type: str) -> Backend:
    if name == "auto":
        if device_type == "cuda":
            for candidate in _CUDA_PREFERENCE:
                try:
                    return _LOADERS[candidate]()
                except ImportError:
                    continue
        return REFERENCE
    return _LOADERS[name]()


def _load_triton() -> Backend:
    """The Triton kernels; an ImportError (no `triton` package) means not available."""
    try:
        from pagedmla.ops.triton import TRITON_BACKEND
    except ImportError as error:
        raise ImportError(f"backend 'triton' needs the triton package: {error}") from error
    return TRITON_BACKEND


register_backend("triton", _load_triton, prefer_on_cuda=True)
