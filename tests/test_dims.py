"""softmax_scale: qk_head_dim ** -0.5, times mscale**2 under YaRN with mscale_all_dim."""

from __future__ import annotations

import math

import pytest

from pagedmla import softmax_scale


def hand_scale(qk_head_dim: int, factor: float, mscale_all_dim: float) -> float:
    """The formula written out: DeepSeek's yarn_get_mscale, squared, on the plain scale."""
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0 if factor > 1 else 1.0
    return qk_head_dim**-0.5 * mscale * mscale


def test_plain_scale() -> None:
    assert softmax_scale(192) == pytest.approx(192**-0.5, rel=1e-15)
    assert softmax_scale(192, None) == softmax_scale(192, {}) == softmax_scale(192)


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_deepseek_v3_yarn(key: str) -> None:
    # DeepSeek-V3's config.json: factor 40, mscale 1.0, mscale_all_dim 1.0.
    rope = {key: "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096}
    expected = 192**-0.5 * (0.1 * math.log(40) + 1.0) ** 2
    assert softmax_scale(192, rope) == pytest.approx(expected, rel=1e-12)
    assert softmax_scale(192, rope) == pytest.approx(hand_scale(192, 40, 1.0), rel=1e-12)


@pytest.mark.parametrize(("factor", "mscale_all_dim"), [(4.0, 0.707), (40.0, 0.5), (1.5, 2.0)])
def test_yarn_other_factors(factor: float, mscale_all_dim: float) -> None:
    rope = {"rope_type": "yarn", "factor": factor, "mscale_all_dim": mscale_all_dim}
    assert softmax_scale(128, rope) == pytest.approx(hand_scale(128, factor, mscale_all_dim),
                                                     rel=1e-12)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "factor": 40, "mscale_all_dim": 1.0},  # not scaled RoPE
        {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 0},  # no all-dim mscale
        {"rope_type": "yarn", "factor": 40},  # mscale_all_dim absent
        {"rope_type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},  # factor <= 1
        {"rope_type": "yarn", "factor": 0.5, "mscale_all_dim": 1.0},
    ],
)
def test_cases_without_correction(rope: dict) -> None:
    assert softmax_scale(192, rope) == pytest.approx(192**-0.5, rel=1e-15)


def test_matches_transformers_deepseek_v3_attention() -> None:
    # Cross-check with Hugging Face's own DeepseekV3Attention.scaling.
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    rope = {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "rope_theta": 10000.0}
    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, kv_lora_rank=16,
                           q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4,
                           v_head_dim=8, rope_parameters=rope)
    hf = DeepseekV3Attention(cfg, layer_idx=0).scaling
    assert softmax_scale(12, rope) == pytest.approx(hf, rel=1e-12)


@pytest.mark.parametrize("bad", [0, -192])
def test_rejects_non_positive_head_dim(bad: int) -> None:
    with pytest.raises(ValueError, match="qk_head_dim"):
        softmax_scale(bad)
