"""MLA attention as torch.library custom ops, for a model step traced by torch.compile.

`LLM(compile=True)` runs each step's forward under `torch.compile(fullgraph=True)`.
Attention cannot be traced: it reads and writes the paged cache, and its kernels and
control flow depend on the step's metadata (which rows decode, how context is chunked),
which changes every step. So each layer's attention is one opaque op,
`pagedmla::mla_attention`, and a sparse model's indexer another,
`pagedmla::sparse_indices`; the compiler fuses everything between them.

The metadata is still passed explicitly, not through a global: `ForwardStep` holds the
step's caches and MLAMetadata and is a torch "reference" opaque object, an input of the
compiled graph that Dynamo neither looks into nor guards on. One compiled graph thus
serves every step whatever its batch (token counts are dynamic).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
from torch import nn

from pagedmla.cache import LatentKVCache
from pagedmla.metadata import MLAMetadata

try:  # torch >= 2.10: custom ops take opaque Python objects
    from torch._library.opaque_object import register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # older torch: the model runs eagerly only (`compile_supported`)
    register_opaque_type = None
    OpaqueBase = object  # type: ignore[assignment,misc]


class ForwardStep(OpaqueBase):  # type: ignore[misc,valid-type]
    """One forward's per-layer state: layers[i] (a model's attention blocks, each with an
    MLAAttention `attn` and an `indexer`, None in dense layers), caches[i] and the step's
    metadata (`MLAMetadata.for_forward`'s). Eager layers read it directly; compiled ones
    hand it to the custom ops below."""

    def __init__(
        self, layers: Sequence[nn.Module], caches: Sequence[LatentKVCache],
        meta: MLAMetadata,
    ) -> None:
        self.layers = layers
        self.caches = caches
        self.meta = meta

    def __reduce__(self) -> tuple[type, tuple]:
        # Pickled only for the key of Inductor's FX graph cache, which would otherwise
        # copy every weight and cache reachable from here to the host on each compile
        # (minutes at real sizes). The step's contents are inputs of a compiled graph,
        # not part of it: the key needs the type alone.
        return ForwardStep.__new__, (ForwardStep,)

    def uses_indices(self) -> bool:
        """Whether attention attends to the indexers' top-k (a sparse batch) or densely."""
        sparse = self.meta.sparse
        return sparse is not None and not sparse.dense


def compile_supported() -> bool:
    """Whether this torch passes Python objects to custom ops (needed by compile=True)."""
    return register_opaque_type is not None


if register_opaque_type is not None:
    if "typ" in inspect.signature(register_opaque_type).parameters:
        register_opaque_type(ForwardStep, typ="reference")
    else:
        register_opaque_type(ForwardStep)

    @torch.library.custom_op("pagedmla::mla_attention", mutates_args=())
    def mla_attention(
        q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, step: ForwardStep,
        layer: int, indices: torch.Tensor | None, v_head_dim: int,
    ) -> torch.Tensor:
        """Layer `layer`'s MLAAttention on q [T, N, P + R], kv_c [T, L], k_pe [T, R] ->
        [T, N * V]; writes the layer's cache (a side effect the compiler does not see:
        nothing else in the graph reads that cache). indices [T, topk]: the top-k
        positions, used where the batch is sparse."""
        use = indices if step.uses_indices() else None
        return step.layers[layer].attn(q, kv_c, k_pe, step.caches[layer], step.meta,
                                       indices=use)

    @mla_attention.register_fake
    def _(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, step: ForwardStep,
          layer: int, indices: torch.Tensor | None, v_head_dim: int) -> torch.Tensor:
        return q.new_empty((q.shape[0], q.shape[1] * v_head_dim))

    @torch.library.custom_op("pagedmla::sparse_indices", mutates_args=())
    def sparse_indices(
        hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor | None,
        sin: torch.Tensor | None, step: ForwardStep, layer: int, topk: int,
    ) -> torch.Tensor:
        """Layer `layer`'s indexer: writes its keys and returns the top-k positions
        [T, topk] int32; -1 throughout where the batch is dense (attention ignores them
        then, `ForwardStep.uses_indices`)."""
        meta = step.meta
        indices = step.layers[layer].indexer(
            hidden, q_latent, cos, sin, step.caches[layer].index_keys, meta.slot_mapping,
            meta.sparse)
        if indices is None:
            return torch.full((hidden.shape[0], topk), -1, dtype=torch.int32,
                              device=hidden.device)
        return indices

    @sparse_indices.register_fake
    def _(hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor | None,
          sin: torch.Tensor | None, step: ForwardStep, layer: int, topk: int) -> torch.Tensor:
        return hidden.new_empty((hidden.shape[0], topk), dtype=torch.int32)
