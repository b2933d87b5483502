"""Host-side helpers shared by the Triton kernels: block sizes, device facts, modes."""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from types import ModuleType

import torch
import triton

# Triton decides interpreter or compiler when a kernel is decorated (module import),
# so the mode is read once here, at the same moment.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")

# Programs a launch grid holds on its second and third axes (CUDA; the first holds
# 2**31 - 1): kernels put their large counts on the first axis or check against this.
GRID_YZ_MAX = 65535

# Multiprocessors assumed for CPU tensors under the interpreter: small, so that the
# split planner still produces several splits on tiny test shapes.
_INTERPRETER_SMS = 4

# The Triton release (major, minor) the Gluon kernels are written for. Gluon's API is
# experimental and changes with each release: built for sm_90a without a GPU
# (benchmarks/compile_sm90.py, session 38), the kernels fail with 3.5 (no
# `gl.num_warps`), 3.7 and 3.8 (no `gl.thread_barrier`) and 3.9 (the bulk copies
# renamed). With any other release the Triton kernels run on Hopper too.
GLUON_TRITON = (3, 6)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_pow2(width: int) -> tuple[int, int]:
    """Split a row width into a power-of-two head part and a remainder.

    tl.arange needs power-of-two lengths; 576 = 512 + 64, 192 = 128 + 64, 48 = 32 + 16.
    Returns (head, rest) with head a power of two and 0 <= rest < head.
    """
    if width <= 0:
        return 0, 0
    head = 1 << (width.bit_length() - 1)
    return head, width - head


def check_device(*tensors: torch.Tensor) -> None:
    """CPU tensors only work under TRITON_INTERPRET=1; say so instead of a Triton trace."""
    for t in tensors:
        if t.device.type == "cpu" and not INTERPRETED:
            raise ValueError(
                "the triton backend needs CUDA tensors (CPU tensors run only under "
                "TRITON_INTERPRET=1, set before pagedmla.ops.triton is imported); "
                f"got a tensor on {t.device}"
            )


@functools.cache
def _cuda_properties(index: int):  # queried once per GPU: callers are on the step path
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_properties(index)


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (a small constant for the interpreter)."""
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return _properties(device).multi_processor_count


def l2_cache_bytes(device: torch.device) -> int:
    """L2 cache size of the CUDA device `device`."""
    return _properties(device).L2_cache_size


def is_hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x)."""
    return device.type == "cuda" and _properties(device).major == 9


def gluon_builds(version: str) -> bool:
    """Whether the Gluon kernels build with Triton `version` (as `triton.__version__`
    gives it: "3.6.0", "3.6.0+git1234"): its release is GLUON_TRITON."""
    major, minor = version.split(".")[:2]
    return (int(major), int(minor)) == GLUON_TRITON


@functools.cache  # once per process (and installed version)
def _warn_no_gluon(version: str) -> None:
    release = ".".join(map(str, GLUON_TRITON))
    warnings.warn(
        f"pagedmla: the Hopper (Gluon) kernels are written for Triton {release}, and "
        f"Triton {version} is installed: the portable Triton kernels run instead, slower "
        f"(pip install 'triton=={release}.*' for the fast ones)",
        RuntimeWarning, stacklevel=3)


@functools.cache  # asked on every decode and prefill call
def gluon_modules(device: torch.device, *names: str) -> tuple[ModuleType, ...] | None:
    """The Gluon kernel modules `names` of this package where they can run on `device`:
    None off Hopper, under the interpreter (it does not run Gluon), or where the
    installed Triton lacks Gluon or is a release they do not build with
    (`gluon_builds`; warned once)."""
    if INTERPRETED or not is_hopper(device):
        return None
    if not gluon_builds(triton.__version__):
        _warn_no_gluon(triton.__version__)
        return None
    try:
        return tuple(importlib.import_module(f"{__package__}.{name}") for name in names)
    except ImportError:
        return None


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact IEEE for float32 (tf32 would miss the float32
    tolerances), the tensor-core default for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take arbitrary strides except the innermost one, which must be 1."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()
