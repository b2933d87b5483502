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
from pagedmla.ops.triton.fp8_gemm import fp8_linear
from pagedmla.ops.triton.index_cache import write_indexer_cache
from pagedmla.ops.triton.indexer import indexer_topk
from pagedmla.ops.triton.merge import merge_attn_states
from pagedmla.ops.triton.moe import fused_experts
from pagedmla.ops.triton.norm import add_rms_norm, rms_norm
from pagedmla.ops.triton.prefill import prefill_attention, varlen_attention
from pagedmla.ops.triton.rope import rotary
from pagedmla.ops.triton.sparse_decode import sparse_attention

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
    indexer_topk=indexer_topk,
    write_indexer_cache=write_indexer_cache,
    graph_safe=True,
)

__all__ = [
    "TRITON_BACKEND",
    "add_rms_norm",
    "fp8_linear",
    "fused_experts",
    "gather_cache",
    "indexer_topk",
    "merge_attn_states",
    "merge_partials",
    "mla_decode",
    "prefill_attention",
    "rms_norm",
    "rotary",
    "sparse_attention",
    "varlen_attention",
    "write_cache",
    "write_indexer_cache",
]
