"""The MLA attention layer and its two paths (absorbed decode, MHA prefill)."""

from pagedmla.attention.layer import MLAAttention

__all__ = ["MLAAttention"]
