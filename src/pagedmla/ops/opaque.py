"""Backends as torch.compile sees them: the per-token ops traced, the heavy ones opaque.

Under `torch.compile` (`LLM(compile=True)`) a model step is traced end to end. The
ops the compiler fuses well (RMS norms, the residual adds, rotary embeddings) then run
as the reference backend's plain PyTorch, which Inductor fuses with the matmuls' inputs
and outputs; the ops it cannot see into (block-fp8 GEMMs, routed experts, whose
reference implementation reads expert counts on the host) are `torch.library` custom
ops `pagedmla::fp8_linear` and `pagedmla::fused_experts` that call the device backend's
kernel unchanged. `get_backend` hands out `traceable(backend)` while Dynamo traces, so
model code is the same in both modes. Attention has its own ops
(`attention/opaque.py`): it reads the paged cache and the step's metadata.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from pagedmla.ops import Backend, reference

# The backends `traceable` wrapped, by name: the custom ops run their kernels.
_WRAPPED: dict[str, Backend] = {}


@torch.library.custom_op("pagedmla::fp8_linear", mutates_args=())
def _fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int],
    backend: str,
) -> torch.Tensor:
    bn, bk = block_size
    return _WRAPPED[backend].fp8_linear(x, weight, scale_inv, (bn, bk))


@_fp8_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block_size: list[int],
      backend: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("pagedmla::fused_experts", mutates_args=())
def _fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor, w13_scale_inv: torch.Tensor | None, w2_scale_inv: torch.Tensor | None,
    block_size: list[int] | None, backend: str,
) -> torch.Tensor:
    block = None if block_size is None else (block_size[0], block_size[1])
    return _WRAPPED[backend].fused_experts(
        x, w13, w2, weights, ids, w13_scale_inv=w13_scale_inv, w2_scale_inv=w2_scale_inv,
        block_size=block,
    )


@_fused_experts.register_fake
def _(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
      ids: torch.Tensor, w13_scale_inv: torch.Tensor | None, w2_scale_inv: torch.Tensor | None,
      block_size: list[int] | None, backend: str) -> torch.Tensor:
    return torch.empty_like(x)


def traceable(backend: Backend) -> Backend:
    """`backend` as a traced step uses it: norms and rotary embeddings in plain PyTorch
    (for the compiler to fuse), fp8 GEMMs and routed experts as opaque custom ops that
    run `backend`'s own kernels. The attention and cache ops are left as they are: the
    model reaches them only through `attention/opaque.py`'s ops."""
    name = backend.name
    _WRAPPED[name] = backend

    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   block_size: tuple[int, int]) -> torch.Tensor:
        return _fp8_linear(x, weight, scale_inv, list(block_size), name)

    def fused_experts(
        x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
        ids: torch.Tensor, w13_scale_inv: torch.Tensor | None = None,
        w2_scale_inv: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        block = None if block_size is None else list(block_size)
        return _fused_experts(x, w13, w2, weights, ids, w13_scale_inv, w2_scale_inv, block,
                              name)

    return replace(
        backend,
        name=f"{name}+compile",
        rms_norm=reference.rms_norm,
        add_rms_norm=reference.add_rms_norm,
        rotary=reference.rotary,
        fp8_linear=fp8_linear,
        fused_experts=fused_experts,
    )

