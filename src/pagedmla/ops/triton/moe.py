"""Routed experts (the MoE's SwiGLU experts) as two grouped-GEMM Triton kernels.

The T * k (token, expert) pairs are sorted by expert on the device and laid out in
blocks of BLOCK_M rows, each block holding pairs of one expert only (an expert's last
block is padded with empty rows). The layout's size is bounded by T * k + E * BLOCK_M
whatever the routing, so nothing waits for the device and a decode step with experts
can be captured in a CUDA graph; blocks past the used ones leave at once.

* `_gate_up_kernel`, grid (blocks, I / BLOCK_N): a [BLOCK_M, BLOCK_N] tile of the gate
  and the up projection of one block's tokens (rows of x gathered by token) against
  that expert's w13 rows, and silu(gate) * up, stored to the block's rows of a scratch.
* `_down_kernel`, grid (blocks, H / BLOCK_N): that scratch against the expert's w2,
  scaled by each pair's routing weight, stored to the pair's own row of a [T * k, H]
  float32 buffer, which a sum over k folds into tokens (no atomics: the order of the
  additions is fixed).

Each expert's weights are read once per block of its tokens: at decode batch sizes
(a few tokens per expert) that is once per step, the bound of a weight-read-bound
layer. Pairs whose expert id is >= E (another rank's, under tensor parallelism) are
left out and contribute 0.

Block-fp8 experts (`ops/block_fp8.py`: e4m3 weights, one float32 scale per bn x bk
block) run the same kernels with fp8 x fp8 dots, one K step per bk group:

* `fp8_quant.quantize_activations` first quantizes x once per token and bk group
  (amax / 448, as `block_fp8.quantize_activations`), so the gate_up kernel gathers
  1-byte rows that go straight to the tensor cores (no per-tile quantization repeated
  for every I / BLOCK_N column tile, none in the K loop);
* each K step adds dot(a, w) * a_scale[row] * w_scale[column's block], in float32;
* the gate_up kernel's column tile is one bk group of the intermediate, so its epilogue
  quantizes silu(gate) * up itself (`fp8_quant.quantize_rows`) and stores e4m3 rows
  with a scale per row and group: the down kernel is a plain fp8 grouped GEMM.

The kernels read x's and the intermediate's scales through their strides; both are
stored group-major (a group's scales contiguous across rows, as
`fp8_quant.quantize_activations` writes x's: one piece per K step of the down kernel).
A group holding NaN gets a NaN scale, so a NaN in a token's x gives a NaN output row for
that token, as in the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedmla.ops import reference
from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    check_device,
    dot_precision,
    next_pow2,
)
from pagedmla.ops.triton.fp8_quant import fp8_dot_runs, quantize_activations, quantize_rows


@dataclass(frozen=True)
class MoEConfig:
    """Launch parameters of both kernels: block_m rows (pairs) per block, block_n output
    columns and block_k reduction columns per program step, warps, pipeline stages.

    With block-fp8 experts block_k is the weights' bk (one scale per K step) and the
    gate_up kernel's column tile is block_k too (one quantization group of the
    intermediate per program); block_n is then the down kernel's column tile only."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Shared memory the pipelined tiles may take (of the 227 KB a Hopper program may use).
# Triton buffers num_stages - 1 sets of a loop's tiles (2 x 136 KB for float32 tiles of
# 16 x 128 and two of 128 x 128 at 3 stages).
SHARED_BUDGET = 220 * 1024


def _stage_bytes(c: MoEConfig, element_size: int, fp8: bool) -> int:
    """Bytes of one pipeline stage of the larger kernel: the gate_up kernel's x tile and
    two weight tiles, or (fp8, where the gate_up tile is block_k wide) the down
    kernel's activation and weight tiles."""
    gate_up_n = c.block_k if fp8 else c.block_n
    return max(c.block_m + 2 * gate_up_n, c.block_m + c.block_n) * c.block_k * element_size


def pick_config(num_pairs: int, num_experts: int, element_size: int = 2,
                group: int | None = None) -> MoEConfig:
    """Rows per block about the pairs an expert gets, 16 (the MMA minimum) to 128.

    Tuned in bf16 with `python -m benchmarks.bench_moe --sweep` (block_m, block_n
    64/128, block_k 64/128, 4/8 warps, 3/4 stages; graph replay): few rows (weight-read
    bound) want long reduction steps; many rows want large tiles and 8 warps. Wider
    elements (float32) shrink stages, then block_k, then block_n until the gate_up
    kernel's buffered stages (an x tile and two weight tiles each) fit SHARED_BUDGET.

    group: block-fp8 experts' bk, the block_k they need (`fused_experts` passes it).
    Their blocks stop at 64 rows: the gate_up kernel adds each step's scaled dot
    products to its two float32 accumulators, and at 128 rows and 8 warps the three
    tiles spill registers (ptxas for sm_90a); 1-byte tiles leave room for more stages.
    Chosen from ptxas reports, not yet timed on a GPU (`bench_moe --sweep --fp8`).
    """
    fp8 = group is not None
    block_m = min(128, max(16, next_pow2(cdiv(num_pairs, num_experts))))
    if fp8:
        block_m = min(block_m, 64)
        c = MoEConfig(block_m, block_n=128, block_k=group, num_warps=4 if block_m == 16 else 8,
                      num_stages=5 if block_m == 16 else 4)
        element_size = 1
    elif block_m >= 64:
        c = MoEConfig(block_m, block_n=128, block_k=64, num_warps=8, num_stages=4)
    else:
        c = MoEConfig(block_m, block_n=128, block_k=128, num_warps=4, num_stages=3)
    while (c.num_stages - 1) * _stage_bytes(c, element_size, fp8) > SHARED_BUDGET:
        if c.num_stages > 2:
            c = replace(c, num_stages=c.num_stages - 1)
        elif c.block_k > 32 and not fp8:
            c = replace(c, block_k=c.block_k // 2)
        elif c.block_n > 16:
            c = replace(c, block_n=c.block_n // 2)
        else:
            break
    return c


@triton.jit
def _block_rows(row_pair_ptr, k, BLOCK_M: tl.constexpr):
    """Block pid(0)'s rows, their pair ids (-1: padding), which rows hold a pair, and
    their tokens."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(row_pair_ptr + rows)
    return rows.to(tl.int64), pair.to(tl.int64), pair >= 0, pair // k


@triton.jit(  # batch-dependent: no variant per value (engine/warmup.py)
    do_not_specialize=["stride_xsg"])
def _gate_up_kernel(
    x_ptr, w13_ptr, inter_ptr, block_expert_ptr, row_pair_ptr,
    stride_xt, stride_we, stride_wn, num_experts, k, H, inter_size,
    x_scale_ptr, stride_xst, stride_xsg, w13_scale_ptr,
    inter_scale_ptr, stride_isr, stride_isg, SCALE_BN: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):
    """inter[rows, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]).

    FP8: x and w13 in e4m3 with scales x_scale [T, H / BLOCK_K] (strides stride_xst,
    stride_xsg) and w13_scale [E, 2, I / SCALE_BN, H / BLOCK_K] (BLOCK_K = the weights'
    bk); inter stored in e4m3 with inter_scale [rows, I / BLOCK_N] (strides stride_isr,
    stride_isg; BLOCK_N = BLOCK_K: one group per program)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert >= num_experts:
        return  # a block past the used ones
    rows, _, has_pair, token = _block_rows(row_pair_ptr, k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * stride_xt
    gate_rows = w13_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wn
    up_rows = gate_rows + inter_size * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        groups = tl.cdiv(H, BLOCK_K)
        half = tl.cdiv(inter_size, SCALE_BN) * groups  # one projection's scales
        x_scales = x_scale_ptr + token * stride_xst
        gate_scales = w13_scale_ptr + expert * 2 * half + (cols // SCALE_BN) * groups
        up_scales = gate_scales + half
    for start in range(0, H, BLOCK_K):
        k_ok = start + kk < H
        a = tl.load(x_rows + start + kk[None, :], mask=has_pair[:, None] & k_ok[None, :],
                    other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_rows + start + kk[:, None], mask=w_mask, other=0.0)
        w_up = tl.load(up_rows + start + kk[:, None], mask=w_mask, other=0.0)
        if FP8:
            group = start // BLOCK_K
            a_s = tl.load(x_scales + group * stride_xsg, mask=has_pair, other=0.0)
            g_s = tl.load(gate_scales + group, mask=col_ok, other=0.0)
            u_s = tl.load(up_scales + group, mask=col_ok, other=0.0)
            gate += tl.dot(a, w_gate) * (a_s[:, None] * g_s[None, :])
            up += tl.dot(a, w_up) * (a_s[:, None] * u_s[None, :])
        else:
            gate = tl.dot(a, w_gate, gate, input_precision=PRECISION)
            up = tl.dot(a, w_up, up, input_precision=PRECISION)
    act = gate / (1.0 + tl.exp(-gate)) * up  # columns past I are 0: no effect on amax
    if FP8:
        q, s = quantize_rows(act, SOFTWARE_ROUND)
        tl.store(inter_ptr + rows[:, None] * inter_size + cols[None, :], q,
                 mask=has_pair[:, None] & col_ok[None, :])
        tl.store(inter_scale_ptr + rows * stride_isr + tl.program_id(1) * stride_isg, s,
                 mask=has_pair)
    else:
        tl.store(inter_ptr + rows[:, None] * inter_size + cols[None, :],
                 act.to(inter_ptr.dtype.element_ty), mask=has_pair[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, w2_ptr, weight_ptr, y_ptr, block_expert_ptr, row_pair_ptr,
    stride_we, stride_wh, num_experts, k, H, inter_size,
    inter_scale_ptr, stride_isr, stride_isg, w2_scale_ptr, SCALE_BN: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, FP8: tl.constexpr,
):
    """y[pair, n] = routing weight[pair] * (inter[rows] . w2[e, n]), in float32.

    FP8: inter and w2 in e4m3 with scales inter_scale [rows, I / BLOCK_K] (strides
    stride_isr, stride_isg) and w2_scale [E, H / SCALE_BN, I / BLOCK_K]."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert >= num_experts:
        return
    rows, pair, has_pair, _ = _block_rows(row_pair_ptr, k, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    kk = tl.arange(0, BLOCK_K)
    w_rows = w2_ptr + expert * stride_we + cols.to(tl.int64)[None, :] * stride_wh
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if FP8:
        groups = tl.cdiv(inter_size, BLOCK_K)
        a_scales = inter_scale_ptr + rows * stride_isr
        w_scales = (w2_scale_ptr + expert * tl.cdiv(H, SCALE_BN) * groups
                    + (cols // SCALE_BN) * groups)
    for start in range(0, inter_size, BLOCK_K):
        k_ok = start + kk < inter_size
        a = tl.load(inter_ptr + rows[:, None] * inter_size + start + kk[None, :],
                    mask=has_pair[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + start + kk[:, None], mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)
        if FP8:
            group = start // BLOCK_K
            a_s = tl.load(a_scales + group * stride_isg, mask=has_pair, other=0.0)
            w_s = tl.load(w_scales + group, mask=col_ok, other=0.0)
            acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    scale = tl.load(weight_ptr + pair, mask=has_pair, other=0.0)
    tl.store(y_ptr + pair[:, None] * H + cols[None, :], acc * scale[:, None],
             mask=has_pair[:, None] & col_ok[None, :])


def block_layout(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ids [T, k] sorted by expert in blocks of block_m rows, on the device.

    Returns block_expert [num_blocks] int32 (the expert of each block; num_experts for a
    block past the used ones) and row_pair [num_blocks * block_m] int32 (the pair index
    t * k + j in each row; -1 for padding), num_blocks = ceil(T k / block_m) + E, the
    most any routing needs. Ids >= num_experts are left out. Only device ops of fixed
    shapes: no host synchronisation.
    """
    device = ids.device
    pairs = ids.numel()
    expert = ids.reshape(-1).clamp(max=num_experts)  # E: dropped
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, expert, torch.ones_like(expert))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    first = counts.cumsum(0) - counts  # each expert's first index in sorted order
    rank = torch.arange(pairs, device=device) - first[sorted_expert]
    num_blocks = cdiv(pairs, block_m) + num_experts
    size = num_blocks * block_m
    # Dropped pairs land in a spare last row, cut off below.
    dest = torch.where(sorted_expert < num_experts, ends[sorted_expert] - padded[sorted_expert]
                       + rank, size)
    row_pair = torch.full((size + 1,), -1, dtype=torch.int32, device=device)
    row_pair.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends[:num_experts], block_start, right=True)
    return block_expert.to(torch.int32), row_pair[:size]


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
    ids: torch.Tensor, w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None, block_size: Sequence[int] | None = None,
    config: MoEConfig | None = None,
) -> torch.Tensor:
    """As `reference.fused_experts`: x [T, H], w13 [E, 2I, H], w2 [E, H, I], routing
    weights [T, k] float32 and ids [T, k] -> [T, H] in x's dtype. config: launch
    parameters (default `pick_config`).

    Block-fp8 experts (w13, w2 in float8_e4m3fn with w13_scale_inv [E, 2, ceil(I / bn),
    ceil(H / bk)], w2_scale_inv [E, ceil(H / bn), ceil(I / bk)], block_size (bn, bk), bk
    a power of two of at least 16) run fp8 dots on activations quantized per token and
    bk group (x, and silu(gate) * up); a config must then have block_k = bk. On a CUDA
    device older than compute capability 8.9 they run the reference (which synchronises
    with the host).
    """
    check_device(x, w13, w2, weights, ids)
    fp8 = w13_scale_inv is not None
    if fp8 != (w2_scale_inv is not None) or fp8 != (block_size is not None):
        raise ValueError("block-fp8 experts need w13_scale_inv, w2_scale_inv and block_size "
                         f"together; got w13_scale_inv {_given(w13_scale_inv)}, "
                         f"w2_scale_inv {_given(w2_scale_inv)}, block_size {block_size}")
    if fp8 and not fp8_dot_runs(x.device):
        return reference.fused_experts(x, w13, w2, weights, ids, w13_scale_inv,
                                       w2_scale_inv, tuple(block_size))
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter_size = two_i // 2
    k = ids.shape[1]
    y = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    if T == 0 or E == 0:
        return y.view(T, k, H).sum(1).to(x.dtype)
    out_dtype = x.dtype
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13 = w13 if w13.stride(-1) == 1 else w13.contiguous()
    w2 = w2 if w2.stride(-1) == 1 else w2.contiguous()
    weights = weights.reshape(-1).float().contiguous()
    if fp8:
        bn, bk = block_size
        c = config or pick_config(T * k, E, group=bk)
        if c.block_k != bk:
            raise ValueError(f"config.block_k must be the weights' bk {bk} for block-fp8 "
                             f"experts, got {c.block_k}")
        x, x_scale = quantize_activations(x, bk)
        w13_scale, w2_scale = w13_scale_inv.float().contiguous(), w2_scale_inv.float().contiguous()
        inter_dtype, gate_up_n, precision = FP8_WEIGHT_DTYPE, bk, "tf32"
    else:
        bn = 0
        c = config or pick_config(T * k, E, x.element_size())
        x_scale = w13_scale = w2_scale = None
        inter_dtype, gate_up_n, precision = x.dtype, c.block_n, dot_precision(x.dtype)
    block_expert, row_pair = block_layout(ids, E, c.block_m)
    num_blocks = block_expert.shape[0]
    rows = num_blocks * c.block_m
    inter = torch.empty(rows, inter_size, dtype=inter_dtype, device=x.device)
    # inter's scales [rows, groups] stored group-major, as x's.
    inter_scale = (torch.empty(cdiv(inter_size, gate_up_n), rows, dtype=torch.float32,
                               device=x.device).t() if fp8 else None)
    x_strides = x_scale.stride() if fp8 else (0, 0)
    inter_strides = inter_scale.stride() if fp8 else (0, 0)
    common = dict(SCALE_BN=bn, PRECISION=precision, BLOCK_M=c.block_m, BLOCK_K=c.block_k,
                  FP8=fp8, num_warps=c.num_warps, num_stages=c.num_stages)
    _gate_up_kernel[(num_blocks, cdiv(inter_size, gate_up_n))](
        x, w13, inter, block_expert, row_pair, x.stride(0), w13.stride(0), w13.stride(1),
        E, k, H, inter_size, x_scale, *x_strides, w13_scale, inter_scale, *inter_strides,
        BLOCK_N=gate_up_n, SOFTWARE_ROUND=INTERPRETED, **common,
    )
    _down_kernel[(num_blocks, cdiv(H, c.block_n))](
        inter, w2, weights, y, block_expert, row_pair, w2.stride(0), w2.stride(1),
        E, k, H, inter_size, inter_scale, *inter_strides, w2_scale, BLOCK_N=c.block_n,
        **common,
    )
    return y.view(T, k, H).sum(1).to(out_dtype)


def _given(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"a tensor of shape {tuple(t.shape)}"
