"""The Triton backend: one kernel file per op, assembled into a `Backend`.

Which kernel runs a decode or prefill call is decided by one ordered table per op
(`selection`, mirrored in docs/kernels.md): the Gluon kernels on Hopper GPUs where they
support the call, the portable Triton kernels elsewhere, and for prefill batches of
equal-length sequences cuDNN (`prefill_attention`; `varlen_attention` is our kernels
alone). Sparse attention has one kernel, `sparse_decode`, for any call.

Importing this needs the `triton` package but no GPU: on CPU tensors the kernels run
under Triton's interpreter when TRITON_INTERPRET=1 is set before the import (tests).
"""

from __future__ import annotations

from pagedmla.ops import Backend
from pagedmla.ops.triton.cache_ops import gather_cache, write_cache
from pagedmla.ops.triton.combine import merge_partials
from pagedmla.ops.triton.decode import mla_decode
from pagedmla.ops.triton.fp8_gemm import fp8_linear, fp8_linear_quantized
from pagedmla.ops.triton.index_cache import write_indexer_cache
from pagedmla.ops.triton.indexer import indexer_topk
from pagedmla.ops.triton.merge import merge_attn_states, merge_attn_states_quant
from pagedmla.ops.triton.moe import fused_experts
from pagedmla.ops.triton.norm import add_rms_norm, rms_norm
from pagedmla.ops.triton.output_quant import quantize_output
from pagedmla.ops.triton.prefill import prefill_attention, varlen_attention
from pagedmla.ops.triton.rope import rotary
from pagedmla.ops.triton.sparse_decode import sparse_attention
from pagedmla.ops.triton.v_up_proj import v_up_proj_quant

TRITON_BACKEND = Backend(
    name="triton",
    write_cache=write_cache,
    gather_cache=gather_cache,
    mla_decode=mla_decode,
    varlen_attention=prefill_attention,
    sparse_attention=sparse_attention,
    merge_attn_states=merge_attn_states,
    merge_partials=merge_partials,
    rms_norm=rms_norm,
    add_rms_norm=add_rms_norm,
    rotary=rotary,
    fused_experts=fused_experts,
    fp8_linear=fp8_linear,
    v_up_proj_quant=v_up_proj_quant,
    merge_attn_states_quant=merge_attn_states_quant,
    quantize_output=quantize_output,
    fp8_linear_quantized=fp8_linear_quantized,
    indexer_topk=indexer_topk,
    write_indexer_cache=write_indexer_cache,
    graph_safe=True,
)

__all__ = [
    "TRITON_BACKEND",
    "add_rms_norm",
    "fp8_linear",
    "fp8_linear_quantized",
    "fused_experts",
    "gather_cache",
    "indexer_topk",
    "merge_attn_states",
    "merge_attn_states_quant",
    "merge_partials",
    "mla_decode",
    "prefill_attention",
    "quantize_output",
    "rms_norm",
    "rotary",
    "sparse_attention",
    "v_up_proj_quant",
    "varlen_attention",
    "write_cache",
    "write_indexer_cache",
]
