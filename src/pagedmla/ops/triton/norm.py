"""RMSNorm, optionally after a residual add, as one memory-bound Triton kernel.

One program per row: the row is read once (with the residual, both are read and their
sum written once), reduced in float32 and written normalised. In eager PyTorch the same
takes six or seven kernels (cast, square, mean, add, rsqrt, multiply, cast), each a
pass over the row and a node of a captured decode graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.triton._utils import check_device, next_pow2


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s, D, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[row] = weight * round(x / rms(x)); with a residual, x = round(x + residual)
    is normalised and also stored to sum[row]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Rounded to the stream's dtype, as an eager residual add is.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty),
             mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    check_device(x, weight)
    T, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((T, D), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    total = None
    if residual is not None:
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        total = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0:
        return out, total
    block_d = next_pow2(D)
    # About 16 elements per thread: wide rows get more warps, not more registers.
    num_warps = max(1, min(16, block_d // 512))
    r = residual if residual is not None else x
    s = total if total is not None else out
    _rms_norm_kernel[(T,)](
        x, r, weight, out, s, x.stride(0), r.stride(0), out.stride(0), s.stride(0), D, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_D=block_d, num_warps=num_warps,
    )
    return out, total


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As `reference.rms_norm`: x [T, D] (rows may be strided) -> [T, D]."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `reference.add_rms_norm`: (rms_norm(x + residual), x + residual)."""
    out, total = _launch(x, residual, weight, eps)
    assert total is not None
    return out, total
