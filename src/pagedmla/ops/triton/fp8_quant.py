"""Activations to e4m3 per token and group, as `block_fp8.quantize_activations`
specifies: the fp8 linear layers (`fp8_gemm`) and the fp8 routed experts (`moe`) share
these.

A group's scale is amax / 448 (NaN when the group holds NaN, 0 for an all-zero group);
its codes are x / scale rounded to nearest even (zeros for an all-zero group). Both
divisions are IEEE-rounded (`tl.math.div_rn`; Triton's `/` is an approximate division)
and the rounding to e4m3 is the cache writer's (`cache_ops._quantize_fp8`, which also
rounds right in Triton's interpreter), so scales and codes match the specification bit
for bit (but for the codes of a group whose scale is NaN: finite here; their products
with any weight are NaN all the same).

`quantize_rows` quantizes a register tile whose rows are groups (inside a GEMM's K loop
or epilogue); `quantize_activations` writes a whole [M, K] tensor's codes and scales
once. Nothing here reads device values on the host: graph-safe.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedmla.ops.block_fp8 import E4M3_MAX, FP8_WEIGHT_DTYPE
from pagedmla.ops.triton._utils import INTERPRETED, cdiv, check_device, last_dim_contiguous
from pagedmla.ops.triton.cache_ops import _quantize_fp8

_E4M3_MAX = tl.constexpr(E4M3_MAX)

# Rows per program of `quantize_activations`' kernel.
_ROWS = 32


@functools.cache  # once per device: asked on every call
def fp8_dot_runs(device: torch.device) -> bool:
    """Whether tl.dot takes e4m3 operands on `device`: CUDA compute capability 8.9 or
    later (Ada, Hopper), or CPU tensors under Triton's interpreter."""
    if device.type != "cuda":
        return True  # check_device lets only the interpreter through
    return torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def _nan_max(a, b):
    """max that returns NaN when either side is NaN (tl.max drops NaN)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def quantize_rows(a, INTERPRETED: tl.constexpr):
    """a [R, G] float32, each row one group -> (codes [R, G] float8e4nv, scales [R]
    float32), as `block_fp8.quantize_activations` (the codes of a row whose scale is NaN
    come out finite). INTERPRETED: `cache_ops._quantize_fp8`'s SOFTWARE_ROUND."""
    amax = tl.reduce(tl.abs(a), 1, _nan_max)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32))
    divisor = tl.broadcast_to(tl.where(scale == 0.0, 1.0, scale)[:, None], a.shape)
    return _quantize_fp8(a, divisor, INTERPRETED).to(tl.float8e4nv), scale


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["M", "stride_sk"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sk,
    INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Codes and scales of BLOCK_M rows of x in group pid(1): q[m, k] and s[group, m]."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tl.program_id(1)
    k = group * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = rm < M
    mask = m_ok[:, None] & (k < K)[None, :]
    rows = rm.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + k[None, :], mask=mask, other=0.0)
    codes, scale = quantize_rows(x.to(tl.float32), INTERPRETED)
    tl.store(q_ptr + rows * stride_qm + k[None, :], codes, mask=mask)
    tl.store(s_ptr + group * stride_sk + rm, scale, mask=m_ok)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows may be strided) -> (codes [M, K] float8_e4m3fn, scales [M, ceil(K /
    group)] float32), bitwise `block_fp8.quantize_activations` (but for the codes of a
    group whose scale is NaN, finite here); group a power of two.

    The scales are a transposed view of a [ceil(K / group), M] tensor: each group's
    scales are contiguous across rows, so a GEMM's K step loads its rows' scales in one
    piece (kernels take them through both strides). The codes' rows start every
    multiple of 16 bytes (vector loads whatever K).
    """
    check_device(x)
    x = last_dim_contiguous(x)
    M, K = x.shape
    groups = cdiv(K, group)
    codes = torch.empty(M, cdiv(K, 16) * 16, dtype=FP8_WEIGHT_DTYPE, device=x.device)[:, :K]
    scales = torch.empty(groups, M, dtype=torch.float32, device=x.device)
    if M and K:
        _quantize_kernel[(cdiv(M, _ROWS), groups)](
            x, codes, scales, M, K, x.stride(0), codes.stride(0), scales.stride(0),
            INTERPRETED=INTERPRETED, BLOCK_M=_ROWS, BLOCK_K=group, num_warps=4)
    return codes, scales.t()
