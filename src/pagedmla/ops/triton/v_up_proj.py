"""The decode output's V up-projection with the fp8 quantization as its epilogue.

out[t, n] = latent[t, n] @ W_UV[n] for T tokens and N heads (latent [T, N, L], W_UV
[N, L, V]), written straight as fp8 codes and scales (`output_quant`) for o_proj: the
16-bit output is never stored. Grid (token tiles, heads): a program accumulates a
[BLOCK_T, V] tile over L in float32 and quantizes it in registers; each head's V
channels are whole groups (V a power of two and a multiple of the group), so a tile
row's groups are complete. At decode sizes (T <= 64) one token tile reads each head's
W_UV once, as the bmm it replaces does. Graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.ops.output_quant import v_up_proj_quant as reference_v_up_proj_quant
from pagedmla.ops.triton._utils import INTERPRETED, cdiv, check_device, next_pow2
from pagedmla.ops.triton.output_quant import quant_mode, store_quantized

_BLOCK_L = 64


@triton.jit(do_not_specialize=["T"])  # batch-dependent: no variant per value
def _v_up_proj_kernel(
    latent_ptr, w_ptr, codes_ptr, scale_ptr, scales_ptr, T, L,
    stride_lt, stride_ln, stride_wn, stride_wl, stride_ct, stride_sg,
    QUANT: tl.constexpr, V: tl.constexpr, GROUP: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_L: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Tokens [pid(0) * BLOCK_T, ...) of head pid(1)."""
    n = tl.program_id(1).to(tl.int64)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = rt < T
    v = tl.arange(0, V)
    rows = latent_ptr + rt.to(tl.int64)[:, None] * stride_lt + n * stride_ln
    w_head = w_ptr + n * stride_wn + v[None, :]
    acc = tl.zeros((BLOCK_T, V), dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        ll = start + tl.arange(0, BLOCK_L)
        l_ok = ll < L
        a = tl.load(rows + ll[None, :], mask=t_ok[:, None] & l_ok[None, :], other=0.0)
        w = tl.load(w_head + ll[:, None] * stride_wl, mask=l_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    g = n * (V // GROUP) + tl.arange(0, V // GROUP)
    store_quantized(
        acc, t_ok[:, None], codes_ptr + rt.to(tl.int64)[:, None] * stride_ct + n * V + v[None, :],
        scale_ptr, scales_ptr + g[None, :] * stride_sg + rt[:, None], t_ok[:, None],
        QUANT, BLOCK_T, V, GROUP, INTERPRETED,
    )


def v_up_proj_quant(latent: torch.Tensor, W_UV: torch.Tensor, out: QuantizedOutput) -> None:
    """latent [T, N, L] @ W_UV [N, L, V] per head -> out ([T, N * V] quantized), as
    `output_quant.v_up_proj_quant`; a V that is not a power of two, or not a multiple
    of the group, takes that PyTorch path."""
    check_device(latent, W_UV, out.codes)
    T, N, L = latent.shape
    V = W_UV.shape[2]
    group = out.quant.group
    if next_pow2(V) != V or V < 16 or (group is not None and V % group):
        reference_v_up_proj_quant(latent, W_UV, out)
        return
    if T == 0:
        return
    if latent.stride(2) != 1:
        latent = latent.contiguous()
    if W_UV.stride(2) != 1:
        W_UV = W_UV.contiguous()
    block_t = max(16, min(64, next_pow2(T)))
    scales = out.scales
    _v_up_proj_kernel[(cdiv(T, block_t), N)](
        latent, W_UV, out.codes, scales, scales, T, L,
        latent.stride(0), latent.stride(1), W_UV.stride(0), W_UV.stride(1),
        out.codes.stride(0), scales.stride(1) if group is not None else 0,
        QUANT=quant_mode(out), V=V, GROUP=group or V, BLOCK_T=block_t, BLOCK_L=_BLOCK_L,
        # float32 inputs (tests, CPU models) without TF32 rounding.
        PRECISION="ieee" if latent.dtype == torch.float32 else "tf32",
        INTERPRETED=INTERPRETED,
        num_warps=4 if block_t <= 32 else 8,
    )
