"""Block-scaled fp8 linear layers: y = x W^T, W [N, K] float8_e4m3fn with one float32
scale per bn x bk block (`ops/block_fp8.py`), x quantized to e4m3 per token and
bk-channel group on the way in, as DeepSeek's inference does.

Each program computes a [BLOCK_M, BLOCK_N] tile of y over K steps of bk columns: one
step is one scale group of x and one block column of W, so

    acc += dot(x_fp8[m, step], W_fp8[n, step]) * x_scale[m, step] * W_scale[n // bn, step]

in float32 (the tensor cores accumulate one step's products, the scaling and the sum
over steps run in float32, outside them). Two ways to get x_fp8, one `Fp8GemmConfig`
field apart (`pick_config` chooses by rows):

* fused (few rows: decode, weight-read bound): each program quantizes its own
  [BLOCK_M, bk] tiles of x in registers (`fp8_quant.quantize_rows`); a tile row is one
  whole group, so its amax is the group's. Every column tile redoes this, which costs
  little next to reading W.
* separate (many rows: prefill, compute bound): `fp8_quant.quantize_activations` writes
  x_fp8 [M, K] and scales [K / bk, M] (each step's scales contiguous across rows) once,
  then the GEMM reads them; the GEMM's programs run in groups of `group_m` row tiles
  over the same column tiles so that W's tiles are reused from L2.

Where the output tiles alone cannot fill the GPU (q_a N=1536 and kv_a N=576 at decode),
`split_k` programs share a tile's K steps, each writing a float32 partial [split_k, M,
N]; a second kernel sums them in a fixed order: no atomics, the same bits every run.

Either way the quantization is `fp8_quant`'s, bit for bit
`block_fp8.quantize_activations`: a group holding NaN gets a NaN scale, and the row of y
becomes NaN.

Nothing here reads device values on the host or sizes memory by them: the op can be
captured in a CUDA graph. The fp8 tensor-core dot needs compute capability 8.9 (Ada,
Hopper) and a K step of at least 32; on older GPUs, or with bk not a power of two in
[32, 256], the op runs `reference.fp8_linear` (W dequantized per call, x not quantized).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedmla.ops import reference
from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE, scale_grid
from pagedmla.ops.output_quant import QuantizedOutput
from pagedmla.ops.output_quant import fp8_linear_quantized as reference_fp8_linear_quantized
from pagedmla.ops.triton._utils import (
    INTERPRETED,
    cdiv,
    check_device,
    last_dim_contiguous,
    multiprocessor_count,
    next_pow2,
)
from pagedmla.ops.triton.fp8_quant import fp8_dot_runs, quantize_activations, quantize_rows

# K steps (= bk) the kernels take: the fp8 dot needs K >= 32; 256 bounds the tiles'
# shared memory.
K_STEPS = (32, 64, 128, 256)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """Launch parameters of one fp8 linear call.

    fused: x quantized inside the GEMM's programs (else by `quantize_activations` first);
    block_m x block_n: the output tile of a program; split_k: programs that share one
    tile's K steps (1: none, no partials); group_m: row tiles whose programs run one
    after another over the same column tiles; num_warps, num_stages: as in Triton.
    """

    fused: bool
    block_m: int
    block_n: int
    split_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Rows up to which x is quantized inside the GEMM (`Fp8GemmConfig.fused`).
FUSED_MAX_M = 64
# Shared memory the pipelined tiles may take: of the 227 KB a Hopper program may use,
# some is left for the compiler's layout conversions (the fused path's x tile).
SHARED_BUDGET = 200 * 1024


def pick_config(M: int, N: int, K: int, bk: int, num_sms: int,
                x_bytes: int = 2) -> Fp8GemmConfig:
    """The launch parameters for x [M, K] (x_bytes per element) and W [N, K] with K
    steps of bk on a GPU of num_sms multiprocessors.

    | rows | path | tile | warps, stages | why |
    |---|---|---|---|---|
    | 1-32 | fused | next_pow2(M) (16 at least) x 128 | 4, 4 | W read once, x tiny |
    | 33-64 | fused | 64 x 128 | 8, 4 | the x tile in registers: 8 warps do not spill |
    | 65-256 | separate | 64 x 128, groups of 8 | 4, 4 | few row tiles |
    | 257+ | separate | 128 x 128, groups of 8 | 8, 3 | compute bound |

    split_k: enough splits of the K steps that the tiles x splits fill the GPU once
    (`split_steps`); stages as many as fit (`fit_stages`). `python -m
    benchmarks.bench_fp8_gemm --sweep` times alternatives.
    """
    if M <= FUSED_MAX_M:
        block_m = max(16, next_pow2(M))
        fused, group_m, warps, stages = True, 1, 4 if block_m <= 32 else 8, 4
    elif M <= 256:
        fused, block_m, group_m, warps, stages = False, 64, 8, 4, 4
    else:
        fused, block_m, group_m, warps, stages = False, 128, 8, 8, 3
    block_n = 128
    tiles = cdiv(M, block_m) * cdiv(N, block_n)
    config = Fp8GemmConfig(fused, block_m, block_n, split_steps(cdiv(K, bk), tiles, num_sms),
                           group_m, warps, stages)
    return fit_stages(config, bk, x_bytes)


def fit_stages(config: Fp8GemmConfig, bk: int, x_bytes: int) -> Fp8GemmConfig:
    """config with at most as many stages as SHARED_BUDGET holds of one stage's tiles
    (x's [block_m, bk], in x_bytes when fused, and W's [bk, block_n] fp8)."""
    stage_bytes = (config.block_m * (x_bytes if config.fused else 1) + config.block_n) * bk
    return replace(config, num_stages=max(1, min(config.num_stages,
                                                 SHARED_BUDGET // stage_bytes)))


def split_steps(steps: int, tiles: int, programs: int) -> int:
    """Splits of `steps` K steps such that tiles x splits reaches `programs` (1 when the
    tiles alone do), every split holding the same count of steps but the last."""
    if tiles >= programs or steps <= 1:
        return 1
    per_split = cdiv(steps, min(steps, cdiv(programs, tiles)))
    return cdiv(steps, per_split)


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid's (row tile, column tile): groups of GROUP_M row tiles, each group
    going over every column tile, its row tiles one after another on each."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    within = pid % (GROUP_M * tiles_n)
    return first_m + within % rows_in_group, within // rows_in_group


@triton.jit
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
    M, N, K, stride_am, stride_as, stride_wn, stride_wsn, stride_wsk, stride_om,
    stride_os, bn, steps_per_split,
    QUANTIZE_A: tl.constexpr, SCALE_PER_TILE: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """out[split, m, n] = sum over this split's K steps of the scaled fp8 dots.

    a: x [M, K] (QUANTIZE_A) or its codes [M, K] with scales at a_scale_ptr[step *
    stride_as + m]; w [N, K] fp8 and its scales [ceil(N / bn), K / BLOCK_K]; out: y [M,
    N] in x's dtype (stride_os 0, one split) or the float32 partials [split_k, M, N].
    SCALE_PER_TILE: bn is a multiple of BLOCK_N, so a tile's columns share one scale.
    """
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    split = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    kk = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn  # W^T's columns: [K, N] tiles
    if SCALE_PER_TILE:
        w_scales = w_scale_ptr + (pid_n * BLOCK_N // bn) * stride_wsn
    else:
        w_scales = w_scale_ptr + (rn // bn) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    for step in range(first, last):
        k = step * BLOCK_K + kk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # -- the step's scales: x's per row, W's per column --
        if QUANTIZE_A:
            a, a_scale = quantize_rows(a.to(tl.float32), INTERPRETED)
        else:
            a_scale = tl.load(a_scale_ptr + step * stride_as + rm, mask=m_ok, other=0.0)
        if SCALE_PER_TILE:
            w_scale = tl.load(w_scales + step * stride_wsk)
        else:
            w_scale = tl.load(w_scales + step * stride_wsk, mask=n_ok, other=0.0)[None, :]
        # -- one step's fp8 products, scaled and summed in float32 --
        acc += tl.dot(a, w) * (a_scale[:, None] * w_scale)
    out = (out_ptr + split.to(tl.int64) * stride_os + rm.to(tl.int64)[:, None] * stride_om
           + rn[None, :])
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """out[i] = sum over s of part[s * numel + i], s in order (the same bits every run)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    part = part_ptr + offs
    for _ in range(splits):
        acc += tl.load(part, mask=ok, other=0.0)
        part += numel  # 64-bit pointer arithmetic
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# Elements per program of the sum.
_SUM_BLOCK = 1024


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
           block_size: tuple[int, int]) -> None:
    """Shapes and dtypes of one call (a wrong scale grid would be read out of bounds)."""
    if weight.dtype != FP8_WEIGHT_DTYPE or weight.dim() != 2:
        raise TypeError(f"weight must be a 2-d {FP8_WEIGHT_DTYPE} tensor, got "
                        f"{weight.dtype} of shape {tuple(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension must be weight's K = {weight.shape[1]}, got "
                         f"x of shape {tuple(x.shape)}")
    grid = scale_grid(weight.shape, block_size)
    if tuple(scale_inv.shape) != grid or scale_inv.dtype != torch.float32:
        raise ValueError(f"scale_inv for a weight of shape {tuple(weight.shape)} with "
                         f"{block_size} blocks must be float32 of shape {grid}, got "
                         f"{scale_inv.dtype} of shape {tuple(scale_inv.shape)}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
    block_size: tuple[int, int], config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., N] in x's dtype, W [N, K] float8_e4m3fn with scale_inv
    [ceil(N / bn), ceil(K / bk)] float32 and block_size (bn, bk), x quantized per token
    and bk group (as `reference.fp8_linear`, which does not quantize x, but for that).

    config: launch parameters (default `pick_config`; stages cut to what shared memory
    holds, `fit_stages`). On GPUs below compute capability 8.9, or for a bk the kernels
    do not take (`K_STEPS`), `reference.fp8_linear` runs.
    """
    check_device(x, weight, scale_inv)
    _check(x, weight, scale_inv, block_size)
    bk = block_size[1]
    if bk not in K_STEPS or not fp8_dot_runs(x.device):
        return reference.fp8_linear(x, weight, scale_inv, block_size)
    N, K = weight.shape
    lead = x.shape[:-1]
    M = math.prod(lead)
    x = last_dim_contiguous(x.reshape(M, K))
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0 or K == 0:
        return out.zero_().view(*lead, N)
    c = fit_stages(config or pick_config(M, N, K, bk, multiprocessor_count(x.device)), bk,
                   x.element_size())
    if c.fused:
        _launch(x, x, 0, weight, scale_inv, block_size, c, out)  # x's scales: the kernel's own
    else:
        a, a_scale = quantize_activations(x, bk)
        _launch(a, a_scale, a_scale.stride(1), weight, scale_inv, block_size, c, out)
    return out.view(*lead, N)


def fp8_linear_quantized(
    x: QuantizedOutput, weight: torch.Tensor, scale_inv: torch.Tensor,
    block_size: tuple[int, int], dtype: torch.dtype, config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """`fp8_linear` on activations already quantized (`output_quant`: the attention
    output) -> [M, N] in `dtype`: no quantization pass, as
    `output_quant.fp8_linear_quantized`, which runs instead where `fp8_linear` would fall
    back, and for per-group codes whose group is not bk."""
    check_device(x.codes, weight, scale_inv)
    _check(x.codes, weight, scale_inv, block_size)
    bk = block_size[1]
    group = x.quant.group
    if bk not in K_STEPS or not fp8_dot_runs(x.codes.device) or group not in (None, bk):
        return reference_fp8_linear_quantized(x, weight, scale_inv, block_size, dtype)
    (M, K), N = x.codes.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=dtype, device=x.codes.device)
    if M == 0 or N == 0 or K == 0:
        return out.zero_()
    c = config or pick_config(M, N, K, bk, multiprocessor_count(out.device))
    c = fit_stages(replace(c, fused=False), bk, 1)
    scales = x.scales
    if group is None:  # the static scale, as every row's and step's
        scales = scales.expand(cdiv(K, bk), M).contiguous().t()
    _launch(x.codes, scales, scales.stride(1), weight, scale_inv, block_size, c, out)
    return out


def _launch(
    a: torch.Tensor, a_scale: torch.Tensor, stride_as: int, weight: torch.Tensor,
    scale_inv: torch.Tensor, block_size: tuple[int, int], c: Fp8GemmConfig,
    out: torch.Tensor,
) -> None:
    """out [M, N] = a @ W.T: a [M, K] is x (c.fused) or its codes, with scales
    a_scale[step * stride_as + m] (`_fp8_gemm_kernel`)."""
    (M, K), N = a.shape, weight.shape[0]
    bn, bk = block_size
    weight = last_dim_contiguous(weight)
    steps = cdiv(K, bk)
    per_split = cdiv(steps, c.split_k)
    splits = cdiv(steps, per_split)  # every split holds at least one step
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32,
                                                 device=out.device)
    grid = (cdiv(M, c.block_m) * cdiv(N, c.block_n), splits)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, scale_inv, target, M, N, K, a.stride(0), stride_as,
        weight.stride(0), scale_inv.stride(0), scale_inv.stride(1), N,
        M * N if splits > 1 else 0, bn, per_split,
        QUANTIZE_A=c.fused, SCALE_PER_TILE=bn % c.block_n == 0, INTERPRETED=INTERPRETED,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=bk, GROUP_M=c.group_m,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if splits > 1:
        _sum_splits_kernel[(cdiv(M * N, _SUM_BLOCK),)](
            target, out, M * N, splits, BLOCK=_SUM_BLOCK, num_warps=4)
