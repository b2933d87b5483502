"""Which kernel runs a call: one ordered table per op, whose first entry that supports the
call runs it.

Decode (stage 1 of `decode.mla_decode`): on a Hopper GPU with the Triton release the
Gluon kernels are written for, `decode_hopper_fp8`, `decode_hopper` and
`decode_hopper_heads`, in that order; then the portable Triton kernel
(`decode_triton`), which takes any call (an fp8_ds_mla cache runs only there: the Gluon
kernels' `supported` want rows of L + R values, of q's dtype or fp8). Prefill
(`prefill.prefill_attention`): cuDNN for batches of equal-length sequences on a CUDA
device, then on Hopper the Gluon kernel `prefill_hopper`, then the portable Triton
kernel (`prefill_triton`). Each entry is a
typed spec: what it supports (a predicate on the call), and, for decode, what the split
planner needs of it. docs/kernels.md mirrors these tables as (GPU, cache dtype, query
rows per request, page size) -> kernel; tests/test_triton_selection.py checks both
against a table of expected choices.

The Gluon modules are imported the first time a table is built for a platform that runs
them: they need Gluon's API, which other Triton releases lack or change.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pagedmla.ops.triton import decode_triton, prefill_cudnn, prefill_triton
from pagedmla.ops.triton._utils import Platform, device_platform, next_pow2
from pagedmla.ops.triton.decode_triton import DecodeConfig, pick_config, quantized
from pagedmla.ops.triton.prefill_triton import PrefillConfig
from pagedmla.ops.triton.split_plan import TAIL_WAVE


@dataclass(frozen=True)
class DecodeKernel:
    """A stage-1 kernel of paged latent decode, as the dispatch and the split planner see
    it.

    name: its module in this package. supports(q, data, num_rows, L): whether it takes
    the call (q [T, N, L + R] and the cache data [num_blocks, page, L + R] with unit
    last stride, num_rows = N * max_query_len query rows per request). launch(q, data,
    scale, block_table, plan, out, lse, part_out, part_lse, head_groups, softmax_scale,
    L): run it (`decode_triton.decode_partial` says what each argument is). block_h:
    query rows per program; block_n: positions per tile, the unit the split plan cuts
    requests in. persistent: a program runs a run of splits one after another, so the
    split planner may make a persistent plan. past_wave_tiles: a split's fixed cost past
    one wave of requests, in tiles; tail_wave: a last partial wave's cost there, as a
    fraction of a full wave's (`split_plan.plan_splits`). gluon: a Gluon kernel (needs
    `Platform.runs_gluon`). pdl: it lets the combine launch before it ends
    (programmatic dependent launch).
    """

    name: str
    supports: Callable[[torch.Tensor, torch.Tensor, int, int], bool]
    launch: Callable[..., None]
    block_h: int
    block_n: int
    persistent: bool
    past_wave_tiles: int
    tail_wave: float
    gluon: bool = False
    pdl: bool = False


def _any_decode(q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int) -> bool:
    """The portable kernel takes any call."""
    return True


@functools.cache  # one spec per (config, rows) a process decodes with
def triton_decode_kernel(config: DecodeConfig, num_rows: int) -> DecodeKernel:
    """The portable Triton kernel (`decode_triton`), the decode table's last entry, run
    with `config` for num_rows query rows per request: as many rows per program as the
    rows need (at least 16, at most config.block_h), config's tile. Memory-bound: a
    last partial wave costs TAIL_WAVE, and a split past one wave nothing more, as its
    other programs keep the memory busy while one starts."""
    config = replace(config, block_h=min(config.block_h, max(16, next_pow2(num_rows))))
    return DecodeKernel(
        "decode_triton", _any_decode, functools.partial(decode_triton.decode_partial,
                                                        config=config),
        block_h=config.block_h, block_n=config.block_n, persistent=True, past_wave_tiles=0,
        tail_wave=TAIL_WAVE)


@functools.cache  # imported and built once per process
def _gluon_decode_kernels() -> tuple[DecodeKernel, ...]:
    """The Gluon entries of the decode table, in order (none where this Triton has no
    Gluon to import them with)."""
    try:
        from pagedmla.ops.triton import decode_hopper, decode_hopper_fp8, decode_hopper_heads
    except ImportError:
        return ()
    return (
        # An fp8 cache, up to 32 query rows per request (two head groups of 16 rows):
        # products on the e4m3 codes, two consumer warpgroups. Bound by its consumers'
        # chains of work per tile, not by memory: a split past one wave pays its start
        # (4 tiles), and a partial wave runs hardly faster than a full one (0.9). Both
        # tuned with `python -m benchmarks.bench_split_plan --cache fp8`.
        DecodeKernel("decode_hopper_fp8", decode_hopper_fp8.supported,
                     decode_hopper_fp8.decode_partial, block_h=decode_hopper_fp8.BLOCK_H,
                     block_n=decode_hopper_fp8.BLOCK_N, persistent=False, past_wave_tiles=4,
                     tail_wave=0.9, gluon=True, pdl=True),
        # A 16-bit cache, up to 16 query rows per request: memory-bound, and persistent
        # (its copy ring runs on from one split to the next). No cost per split past one
        # wave: there it chooses between whole requests and the persistent plan, and a
        # cost per split would only make whole requests dearer.
        DecodeKernel("decode_hopper", decode_hopper.supported, decode_hopper.decode_partial,
                     block_h=decode_hopper.BLOCK_H, block_n=decode_hopper.BLOCK_N,
                     persistent=True, past_wave_tiles=0, tail_wave=TAIL_WAVE, gluon=True,
                     pdl=True),
        # More than 16 query rows per request (17-32 with an fp8 cache whose pages the
        # copy engine cannot fill), 64 rows per program: bound by the tensor cores at
        # N = 128, so a partial wave runs hardly faster than a full one (0.9, tuned with
        # `python -m benchmarks.bench_split_plan --heads 128`).
        DecodeKernel("decode_hopper_heads", decode_hopper_heads.supported,
                     decode_hopper_heads.decode_partial, block_h=decode_hopper_heads.BLOCK_H,
                     block_n=decode_hopper_heads.BLOCK_N, persistent=False,
                     past_wave_tiles=0, tail_wave=0.9, gluon=True, pdl=True),
    )


def decode_kernels(
    platform: Platform, config: DecodeConfig, num_rows: int,
) -> tuple[DecodeKernel, ...]:
    """The decode table of `platform`, in the order it is tried; its last entry runs
    `config` for num_rows query rows per request."""
    gluon = _gluon_decode_kernels() if platform.runs_gluon else ()
    return (*gluon, triton_decode_kernel(config, num_rows))


def decode_kernel(
    q: torch.Tensor, data: torch.Tensor, num_rows: int, L: int,
    config: DecodeConfig | None = None, platform: Platform | None = None,
) -> DecodeKernel:
    """The first entry of the decode table that supports the call: q [T, N, L + R] and
    data [num_blocks, page, L + R] as stage 1 reads them (unit last stride), num_rows =
    N * max_query_len, L the latent width. config: what the portable kernel, the last
    entry, runs with (None: the regime's, `pick_config`). platform: the device's
    (`device_platform(q.device)`) unless given."""
    config = config or pick_config(num_rows, q.dtype, quantized(data))
    table = decode_kernels(platform or device_platform(q.device), config, num_rows)
    return next(entry for entry in table if entry.supports(q, data, num_rows, L))


@dataclass(frozen=True)
class PrefillKernel:
    """A kernel of variable-length prefill attention, as the dispatch sees it.

    name: "cudnn" or its module in this package. supports(q, k, v, num_seqs,
    max_seqlen_q, max_seqlen_k, softmax_scale, causal): whether it takes the call (q
    [Tq, N, Dqk], k [Tk, N, Dqk], v [Tk, N, Dv] as the kernel reads them). launch(q, k,
    v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
    out, lse): run it into out [Tq, N, Dv] and lse [N, Tq] (None for cuDNN, which
    returns its own: `prefill_cudnn.dense_attention`). gluon: a Gluon kernel (needs
    `Platform.runs_gluon`).
    """

    name: str
    supports: Callable[..., bool]
    launch: Callable[..., None] | None
    gluon: bool = False


def _any_prefill(*call: object) -> bool:
    """The portable kernel takes any call."""
    return True


# cuDNN's fused attention, for batches whose sequences all share one query and one key
# length (`prefill_cudnn`), on a CUDA device with PyTorch's cuDNN.
PREFILL_CUDNN = PrefillKernel("cudnn", prefill_cudnn.supports, None)


@functools.cache  # one spec per config a process runs with
def triton_prefill_kernel(config: PrefillConfig | None = None) -> PrefillKernel:
    """The portable Triton kernel (`prefill_triton`), the prefill table's last entry, run
    with `config` (None: `prefill_triton.pick_config`'s for the call)."""
    return PrefillKernel("prefill_triton", _any_prefill,
                         functools.partial(prefill_triton.varlen_attention_into,
                                           config=config))


@functools.cache  # imported and built once per process
def _gluon_prefill_kernels() -> tuple[PrefillKernel, ...]:
    """The Gluon entries of the prefill table (none where this Triton has no Gluon)."""
    try:
        from pagedmla.ops.triton import prefill_hopper
    except ImportError:
        return ()

    def hopper_supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int,
                        max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                        causal: bool) -> bool:
        return prefill_hopper.supported(q, k, v, softmax_scale)

    # 16-bit q, k and v whose rows the copy engine reads, head dims it covers.
    return (PrefillKernel("prefill_hopper", hopper_supports,
                          prefill_hopper.varlen_attention_into, gluon=True),)


@functools.cache  # one table per platform a process runs on
def prefill_kernels(platform: Platform) -> tuple[PrefillKernel, ...]:
    """The prefill table of `platform`, in the order it is tried."""
    cudnn = (PREFILL_CUDNN,) if platform.cudnn else ()
    gluon = _gluon_prefill_kernels() if platform.runs_gluon else ()
    return (*cudnn, *gluon, triton_prefill_kernel())


def prefill_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool, *, cudnn: bool = True,
    platform: Platform | None = None,
) -> PrefillKernel:
    """The first entry of the prefill table that supports the call: q [Tq, N, Dqk], k
    [Tk, N, Dqk], v [Tk, N, Dv] (unit last stride), B = num_seqs sequences of at most
    max_seqlen_q queries and max_seqlen_k keys; cudnn=False passes over cuDNN's entry
    (our kernels only). platform: the device's (`device_platform(q.device)`) unless
    given. (`prefill.prefill_attention` asks the table in two steps: cuDNN's entry
    about the tensors as the caller gave them, `cudnn_takes`, then the kernels' entries
    about the tensors as the kernels read them.)"""
    call = (q, k, v, num_seqs, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    return next(entry for entry in prefill_kernels(platform or device_platform(q.device))
                if (cudnn or entry is not PREFILL_CUDNN) and entry.supports(*call))


def cudnn_takes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_seqs: int, max_seqlen_q: int,
    max_seqlen_k: int, softmax_scale: float, causal: bool,
) -> bool:
    """Whether the prefill table's first entry, cuDNN, takes the call on q's device (as
    `prefill_kernel`)."""
    return device_platform(q.device).cudnn and PREFILL_CUDNN.supports(
        q, k, v, num_seqs, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
