"""The paged latent KV cache: one entry per token (L + R values, or DeepSeek's 656-byte
fp8_ds_mla record), in blocks of pages."""

from __future__ import annotations

import numbers

import torch

from pagedmla.device import resolve_device
from pagedmla.validation import positive_finite

FP8_DTYPE = torch.float8_e4m3fn
_FP8_NAMES = ("fp8", "fp8_e4m3")
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# DeepSeek's fp8_ds_mla entry, one per token, little-endian bytes:
#   [0, 512)    512 float8_e4m3fn codes of the latent,
#   [512, 528)  4 float32 scales, scale g covering latent values [128 g, 128 g + 128),
#   [528, 656)  64 bfloat16 values of the rotated k_pe.
# Latent value = code * scale. A scale is the smallest power of two >= amax / 448 (amax
# = the group's largest |value|, the division in float32), at least 2^-126 (float32's
# smallest normal: an all-zero group gets 2^-126 and codes 0) and at most 2^127 (an
# infinite value: its code saturates to +-448). A NaN in a group makes its scale NaN, so
# the whole group reads back NaN. Codes are value / scale rounded to nearest even,
# saturated to +-448. The rope part is bfloat16 whatever the model dtype.
DS_MLA = "fp8_ds_mla"
DS_MLA_DTYPE = torch.uint8  # the storage dtype that marks the format
DS_MLA_LATENT = 512  # L
DS_MLA_ROPE = 64  # R
DS_MLA_GROUP = 128  # latent values per scale
DS_MLA_GROUPS = DS_MLA_LATENT // DS_MLA_GROUP
DS_MLA_SCALES_AT = DS_MLA_LATENT  # byte offset of the scales
DS_MLA_ROPE_AT = DS_MLA_SCALES_AT + 4 * DS_MLA_GROUPS  # byte offset of the rope part
DS_MLA_BYTES = DS_MLA_ROPE_AT + 2 * DS_MLA_ROPE  # 656
DS_MLA_MIN_EXP, DS_MLA_MAX_EXP = -126, 127  # the scales' exponent range
# Model dtypes the format serves (its rope part is bfloat16: a float16 model's keys
# would be rounded to another 16-bit format than its own).
DS_MLA_MODEL_DTYPES = (torch.bfloat16, torch.float32)


def resolve_cache_dtype(
    kv_cache_dtype: str | torch.dtype,
    dtype: torch.dtype,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
) -> torch.dtype:
    """Map a kv-cache dtype name to the storage dtype.

    "auto" is the model dtype; "fp8", "fp8_e4m3" and torch.float8_e4m3fn are fp8 e4m3;
    "fp8_ds_mla" is stored as uint8 (DS_MLA_DTYPE), for a bfloat16 or float32 model and,
    where the widths are given, L = 512 and R = 64 only. Anything else is rejected
    rather than silently stored in another format.
    """
    if dtype not in MODEL_DTYPES:
        raise TypeError(f"dtype must be one of {MODEL_DTYPES}, got {dtype}")
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in _FP8_NAMES or kv_cache_dtype == FP8_DTYPE:
        return FP8_DTYPE
    if kv_cache_dtype == DS_MLA:
        _check_ds_mla(dtype, kv_lora_rank, rope_dim)
        return DS_MLA_DTYPE
    if isinstance(kv_cache_dtype, torch.dtype) and kv_cache_dtype in MODEL_DTYPES:
        return kv_cache_dtype
    raise ValueError(
        "kv_cache_dtype must be 'auto', 'fp8', 'fp8_e4m3', 'fp8_ds_mla', "
        f"torch.float8_e4m3fn or a model dtype {MODEL_DTYPES}, got {kv_cache_dtype!r}"
    )


def _check_ds_mla(dtype: torch.dtype, kv_lora_rank: int | None, rope_dim: int | None) -> None:
    """ValueError unless an fp8_ds_mla cache can serve a `dtype` model of these widths
    (None: not known yet)."""
    if dtype not in DS_MLA_MODEL_DTYPES:
        raise ValueError(
            f"kv_cache_dtype 'fp8_ds_mla' serves models of dtype {DS_MLA_MODEL_DTYPES} "
            f"(its rope part is bfloat16), got dtype {dtype}")
    for name, value, want in (("kv_lora_rank", kv_lora_rank, DS_MLA_LATENT),
                              ("qk_rope_head_dim", rope_dim, DS_MLA_ROPE)):
        if value is not None and value != want:
            raise ValueError(
                f"kv_cache_dtype 'fp8_ds_mla' is defined for kv_lora_rank {DS_MLA_LATENT} "
                f"and qk_rope_head_dim {DS_MLA_ROPE}, got {name} {value} (kv_lora_rank "
                f"{kv_lora_rank}, qk_rope_head_dim {rope_dim})")


def describe_cache_format(cache_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int) -> str:
    """One line naming a cache's entry format and its bytes per token and layer."""
    per_token = LatentKVCache.bytes_per_token(kv_lora_rank, rope_dim, cache_dtype)
    if cache_dtype == DS_MLA_DTYPE:
        return (f"{DS_MLA}, {per_token} bytes per token and layer: {DS_MLA_LATENT} e4m3 "
                f"codes, {DS_MLA_GROUPS} float32 scales, {DS_MLA_ROPE} bfloat16 rope values")
    name = "fp8 e4m3" if cache_dtype == FP8_DTYPE else str(cache_dtype).removeprefix("torch.")
    return f"{name}, {per_token} bytes per token and layer"


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
    With kv_cache_dtype "fp8_ds_mla" `data` is uint8 [num_blocks, block_size, 656],
    one entry per token as laid out above (DS_MLA_*), its scales inside the entry
    (`scale` stays 1.0, unused). With an fp8 cache, one float32 per-tensor `scale`
    covers latent and rope alike (they share a row): stored = x / scale, read = stored *
    scale. `scale` is a 0-dim
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
        self.cache_dtype = resolve_cache_dtype(kv_cache_dtype, dtype, kv_lora_rank, rope_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.device = resolve_device(device)
        entry = DS_MLA_BYTES if self.is_ds_mla else kv_lora_rank + rope_dim
        self.data = torch.zeros(num_blocks, block_size, entry, dtype=self.cache_dtype,
                                device=self.device)
        self._scale = torch.tensor(scale if self.is_fp8 else 1.0, dtype=torch.float32,
                                   device=self.device)
        # A sparse-attention (DSA) layer's indexer keys, paged like the latents (the same
        # slots, so prefix caching and preemption keep them with their blocks); set by the
        # engine (`ops.reference_indexer.allocate_indexer_cache`), else None.
        self.index_keys: torch.Tensor | None = None
        # What the layer wrote since `track()` (None before): the largest |value| and, in
        # an fp8 cache, the values that clipped, as device counters (no sync per write).
        self._amax: torch.Tensor | None = None
        self._clipped: torch.Tensor | None = None

    def track(self) -> None:
        """Start (over) counting what is written (`observe`): `amax` and `clipped`. Steps
        that replay CUDA graphs captured before this are not counted (an engine's
        graphs are captured at start-up: run it with enforce_eager to count them all)."""
        self._amax = torch.zeros((), dtype=torch.float32, device=self.device)
        self._clipped = torch.zeros((), dtype=torch.int64, device=self.device)

    def untrack(self) -> None:
        self._amax = self._clipped = None

    def observe(self, kv_c: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor
                ) -> None:
        """With tracking on, fold rows about to be written (kv_c [T, L], k_pe [T, R], those
        whose slot_mapping [T] is not -1) into the counters: in place on the device, so
        CUDA graphs may capture it. A NaN written makes `amax` NaN."""
        if self._amax is None or self._clipped is None:
            return
        rows = torch.cat([kv_c, k_pe], dim=-1).float().abs()
        rows = torch.where((slot_mapping >= 0)[:, None], rows, 0.0)
        torch.maximum(self._amax, rows.amax(), out=self._amax)
        if self.is_fp8:
            self._clipped += (rows > torch.finfo(FP8_DTYPE).max * self._scale).sum()

    @property
    def amax(self) -> float | None:
        """The largest |value| written since `track()` (None without tracking)."""
        return None if self._amax is None else float(self._amax)

    @property
    def clipped(self) -> int | None:
        """Values written since `track()` beyond +-448 * scale, which an fp8 cache
        saturates (None without tracking, or for a cache other than fp8)."""
        return None if self._clipped is None or not self.is_fp8 else int(self._clipped)

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
        """An fp8 cache with one per-tensor scale (not fp8_ds_mla)."""
        return self.cache_dtype == FP8_DTYPE

    @property
    def is_ds_mla(self) -> bool:
        """An fp8_ds_mla cache (656-byte entries with their own scales)."""
        return self.cache_dtype == DS_MLA_DTYPE

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def width(self) -> int:
        """L + R: the values of one entry as read (the gather's row width)."""
        return self.kv_lora_rank + self.rope_dim

    @staticmethod
    def bytes_per_token(kv_lora_rank: int, rope_dim: int, cache_dtype: torch.dtype) -> int:
        """Bytes one token occupies in one layer's cache (for sizing the cache): 656 for
        fp8_ds_mla (cache_dtype DS_MLA_DTYPE), else L + R values of cache_dtype."""
        if cache_dtype == DS_MLA_DTYPE:
            _check_ds_mla(torch.bfloat16, kv_lora_rank, rope_dim)
            return DS_MLA_BYTES
        return (kv_lora_rank + rope_dim) * cache_dtype.itemsize

    def __repr__(self) -> str:
        return (
            f"LatentKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"L={self.kv_lora_rank}, R={self.rope_dim}, "
            f"dtype={DS_MLA if self.is_ds_mla else self.cache_dtype}, "
            f"device={self.device})"
        )
