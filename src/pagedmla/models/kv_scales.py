"""Per-layer scales of an fp8 latent cache shipped in a checkpoint.

An fp8 cache (kv_cache_dtype "fp8") stores x / scale for each latent row (kv_c and k_pe
alike) and reads code * scale; e4m3 holds |x / scale| <= 448. Checkpoints quantized for
an fp8 KV cache ship one float32 scale per attention layer: `model.layers.{i}.self_attn
.k_scale` (ModelOpt, llm-compressor; their `v_scale` beside it is for a separate value
cache, which MLA's latent also stands for: the latent's scale is `k_scale`) or
`model.layers.{i}.self_attn.kv_scale` (AutoFP8, TGI).
"""

from __future__ import annotations

import math
import re

import torch

from pagedmla.models.checkpoint import Checkpoint

KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k|v|kv)_scale")
LATENT_SCALE_KINDS = ("k", "kv")  # in this order of preference; "v" is read past


def is_kv_scale(name: str) -> bool:
    """Whether a checkpoint tensor is a KV cache scale (not a model weight)."""
    return KV_SCALE.fullmatch(name) is not None


def read_kv_scales(checkpoint: Checkpoint, num_layers: int) -> list[float] | None:
    """The latent cache's scale of each of the first num_layers layers, or None where the
    checkpoint ships none. ValueError where it ships some layers' only, or a scale that
    is not one positive finite number."""
    found: dict[int, float] = {}
    with checkpoint.opened():
        for layer in range(num_layers):
            for kind in LATENT_SCALE_KINDS:
                name = f"model.layers.{layer}.self_attn.{kind}_scale"
                if name in checkpoint.stored:
                    found[layer] = _scale(name, checkpoint.read(name, None, torch.float32))
                    break
    if not found:
        return None
    missing = [layer for layer in range(num_layers) if layer not in found]
    if missing:
        raise ValueError(f"the checkpoint ships KV cache scales (self_attn.k_scale or "
                         f"kv_scale) for some layers but not for layers {missing}")
    return [found[layer] for layer in range(num_layers)]


def _scale(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ValueError(f"{name}: a KV cache scale is one number, got shape "
                         f"{list(tensor.shape)}")
    value = float(tensor.reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: a KV cache scale must be finite and > 0, got {value}")
    return value
