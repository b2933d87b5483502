"""DeepSeek-V2/V3 models built on MLAAttention."""

from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM

__all__ = ["DeepseekConfig", "DeepseekForCausalLM"]
