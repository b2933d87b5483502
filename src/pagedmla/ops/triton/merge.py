"""merge_attn_states in one memory-bound Triton kernel (and merge_attn_states_quant: the
same, its output quantized to fp8 in the epilogue, `output_quant`).

Grid (tokens, head blocks): a program merges BLOCK_HEADS heads x D of one token. Each
element is read once from each partial and written once; the two lse values per head
are read once and the merged lse written once. Outputs and lse views may have any
strides (e.g. out[a:b] and lse[:, a:b] slices of running buffers) and may alias.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    check_device,
    last_dim_contiguous,
    next_pow2,
)
from pagedmla.ops.triton.output_quant import quant_mode, quantize_output, store_quantized

# Elements (heads x D) per program: 4096 gives each of 128 threads 32 elements, i.e.
# several 16-byte loads in flight per tensor, which a bandwidth-bound kernel needs.
MERGE_ELEMENTS = 4096
MERGE_WARPS = 4


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_plh", "stride_slh", "stride_olh"],
    do_not_specialize_on_alignment=["prefix_lse_ptr", "suffix_lse_ptr", "out_lse_ptr"])
def _merge_kernel(
    prefix_ptr, prefix_lse_ptr, suffix_ptr, suffix_lse_ptr, out_ptr, out_lse_ptr,
    stride_pt, stride_ph, stride_st, stride_sh, stride_ot, stride_oh,
    stride_plh, stride_plt, stride_slh, stride_slt, stride_olh, stride_olt,
    num_heads, scale_ptr, scales_ptr, stride_sg,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    WRITE_LSE: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """out = (e^lse_p out_p + e^lse_s out_s) / (e^lse_p + e^lse_s) for one token; a NaN
    lse makes the head's output and lse NaN. QUANT (`output_quant`): out holds fp8
    codes [T, N * D] (row stride stride_ot), written with their scales instead."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_ok = heads < num_heads
    h = heads.to(tl.int64)
    lse_p = tl.load(prefix_lse_ptr + h * stride_plh + t * stride_plt, mask=head_ok,
                    other=float("-inf"))
    lse_s = tl.load(suffix_lse_ptr + h * stride_slh + t * stride_slt, mask=head_ok,
                    other=float("-inf"))
    # +inf is what some kernels report for a row with no key: treat it as empty.
    lse_p = tl.where(lse_p == float("inf"), float("-inf"), lse_p)
    lse_s = tl.where(lse_s == float("inf"), float("-inf"), lse_s)
    peak = tl.maximum(lse_p, lse_s)
    peak = tl.where(peak == float("-inf"), 0.0, peak)
    w_p = tl.exp(lse_p - peak)
    w_s = tl.exp(lse_s - peak)
    total = w_p + w_s
    has_key = total > 0.0
    denom = tl.where(has_key, total, 1.0)

    cols = tl.arange(0, BLOCK_D)
    col_ok = cols[None, :] < D
    # An empty partial's output is not trusted (may be NaN): it is not even read.
    o_p = tl.load(prefix_ptr + t * stride_pt + h[:, None] * stride_ph + cols[None, :],
                  mask=(head_ok & (w_p > 0.0))[:, None] & col_ok, other=0.0)
    o_s = tl.load(suffix_ptr + t * stride_st + h[:, None] * stride_sh + cols[None, :],
                  mask=(head_ok & (w_s > 0.0))[:, None] & col_ok, other=0.0)
    # In place, a head's lse is read by threads of several warps and written by one:
    # every read must land before any write (without the barrier a warp can read an lse
    # another warp has already merged; tests/test_triton_merge.py's GPU test).
    tl.debug_barrier()
    merged = o_p.to(tl.float32) * (w_p / denom)[:, None] + o_s.to(tl.float32) * (
        w_s / denom)[:, None]
    # A NaN lse is not an empty partial: it makes its weight, so `total`, NaN (whether
    # max() skipped it, as on the GPU, or not, as in the interpreter), and the head NaN.
    nan = total != total
    merged = tl.where(nan[:, None], float("nan"), merged)
    if QUANT == 0:
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + cols[None, :],
                 merged.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & col_ok)
    else:  # BLOCK_D == D: a head's channels are whole groups
        g = h[:, None] * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]
        store_quantized(merged, head_ok[:, None], out_ptr + t * stride_ot + h[:, None] * D
                        + cols[None, :], scale_ptr, scales_ptr + g * stride_sg + t,
                        head_ok[:, None], QUANT, BLOCK_HEADS, D, GROUP, INTERPRETED)
    if WRITE_LSE:
        merged_lse = tl.where(has_key, peak + tl.log(denom), float("-inf"))
        merged_lse = tl.where(nan, float("nan"), merged_lse)
        tl.store(out_lse_ptr + h * stride_olh + t * stride_olt, merged_lse, mask=head_ok)


def merge_attn_states(
    prefix_output: torch.Tensor,
    prefix_lse: torch.Tensor,
    suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor,
    output: torch.Tensor,
    output_lse: torch.Tensor | None,
) -> None:
    """Merge two softmax partials over disjoint keys (as `reference.merge_attn_states`).

    prefix_output / suffix_output / output [T, N, D]; prefix_lse / suffix_lse /
    output_lse [N, T] float32, any strides. -inf or +inf lse = empty partial; two
    empties give (0, -inf); a NaN lse gives NaN. `output` / `output_lse` may alias the inputs.
    """
    check_device(prefix_output, output)
    target = last_dim_contiguous(output)
    _launch(prefix_output, prefix_lse, suffix_output, suffix_lse, target, output_lse)
    if target is not output:
        output.copy_(target)


def merge_attn_states_quant(
    prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor, out: QuantizedOutput,
) -> None:
    """The merge of two partials [T, N, D] written as out ([T, N * D] quantized, as
    `output_quant.merge_attn_states_quant`) by the kernel's epilogue; a D that is not
    a power of two, or not a multiple of the group, merges to float32 first."""
    check_device(prefix_output, out.codes)
    T, N, D = prefix_output.shape
    group = out.quant.group
    if next_pow2(D) != D or (group is not None and D % group):
        merged = prefix_output.new_empty(T, N, D, dtype=torch.float32)
        _launch(prefix_output, prefix_lse, suffix_output, suffix_lse, merged, None)
        quantize_output(merged.view(T, N * D), out)
        return
    _launch(prefix_output, prefix_lse, suffix_output, suffix_lse, out.codes.view(T, N, D),
            None, out)


def _launch(
    prefix_output: torch.Tensor, prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
    suffix_lse: torch.Tensor, target: torch.Tensor, output_lse: torch.Tensor | None,
    quantized: QuantizedOutput | None = None,
) -> None:
    """One merge kernel into target [T, N, D] (last dimension contiguous): the output,
    or the codes of `quantized`."""
    num_tokens, num_heads, width = prefix_output.shape
    if num_tokens == 0 or num_heads == 0:
        return
    prefix_output = last_dim_contiguous(prefix_output)
    suffix_output = last_dim_contiguous(suffix_output)
    block_d = next_pow2(width)
    block_heads = max(1, min(next_pow2(num_heads), MERGE_ELEMENTS // block_d))
    write_lse = output_lse is not None
    lse_out = output_lse if write_lse else prefix_lse  # never written when not asked
    scales = prefix_lse if quantized is None else quantized.scales  # read only if quantized
    group = None if quantized is None else quantized.quant.group
    _merge_kernel[(num_tokens, cdiv(num_heads, block_heads))](
        prefix_output, prefix_lse, suffix_output, suffix_lse, target, lse_out,
        prefix_output.stride(0), prefix_output.stride(1),
        suffix_output.stride(0), suffix_output.stride(1),
        target.stride(0), target.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1),
        suffix_lse.stride(0), suffix_lse.stride(1),
        lse_out.stride(0), lse_out.stride(1),
        num_heads, scales, scales, scales.stride(1) if group is not None else 0,
        D=width, BLOCK_D=block_d, BLOCK_HEADS=block_heads, WRITE_LSE=write_lse,
        QUANT=0 if quantized is None else quant_mode(quantized), GROUP=group or block_d,
        INTERPRETED=INTERPRETED, num_warps=MERGE_WARPS,
    )
