"""pagedmla: DeepSeek-style Multi-head Latent Attention for inference."""

from typing import Any

from pagedmla.attention import MLAAttention
from pagedmla.cache import LatentKVCache
from pagedmla.dims import MLADims, softmax_scale
from pagedmla.merge import merge_attn_states
from pagedmla.metadata import BatchSpec, MLAMetadata, MLAMetadataBuilder
from pagedmla.ops.output_quant import OutputQuant, QuantizedOutput
from pagedmla.planner import plan_context_chunks

__all__ = [
    "LLM",
    "BatchSpec",
    "EngineArgs",
    "LatentKVCache",
    "MLAAttention",
    "MLADims",
    "MLAMetadata",
    "MLAMetadataBuilder",
    "OutputQuant",
    "QuantizedOutput",
    "SamplingParams",
    "merge_attn_states",
    "plan_context_chunks",
    "softmax_scale",
]


def __getattr__(name: str) -> Any:
    # The engine pulls in the model and loader; users of the attention layer alone
    # should not pay for importing them.
    if name in ("LLM", "EngineArgs", "SamplingParams"):
        from pagedmla import engine

        return getattr(engine, name)
    if name == "__version__":
        from pagedmla.version import package_version

        return package_version()
    raise AttributeError(f"module 'pagedmla' has no attribute {name!r}")
