"""pagedmla: DeepSeek-style Multi-head Latent Attention for inference."""

from pagedmla.attention import MLAAttention
from pagedmla.cache import LatentKVCache
from pagedmla.dims import MLADims, softmax_scale
from pagedmla.merge import merge_attn_states
from pagedmla.metadata import BatchSpec, MLAMetadata, MLAMetadataBuilder
from pagedmla.planner import plan_context_chunks

__all__ = [
    "BatchSpec",
    "LatentKVCache",
    "MLAAttention",
    "MLADims",
    "MLAMetadata",
    "MLAMetadataBuilder",
    "merge_attn_states",
    "plan_context_chunks",
    "softmax_scale",
]
