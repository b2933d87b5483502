"""Tiny random Hugging Face DeepSeek checkpoints, made locally for parity tests.

Weights are drawn with std 1/sqrt(fan_in) (so logits are spread and a RoPE or routing
mistake shows), norms around 1, and the V3 router bias non-zero.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(
    vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
    num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=256,
)

# DeepSeek-V3's options on top: q LoRA, interleaved rope, group-limited routing.
V3 = dict(q_lora_rank=24, rope_interleave=True, n_group=4, topk_group=2, norm_topk_prob=True,
          routed_scaling_factor=2.5)


# The sparse-attention models: an indexer of 8 heads (ReLU scores then rarely tie) whose
# top-k is smaller than the test prompts, so that the selection matters.
SPARSE = {"v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
          "glm": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM")}
SPARSE_COMMON = dict(q_lora_rank=24, index_n_heads=8, index_head_dim=16, index_topk=12,
                     n_group=2, topk_group=1, norm_topk_prob=True)


def make_hf_model(version: str, seed: int = 0, **overrides):
    """An eager float32 transformers DeepseekV2/V3/V32 or GlmMoeDsa ForCausalLM with
    spread random weights (LayerNorm biases too)."""
    import transformers

    torch.manual_seed(seed)
    if version == "v3":
        config = transformers.DeepseekV3Config(**{**COMMON, **overrides})
        model_class = transformers.DeepseekV3ForCausalLM
    elif version == "v2":
        config = transformers.DeepseekV2Config(**{**COMMON, **overrides})
        model_class = transformers.DeepseekV2ForCausalLM
    elif version in SPARSE:
        config_class, model_class = (getattr(transformers, name) for name in SPARSE[version])
        config = config_class(**{**COMMON, **SPARSE_COMMON, **overrides})
    else:
        raise ValueError(f"version must be 'v2', 'v3' or one of {list(SPARSE)}, got {version!r}")
    config._attn_implementation = "eager"
    model = model_class(config).eval()
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def save_hf_checkpoint(model, directory: Path) -> Path:
    model.save_pretrained(directory)
    return directory


def hf_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits [len(tokens), vocab] for one full sequence."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return logits.double().log_softmax(-1)
