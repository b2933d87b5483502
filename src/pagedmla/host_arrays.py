"""Host-side integer arrays of a step: checked reads of a batch's ints and tensors, and
the one-copy upload of the int32 arrays the kernels need."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class Int32Upload:
    """Collects host int32 arrays and moves them to the device in one copy."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self._size = 0

    def add(self, values: Sequence[int] | np.ndarray) -> tuple[int, int]:
        array = np.asarray(values, dtype=np.int32).reshape(-1)
        self._parts.append(array)
        self._size += array.size
        return self._size - array.size, array.size

    def upload(self, device: torch.device) -> torch.Tensor:
        host = np.concatenate(self._parts) if self._parts else np.zeros(0, np.int32)
        return torch.from_numpy(host).to(device, non_blocking=True)


def int_list(name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name}[{i}] must be an int, got {type(v).__name__}")
        out.append(int(v))
    return out


def check_host_tensor(name: str, tensor: object, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}")
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be on the host (cpu), got {tensor.device}")
    return tensor
