"""MLAAttention: one MLA layer's attention, from projected inputs to [T, N * V]."""

from __future__ import annotations

import torch
from torch import nn

from pagedmla.attention.checks import expect_tensor, output_buffer
from pagedmla.attention.decode import absorb_query, absorbed_decode
from pagedmla.attention.prefill import mha_prefill
from pagedmla.attention.sparse import sparse_mla
from pagedmla.cache import MODEL_DTYPES, LatentKVCache
from pagedmla.dims import MLADims
from pagedmla.metadata import MLAMetadata
from pagedmla.ops import Backend
from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.ops.registry import get_backend
from pagedmla.validation import positive_finite


class MLAAttention(nn.Module):
    """Multi-head latent attention over a paged latent cache.

    kv_b_proj: [N * (P + V), L], the weight of nn.Linear(L, N * (P + V)); per head the
    first P outputs are k_nope and the next V are v. It is split once into
    W_UK [N, P, L] (absorbed into decode queries) and W_UV [N, L, V].

    forward(q [T, N, P + R], kv_c_normed [T, L], k_pe [T, R] rotated, cache, meta, out):
    writes the new latents into the cache (with meta.pcp, every prefill context
    parallel rank's), runs the decode rows (the first
    meta.num_decode_tokens) through the absorbed MQA path and the rest through the
    MHA path with chunked context, and returns [T, N * V]: `out` when given (a
    contiguous tensor of q's dtype and device, e.g. a static buffer), else a new one.
    An `out` of type `QuantizedOutput` (`ops/output_quant.py`) gets the output as fp8
    codes and scales for an fp8 o_proj, written by the kernels that finish it (the
    decode's V up-projection, the prefill merge) rather than by a pass of its own.
    With `indices` [T, topk] int32 (a sparse-attention model's top-k positions per
    token, `attention/sparse.py`), every token attends to its selected positions only,
    by the absorbed path, whatever its query length.
    """

    def __init__(
        self,
        dims: MLADims,
        softmax_scale: float | None = None,
        kv_b_proj: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        if not isinstance(dims, MLADims):
            raise TypeError(f"dims must be MLADims, got {type(dims).__name__}")
        self.dims = dims
        self.softmax_scale = positive_finite(
            "softmax_scale",
            softmax_scale if softmax_scale is not None else dims.qk_head_dim**-0.5,
        )
        get_backend(backend, "cpu")  # reject unknown names now, not at the first step
        self.backend = backend
        # Empty until set_kv_b_proj: a model builds its layers before loading weights.
        self.register_buffer("kv_b_proj", torch.empty(0), persistent=False)
        self.register_buffer("W_UK", torch.empty(0), persistent=False)
        self.register_buffer("W_UV", torch.empty(0), persistent=False)
        if kv_b_proj is not None:
            self.set_kv_b_proj(kv_b_proj)

    def set_kv_b_proj(self, weight: torch.Tensor) -> None:
        """Install a kv_b_proj weight [N * (P + V), L] and derive W_UK and W_UV from it."""
        if isinstance(weight, nn.Linear):
            weight = weight.weight
        d = self.dims
        N, L, P, V = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.v_head_dim
        expect_tensor("kv_b_proj", weight, (N * (P + V), L))
        if weight.dtype not in MODEL_DTYPES:
            raise TypeError(f"kv_b_proj must have a dtype in {MODEL_DTYPES}, got {weight.dtype}")
        weight = weight.detach()
        per_head = weight.view(N, P + V, L)
        self.kv_b_proj = weight.contiguous()
        self.W_UK = per_head[:, :P].contiguous()
        self.W_UV = per_head[:, P:].transpose(1, 2).contiguous()

    def ops(self, device: torch.device) -> Backend:
        return get_backend(self.backend, device)

    def forward(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        meta: MLAMetadata,
        out: torch.Tensor | QuantizedOutput | None = None,
        indices: torch.Tensor | None = None,
    ) -> torch.Tensor | QuantizedOutput:
        self._validate(q, kv_c_normed, k_pe, cache, meta)
        if indices is not None and meta.sparse is None:
            raise ValueError("indices need metadata built with index_topk (meta.sparse)")
        ops = self.ops(q.device)
        d = self.dims
        T = q.shape[0]
        out = output_buffer(out, (T, d.num_heads * d.v_head_dim), q)
        written = (kv_c_normed, k_pe, meta.slot_mapping)
        if meta.pcp is not None:  # every prefill context parallel rank's new latents
            written = meta.pcp.gather(kv_c_normed, k_pe)
        cache.observe(*written)
        ops.write_cache(cache.data, *written, cache.scale)
        if indices is not None:
            return sparse_mla(absorb_query(q, self.W_UK), indices, cache, self.W_UV,
                              meta.sparse, self.softmax_scale, ops, out)
        Td = meta.num_decode_tokens
        if isinstance(out, QuantizedOutput):
            decode_out, prefill_out = out.rows(slice(0, Td)), out.rows(slice(Td, T))
        else:
            heads = out.view(T, d.num_heads, d.v_head_dim)
            decode_out, prefill_out = heads[:Td], heads[Td:]
        if meta.decode is not None:
            absorbed_decode(
                q[:Td], self.W_UK, self.W_UV, cache, meta.decode, self.softmax_scale, ops,
                decode_out,
            )
        if meta.prefill is not None:
            mha_prefill(
                q[Td:], kv_c_normed[Td:], k_pe[Td:], self.kv_b_proj, cache, meta.prefill,
                self.softmax_scale, ops, prefill_out,
            )
        return out

    def _validate(
        self,
        q: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        cache: LatentKVCache,
        meta: MLAMetadata,
    ) -> None:
        d = self.dims
        if not isinstance(meta, MLAMetadata):
            raise TypeError(f"meta must be MLAMetadata, got {type(meta).__name__}")
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"cache must be a LatentKVCache, got {type(cache).__name__}")
        if self.kv_b_proj.numel() == 0:
            raise RuntimeError("MLAAttention has no kv_b_proj weight yet: call set_kv_b_proj")
        T = meta.num_tokens
        expect_tensor("q", q, (T, d.num_heads, d.qk_head_dim))
        expect_tensor("kv_c_normed", kv_c_normed, (T, d.kv_lora_rank))
        expect_tensor("k_pe", k_pe, (T, d.qk_rope_head_dim))
        if q.dtype not in MODEL_DTYPES:
            raise TypeError(f"q must have a dtype in {MODEL_DTYPES}, got {q.dtype}")
        for name, tensor in (("kv_c_normed", kv_c_normed), ("k_pe", k_pe)):
            if tensor.dtype != q.dtype:
                raise TypeError(f"{name} dtype {tensor.dtype} must match q dtype {q.dtype}")
            if tensor.device != q.device:
                raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")
        if cache.kv_lora_rank != d.kv_lora_rank or cache.rope_dim != d.qk_rope_head_dim:
            raise ValueError(
                f"cache has L={cache.kv_lora_rank}, R={cache.rope_dim}; the layer expects "
                f"L={d.kv_lora_rank}, R={d.qk_rope_head_dim}"
            )
        if meta.kv_lora_rank != d.kv_lora_rank or meta.rope_dim != d.qk_rope_head_dim:
            raise ValueError(
                f"meta was built for L={meta.kv_lora_rank}, R={meta.rope_dim}; the layer "
                f"expects L={d.kv_lora_rank}, R={d.qk_rope_head_dim}"
            )
        if cache.dtype != q.dtype:
            raise TypeError(f"cache model dtype {cache.dtype} must match q dtype {q.dtype}")
        if cache.device != q.device or meta.device != q.device:
            raise ValueError(
                f"q is on {q.device}, the cache on {cache.device}, the metadata on {meta.device}"
            )
        if self.kv_b_proj.device != q.device or self.kv_b_proj.dtype != q.dtype:
            raise ValueError(
                f"kv_b_proj is {self.kv_b_proj.dtype} on {self.kv_b_proj.device}; q is "
                f"{q.dtype} on {q.device}"
            )
        if meta.block_size != cache.block_size:
            raise ValueError(
                f"meta was built for block_size {meta.block_size}, the cache has "
                f"{cache.block_size}"
            )
        if meta.max_slot >= cache.num_slots:
            raise ValueError(
                f"slot_mapping holds slot {meta.max_slot}, the cache has {cache.num_slots} slots"
            )
        if meta.max_block >= cache.num_blocks:
            raise ValueError(
                f"block_table holds block {meta.max_block}, the cache has {cache.num_blocks} "
                "blocks"
            )
