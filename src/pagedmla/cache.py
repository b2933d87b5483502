"""The paged latent KV cache: one row of L + R values per token, in blocks of pages."""

from __future__ import annotations

import numbers

import torch

from pagedmla.device import resolve_device
from pagedmla.validation import positive_finite

FP8_DTYPE = torch.float8_e4m3fn
_FP8_NAMES = ("fp8", "fp8_e4m3")
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_cache_dtype(kv_cache_dtype: str | torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """Map a kv-cache dtype name to the storage dtype.

    "auto" is the model dtype; "fp8", "fp8_e4m3" and torch.float8_e4m3fn are fp8 e4m3.
    Anything else is rejected rather than silently stored in another format.
    """
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in _FP8_NAMES or kv_cache_dtype == FP8_DTYPE:
        return FP8_DTYPE
    if isinstance(kv_cache_dtype, torch.dtype) and kv_cache_dtype in MODEL_DTYPES:
        return kv_cache_dtype
    raise ValueError(
        "kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3', torch.float8_e4m3fn or a model "
        f"dtype {MODEL_DTYPES}, got {kv_cache_dtype!r}"
    )


def _scale_value(value: object) -> float:
    """A cache scale as a float: a real number or a one-element tensor (read once on the
    host), finite and > 0."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(
                f"scale must be a number or a one-element real tensor, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}"
            )
        value = value.item()
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(value).__name__}")
    return positive_finite("scale", value)


class LatentKVCache:
    """Paged storage for the latents of one MLA layer.

    `data` is [num_blocks, block_size, L + R]: `data[b, i, :L]` is the normalised latent
    kv_c of the token in slot b * block_size + i and `data[b, i, L:]` its rotated k_pe.
    With an fp8 cache, one float32 per-tensor `scale` covers latent and rope alike
    (they share a row): stored = x / scale, read = stored * scale. `scale` is a 0-dim
    float32 tensor on the cache's device that the kernels (and CUDA graphs captured
    over them) read; assigning `cache.scale = x` checks x (finite, > 0) and writes it
    into that tensor. A cache in the model dtype ignores its scale and keeps 1.0.
    Writing into the tensor in place (`cache.scale.fill_(...)`) is not checked, as
    writing into `data` is not.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        kv_lora_rank: int,
        rope_dim: int,
        kv_cache_dtype: str | torch.dtype = "auto",
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        scale: float = 1.0,
    ) -> None:
        for name, value, low in (
            ("num_blocks", num_blocks, 1),
            ("block_size", block_size, 1),
            ("kv_lora_rank", kv_lora_rank, 1),
            ("rope_dim", rope_dim, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        scale = _scale_value(scale)
        self.dtype = dtype
        self.cache_dtype = resolve_cache_dtype(kv_cache_dtype, dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.device = resolve_device(device)
        self.data = torch.zeros(
            num_blocks, block_size, kv_lora_rank + rope_dim, dtype=self.cache_dtype,
            device=self.device,
        )
        self._scale = torch.tensor(scale if self.is_fp8 else 1.0, dtype=torch.float32,
                                   device=self.device)

    @property
    def scale(self) -> torch.Tensor:
        """The fp8 scale, a 0-dim float32 tensor on the cache's device (1.0 unless fp8)."""
        return self._scale

    @scale.setter
    def scale(self, value: float | torch.Tensor) -> None:
        value = _scale_value(value)
        # In place: a captured CUDA graph holds this tensor's address.
        self._scale.fill_(value if self.is_fp8 else 1.0)

    @property
    def is_fp8(self) -> bool:
        return self.cache_dtype == FP8_DTYPE

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def width(self) -> int:
        """L + R."""
        return self.kv_lora_rank + self.rope_dim

    @staticmethod
    def bytes_per_token(kv_lora_rank: int, rope_dim: int, cache_dtype: torch.dtype) -> int:
        """Bytes one token occupies in one layer's cache (for sizing the cache)."""
        return (kv_lora_rank + rope_dim) * torch.empty((), dtype=cache_dtype).element_size()

    def __repr__(self) -> str:
        return (
            f"LatentKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"L={self.kv_lora_rank}, R={self.rope_dim}, dtype={self.cache_dtype}, "
            f"device={self.device})"
        )
