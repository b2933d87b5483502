"""The rotary embedding of one MLA step (q's rope dims and k_pe) in one Triton kernel.

One program per token rotates the R rope dims of all N query heads in place and writes
the rotated k_pe row to a new contiguous tensor, reading each element once. The eager
form (casts, strided slices, four products, a concatenation and a copy back into q)
is about a dozen kernels per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.triton._utils import check_device, next_pow2


@triton.jit
def _rotate(x_ptr, first_cols, second_cols, mask, cos, sin):
    """The rotated pairs of one row block: (first * cos - second * sin, second * cos +
    first * sin) in float32, from the pair members at first_cols / second_cols."""
    first = tl.load(x_ptr + first_cols, mask=mask, other=0.0).to(tl.float32)
    second = tl.load(x_ptr + second_cols, mask=mask, other=0.0).to(tl.float32)
    return first * cos - second * sin, second * cos + first * sin


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, k_out_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_ct, stride_st, num_heads, q_offset,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """Token t: q[t, h, q_offset:] for every head h, in place, and k_out[t] = rotated k[t];
    the rotated pairs are written as [first members | second members]."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cos_ptr + t * stride_ct + i, mask=i_ok, other=0.0)
    sin = tl.load(sin_ptr + t * stride_st + i, mask=i_ok, other=0.0)
    if INTERLEAVED:
        first_cols, second_cols = 2 * i, 2 * i + 1
    else:
        first_cols, second_cols = i, i + HALF
    k_row = k_ptr + t * stride_kt
    k_first, k_second = _rotate(k_row, first_cols, second_cols, i_ok, cos, sin)
    k_out = k_out_ptr + t * (2 * HALF)
    tl.store(k_out + i, k_first.to(k_out_ptr.dtype.element_ty), mask=i_ok)
    tl.store(k_out + HALF + i, k_second.to(k_out_ptr.dtype.element_ty), mask=i_ok)
    for start in range(0, num_heads, BLOCK_HEADS):
        heads = start + tl.arange(0, BLOCK_HEADS)
        mask = (heads < num_heads)[:, None] & i_ok[None, :]
        rows = q_ptr + t * stride_qt + heads.to(tl.int64)[:, None] * stride_qh + q_offset
        q_first, q_second = _rotate(rows, first_cols[None, :], second_cols[None, :], mask,
                                    cos[None, :], sin[None, :])
        # In place: every thread's reads of these heads land before any write (the
        # interleaved layout reads a column that another thread writes).
        tl.debug_barrier()
        tl.store(rows + i[None, :], q_first.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(rows + HALF + i[None, :], q_second.to(q_ptr.dtype.element_ty), mask=mask)


def rotary(
    q: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """As `reference.rotary`: rotates q [T, N, P + R]'s last R dims in place; returns k_pe
    [T, R] (rows may be strided) rotated, contiguous."""
    check_device(q, k_pe, cos)
    T, N, width = q.shape
    R = k_pe.shape[-1]
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dimension (it is rotated in place)")
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    k_out = torch.empty((T, R), dtype=k_pe.dtype, device=k_pe.device)
    if T == 0 or R == 0:
        return k_out
    half = R // 2
    block_half = next_pow2(half)
    block_heads = max(1, min(next_pow2(N), 4096 // block_half))
    _rope_kernel[(T,)](
        q, k_pe, k_out, cos, sin, q.stride(0), q.stride(1), k_pe.stride(0), cos.stride(0),
        sin.stride(0), N, width - R,
        HALF=half, BLOCK_HALF=block_half, BLOCK_HEADS=block_heads, INTERLEAVED=interleaved,
        num_warps=4,
    )
    return k_out
