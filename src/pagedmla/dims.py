"""MLA dimensions (N, L, P, R, V) and the softmax scale, read from model configs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _positive_int(name: str, value: object, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else ">= 1"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


@dataclass(frozen=True)
class MLADims:
    """Shapes of one MLA layer on this rank.

    num_heads (N), kv_lora_rank (L), qk_nope_head_dim (P), qk_rope_head_dim (R, 0 for
    NoPE MLA), v_head_dim (V), and q_lora_rank (None: q is projected directly).
    """

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    def __post_init__(self) -> None:
        _positive_int("num_heads", self.num_heads)
        _positive_int("kv_lora_rank", self.kv_lora_rank)
        _positive_int("qk_nope_head_dim", self.qk_nope_head_dim)
        _positive_int("qk_rope_head_dim", self.qk_rope_head_dim, allow_zero=True)
        _positive_int("v_head_dim", self.v_head_dim)
        if self.q_lora_rank is not None:
            _positive_int("q_lora_rank", self.q_lora_rank)

    @property
    def qk_head_dim(self) -> int:
        """P + R: the query/key head width of the MHA (prefill) path."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """L + R: one latent cache row, also the query width of the absorbed MQA path."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf_config(cls, config: Any, num_heads: int | None = None) -> MLADims:
        """Read the dimensions from a Hugging Face config (a dict or a config object).

        DeepSeek-V2/V3 style configs name every width; V4 style configs (those with
        `compress_ratios`) have one `head_dim` that is the latent width, the value width
        and the query/key width, of which the last `qk_rope_head_dim` are rotated.
        `num_heads` overrides `num_attention_heads` (e.g. heads per tensor-parallel rank).
        """
        get = _config_getter(config)
        heads = num_heads if num_heads is not None else get("num_attention_heads")
        if get("compress_ratios", None) is not None:
            head_dim = get("head_dim")
            rope = get("qk_rope_head_dim")
            return cls(
                num_heads=heads,
                kv_lora_rank=head_dim,
                qk_nope_head_dim=head_dim - rope,
                qk_rope_head_dim=rope,
                v_head_dim=head_dim,
                q_lora_rank=get("q_lora_rank", None),
            )
        return cls(
            num_heads=heads,
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=get("v_head_dim"),
            q_lora_rank=get("q_lora_rank", None),
        )


_MISSING = object()


def _config_getter(config: Any):
    """A `get(name, default)` over a mapping or an attribute-style config."""
    if isinstance(config, Mapping):

        def get(name: str, default: Any = _MISSING) -> Any:
            if name in config:
                return config[name]
            if default is _MISSING:
                raise ValueError(f"config has no field {name!r}")
            return default

    else:

        def get(name: str, default: Any = _MISSING) -> Any:
            value = getattr(config, name, default)
            if value is _MISSING:
                raise ValueError(f"config has no field {name!r}")
            return value

    return get


def yarn_mscale(scaling_factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature correction, 0.1 * mscale * ln(factor) + 1 (1 if factor <= 1)."""
    if scaling_factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scaling_factor) + 1.0


def softmax_scale(qk_head_dim: int, rope_scaling: Mapping[str, Any] | None = None) -> float:
    """The attention softmax scale: qk_head_dim ** -0.5, times mscale**2 under YaRN.

    Under a scaled RoPE (YaRN in practice) with a non-zero `mscale_all_dim` the logits are
    sharpened by yarn_mscale(factor, mscale_all_dim) squared, as DeepSeek-V2/V3 define it.
    """
    _positive_int("qk_head_dim", qk_head_dim)
    scale = qk_head_dim**-0.5
    if not rope_scaling:
        return scale
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    mscale_all_dim = rope_scaling.get("mscale_all_dim", 0) or 0
    if kind not in (None, "default") and mscale_all_dim:
        mscale = yarn_mscale(float(rope_scaling["factor"]), float(mscale_all_dim))
        scale *= mscale * mscale
    return scale
