"""Backends by name: `get_backend("auto" | "reference" | "triton", device)`.

A backend registers a loader that imports it on first use, so that the reference
backend needs no `triton` package. `auto` picks, on CUDA devices, the first backend of
the preference order that imports, and the reference backend elsewhere. A name with the
suffix "+invariant" ("auto+invariant") is that backend made batch invariant
(`ops/batch_invariant.py`). While
torch.compile traces a model, each backend is handed out as `ops/opaque.py`'s
`traceable` version of itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedmla.ops import REFERENCE, Backend
from pagedmla.ops.batch_invariant import batch_invariant
from pagedmla.ops.opaque import traceable

_LOADERS: dict[str, Callable[[], Backend]] = {"reference": lambda: REFERENCE}
# Preference order for backend="auto" on CUDA devices.
_CUDA_PREFERENCE: list[str] = []
# Every layer asks on every step: each (name, device type, traced) is resolved once. A
# plain dict rather than functools.cache, which Dynamo would warn about on every trace.
_RESOLVED: dict[tuple[str, str, bool], Backend] = {}


def register_backend(
    name: str, loader: Callable[[], Backend], prefer_on_cuda: bool = False
) -> None:
    """Make a backend selectable by name; `loader` imports it on first use."""
    _LOADERS[name] = loader
    if prefer_on_cuda and name not in _CUDA_PREFERENCE:
        _CUDA_PREFERENCE.append(name)
    _RESOLVED.clear()


def available_backends() -> list[str]:
    return ["auto", *_LOADERS]


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The backend called `name`, or for "auto" the best one for `device`; either with
    "+invariant" appended: that backend, batch invariant."""
    base, plus, variant = name.partition("+")
    if (base != "auto" and base not in _LOADERS) or (plus and variant != "invariant"):
        raise ValueError(f"backend must be one of {available_backends()} (with "
                         f"'+invariant' or not), got {name!r}")
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    key = (name, device_type, torch.compiler.is_compiling())
    if key not in _RESOLVED:  # both versions at once, so that a trace finds its own
        backend = _resolve(base, device_type)
        if plus:
            backend = batch_invariant(backend)
        _RESOLVED[name, device_type, False] = backend
        _RESOLVED[name, device_type, True] = traceable(backend)
    return _RESOLVED[key]


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
