"""Host-side helpers shared by the Triton kernels: block sizes, device facts, modes."""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
import triton

from pagedmla.cache import DS_MLA_BYTES, DS_MLA_DTYPE, DS_MLA_LATENT, DS_MLA_ROPE

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
# (benchmarks/compile_sm90.py), the kernels do not build with 3.5 (no `gl.num_warps`),
# 3.7 and 3.8 (no `gl.thread_barrier`) or 3.9 (the bulk copies renamed). With any other
# release the Triton kernels run on Hopper too.
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


@dataclass(frozen=True)
class Platform:
    """The facts of a device and of this process that decide which kernels can run there.

    cudnn: a CUDA device with PyTorch's cuDNN (the prefill table's cuDNN entry). hopper:
    a Hopper GPU (compute capability 9.x). gluon: the Gluon kernels build and run here:
    compiled rather than interpreted, with the Triton release they are written for
    (`gluon_builds`). The Gluon kernels run where both hopper and gluon hold.
    """

    cudnn: bool
    hopper: bool
    gluon: bool

    @property
    def runs_gluon(self) -> bool:
        """Whether the Gluon kernels can run: a Hopper GPU and a Triton that builds them."""
        return self.hopper and self.gluon


@functools.cache  # asked on every decode and prefill call
def device_platform(device: torch.device) -> Platform:
    """The `Platform` of `device` (warned once where a Hopper GPU could run the Gluon
    kernels but the installed Triton is a release they do not build with)."""
    hopper = is_hopper(device)
    gluon = not INTERPRETED and gluon_builds(triton.__version__)
    if hopper and not INTERPRETED and not gluon:
        _warn_no_gluon(triton.__version__)
    return Platform(cudnn=device.type == "cuda" and torch.backends.cudnn.is_available(),
                    hopper=hopper, gluon=gluon)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact IEEE for float32 (tf32 would miss the float32
    tolerances), the tensor-core default for 16-bit types."""
    return "ieee" if dtype == torch.float32 else "tf32"


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Kernels take arbitrary strides except the innermost one, which must be 1."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def tiles_copyable(data: torch.Tensor, block_n: int) -> bool:
    """Whether the copy engine can read [block_n, ...] tiles of the cache `data`
    [num_blocks, page, L + R] as rows: tiles inside one page (page a multiple of
    block_n), pages adjacent in rows, 16-byte aligned base and row stride, and fewer
    than 2**31 rows (int32 coordinates)."""
    num_blocks, page, _ = data.shape
    return (page % block_n == 0 and data.stride(-1) == 1
            and data.stride(0) == page * data.stride(1)
            and (data.stride(1) * data.element_size()) % 16 == 0
            and data.data_ptr() % 16 == 0 and num_blocks * page < 2**31)


def check_cache_rows(data: torch.Tensor, kv_lora_rank: int, width: int) -> None:
    """ValueError unless a cache's rows fit queries of `width` (L + R) values: as many
    columns, or for fp8_ds_mla its 656-byte entries with L = 512 and R = 64."""
    if data.dtype == DS_MLA_DTYPE:
        if (data.shape[-1], kv_lora_rank, width) != (DS_MLA_BYTES, DS_MLA_LATENT,
                                                     DS_MLA_LATENT + DS_MLA_ROPE):
            raise ValueError(
                f"an fp8_ds_mla cache has {DS_MLA_BYTES}-byte entries for L = "
                f"{DS_MLA_LATENT}, R = {DS_MLA_ROPE}: got entries of {data.shape[-1]} "
                f"bytes, L = {kv_lora_rank} and q rows of {width}")
    elif data.shape[-1] != width:
        raise ValueError(f"cache rows have {data.shape[-1]} columns, q has {width}")
