"""The attention output quantized to fp8 in registers (`ops/output_quant.py` specifies
the formats): the epilogue that the V up-projection and the merge kernels end with,
and `quantize_output`, the same as one pass.

`store_quantized` takes a float32 tile [R, W] of one token row's channels (or of R
tokens' channels) whose columns start on a group boundary, with W a multiple of the
group: its groups are whole, so each group's amax is the tile's. Both divisions are
IEEE-rounded and the rounding to e4m3 is the cache writer's (`cache_ops._quantize_fp8`),
so codes and scales match the PyTorch specification bit for bit. Graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.ops.triton._utils import INTERPRETED, cdiv, check_device, last_dim_contiguous
from pagedmla.ops.triton.cache_ops import _quantize_fp8
from pagedmla.ops.triton.fp8_quant import _nan_max

# QUANT modes of the kernels: the output in the model dtype, per tensor, per group.
NONE, PER_TENSOR, PER_GROUP = 0, 1, 2
_E4M3_MAX = tl.constexpr(448.0)
# Tokens per program of `quantize_output`'s kernel.
_ROWS = 32


def quant_mode(out: QuantizedOutput) -> int:
    return PER_TENSOR if out.quant.group is None else PER_GROUP


@triton.jit
def _power_of_two_scale(amax):
    """2^ceil(log2(amax / 448)), 0 for 0, NaN for NaN (`power_of_two_scales`)."""
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, _E4M3_MAX, tl.float32))
    bits = ratio.to(tl.int32, bitcast=True)
    up = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return tl.where(ratio != ratio, ratio, (up << 23).to(tl.float32, bitcast=True))


@triton.jit
def store_quantized(
    x, mask, codes_ptrs, scale_ptr, scales_ptrs, scales_mask,
    QUANT: tl.constexpr, R: tl.constexpr, W: tl.constexpr, GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Quantize the float32 tile x [R, W] and store its codes at codes_ptrs [R, W]
    (where mask) and, per group, its scales at scales_ptrs [R, W // GROUP] (where
    scales_mask). PER_TENSOR divides by the static scale at scale_ptr instead."""
    if QUANT == 1:
        scale = tl.load(scale_ptr)
        tl.store(codes_ptrs, _quantize_fp8(x, scale, INTERPRETED).to(tl.float8e4nv),
                 mask=mask)
    else:
        groups = tl.reshape(x, (R, W // GROUP, GROUP))
        amax = tl.reduce(tl.abs(groups), 2, _nan_max)
        scales = _power_of_two_scale(amax)
        divisor = tl.broadcast_to(tl.where(scales == 0.0, 1.0, scales)[:, :, None],
                                  (R, W // GROUP, GROUP))
        codes = _quantize_fp8(groups, divisor, INTERPRETED).to(tl.float8e4nv)
        tl.store(codes_ptrs, tl.reshape(codes, (R, W)), mask=mask)
        tl.store(scales_ptrs, scales, mask=scales_mask)


@triton.jit(do_not_specialize=["T"])  # batch-dependent: no variant per value
def _quantize_output_kernel(
    x_ptr, codes_ptr, scale_ptr, scales_ptr, T, stride_xt, stride_ct, stride_sg,
    QUANT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    GROUP: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Tokens [pid(0) * BLOCK_T, ...) x channels [pid(1) * BLOCK_C, ...) of x."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = rt < T
    rows = rt.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xt + c[None, :], mask=t_ok[:, None], other=0.0)
    g = tl.program_id(1) * (BLOCK_C // GROUP) + tl.arange(0, BLOCK_C // GROUP)
    store_quantized(
        x.to(tl.float32), t_ok[:, None], codes_ptr + rows * stride_ct + c[None, :], scale_ptr,
        scales_ptr + g[None, :].to(tl.int64) * stride_sg + rt[:, None], t_ok[:, None],
        QUANT, BLOCK_T, BLOCK_C, GROUP, INTERPRETED,
    )


def quantize_output(x: torch.Tensor, out: QuantizedOutput) -> None:
    """x [T, C] -> out's codes and scales (as `output_quant.quantize_output`)."""
    check_device(x, out.codes)
    x = last_dim_contiguous(x)
    T, C = x.shape
    if T == 0:
        return
    group = out.quant.group
    # Per group: one group per program column; per tensor: 128 channels (C % 128 or less).
    block_c = group if group is not None else min(128, C & -C)
    scales = out.scales
    _quantize_output_kernel[(cdiv(T, _ROWS), C // block_c)](
        x, out.codes, scales, scales, T, x.stride(0), out.codes.stride(0),
        scales.stride(1) if group is not None else 0,
        QUANT=quant_mode(out), BLOCK_T=_ROWS, BLOCK_C=block_c, GROUP=group or block_c,
        INTERPRETED=INTERPRETED, num_warps=4,
    )
