"""Kernels: one function per op, one implementation per backend.

`Backend` is the set of ops a model step needs. `REFERENCE` (plain PyTorch,
`ops/reference.py`) runs everywhere and is the oracle for the others; `ops/triton/`
is the GPU backend. `ops/registry.py` picks a backend by name (`get_backend`), `auto`
the fastest one available for a device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedmla.ops import output_quant, reference, reference_indexer, reference_sparse


@dataclass(frozen=True)
class Backend:
    """The ops one MLA model step needs (signatures as in `pagedmla.ops.reference`, and
    sparse_attention's as `reference_sparse.sparse_mla_attention`'s)."""

    name: str
    write_cache: Callable[..., None]
    gather_cache: Callable[..., None]
    mla_decode: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    varlen_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # Absorbed MQA of each query over the cache positions its indexer selected.
    sparse_attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    merge_attn_states: Callable[..., None]
    merge_partials: Callable[..., torch.Tensor]
    # The model's other per-token ops, fused where the backend can.
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., torch.Tensor]
    fused_experts: Callable[..., torch.Tensor]
    fp8_linear: Callable[..., torch.Tensor]
    # The attention output quantized to fp8 for o_proj (`ops/output_quant.py`): by the
    # decode's V up-projection, by the prefill merge, in one pass, and o_proj on it.
    v_up_proj_quant: Callable[..., None]
    merge_attn_states_quant: Callable[..., None]
    quantize_output: Callable[..., None]
    fp8_linear_quantized: Callable[..., torch.Tensor]
    # The sparse models' lightning indexer: top-k key positions per query token, and
    # the write of its keys into their paged cache (`reference_indexer`'s signatures).
    indexer_topk: Callable[..., torch.Tensor]
    write_indexer_cache: Callable[..., None]
    # Decode ops neither synchronise with the host nor allocate by device values, so
    # a decode step can be captured in a CUDA graph.
    graph_safe: bool = False


REFERENCE = Backend(
    name="reference",
    write_cache=reference.write_cache,
    gather_cache=reference.gather_cache,
    mla_decode=reference.mla_decode,
    varlen_attention=reference.varlen_attention,
    sparse_attention=reference_sparse.sparse_mla_attention,
    merge_attn_states=reference.merge_attn_states,
    merge_partials=reference.merge_partials,
    rms_norm=reference.rms_norm,
    add_rms_norm=reference.add_rms_norm,
    rotary=reference.rotary,
    fused_experts=reference.fused_experts,
    fp8_linear=reference.fp8_linear,
    v_up_proj_quant=output_quant.v_up_proj_quant,
    merge_attn_states_quant=output_quant.merge_attn_states_quant,
    quantize_output=output_quant.quantize_output,
    fp8_linear_quantized=output_quant.fp8_linear_quantized,
    indexer_topk=reference_indexer.indexer_topk,
    write_indexer_cache=reference_indexer.write_indexer_cache,
)
