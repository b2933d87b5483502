"""What the triton backend's tests (tests/test_triton_*.py) share: markers, tolerances,
the cases they build and the checks against the reference ops and the float64 oracle.

Where they run
* CUDA present: every test runs on the GPU (the small ones too); the `cuda`-marked
  ones add the issue's matrix at real sizes (bf16, fp8, 128 heads, 128k contexts).
* No CUDA: tests/conftest.py sets TRITON_INTERPRET=1 before Triton is imported, and
  the small tests run the same kernels on CPU tensors in Triton's interpreter (tiny
  shapes: the interpreter runs each program in numpy, one after another).

What the interpreter (Triton 3.9) cannot check, and why
* bfloat16: `tl.dot` on bfloat16 operands returns garbage, and float32 -> bfloat16
  conversions truncate instead of rounding to nearest even. Interpreter tests use
  float32 and float16; bf16 is checked by the cuda tests.
* fp32 -> fp8 e4m3 conversion rounds wrongly where the mantissa carries into the
  exponent (31.9 -> 16). The cache write kernel therefore rounds onto the e4m3 grid
  itself when interpreted (SOFTWARE_ROUND); on the GPU the hardware conversion is used,
  and test_write_cache_gpu_fp8_bits checks it bit for bit against torch.
* Races between warps of one program (the interpreter runs a program as one numpy
  step): the in-place merge's race between warps is covered by test_merge_gpu_bf16.
* The warp-specialized Gluon kernels for Hopper (decode_hopper, decode_hopper_heads,
  prefill_hopper): the interpreter does not run Gluon (TMA, mbarriers, wgmma, warp
  partitions). On the CPU only their dispatch rules are tested (which calls each takes,
  and that CPU tensors never reach them); the kernels run in the `hopper` tests.
* Performance, tensor-core (tf32/wgmma) numerics, pipelining (num_stages) and the
  real multiprocessor count: the split planner sees 4 "multiprocessors" there.

Both formulations of the decode products (direct, and SWAP_AB's transposed one) run
on tiny tiles (TINY_CONFIGS); the production configs run in
test_decode_default_config_and_planner and in every cuda test.

Tolerances
* float32 / float16 vs the reference op (same inputs, float32 math): the kernels add in
  another order and, in float16, round the softmax weights to float16 before the PV
  product: max abs error 2e-5 (float32) / 3e-3 (float16, outputs of magnitude ~1),
  lse within 1e-5 / 1e-4 (scores are accumulated in float32 in both dtypes).
* bfloat16 (GPU): softmax weights are rounded to bf16 (8-bit mantissa, unit roundoff
  4e-3) before the PV product: relative L2 error of the output < 1e-2, lse within 2e-3
  (an fp8 cache with a bf16 q computes in float16: the same bounds hold). merge in
  bf16 only rounds its result: relative error < 1e-3.
* Cache write and gather are data movement: bit-exact (fp8 included).
* MLAAttention(backend="triton") vs the float64 oracle: 2e-4 in float32, as the
  reference backend's tests (tests/test_attention_oracle.py).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.ops import reference as ref
from pagedmla.testing import PagedBatch, relative_error

pytest.importorskip("triton")

import triton

from pagedmla.ops.triton import mla_decode, varlen_attention
from pagedmla.ops.triton._utils import INTERPRETED, gluon_builds, multiprocessor_count
from pagedmla.ops.triton.decode_triton import DecodeConfig, pick_config
from pagedmla.ops.triton.selection import decode_kernel
from pagedmla.ops.triton.split_plan import SplitPlan

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
FP8 = torch.float8_e4m3fn

runnable = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported "
    "(tests/conftest.py sets it when CUDA is missing)",
)
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
hopper = pytest.mark.skipif(
    not HAS_CUDA or torch.cuda.get_device_capability()[0] != 9
    or not gluon_builds(triton.__version__),
    reason="the warp-specialized Gluon kernels (decode_hopper*, prefill_hopper) need a "
    "Hopper GPU and the Triton release they are written for (_utils.GLUON_TRITON)")

# Small tiles so that tiny interpreter shapes still cross many tiles, pages and splits.
TINY_DECODE = DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_chunk=16,
                           programs_per_sm=1)
# Both formulations of the stage-1 products (O = P V and O^T = V^T P^T), and both tile
# loaders: bulk page copies (page sizes that are multiples of 16) and the row gather.
TINY_CONFIGS = pytest.mark.parametrize(
    "config",
    [TINY_DECODE, replace(TINY_DECODE, swap_ab=True), replace(TINY_DECODE, paged=False)],
    ids=["qk", "swapped", "gathered"])
ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
LSE_ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 2e-3}
# lse of the fp8 16-row kernel, which multiplies e4m3 terms of q (within 2^-8 of each
# entry, about one more bf16 rounding of q): its scores, and so lse, are within ~2^-8 of
# their size, 2.5e-3 at most in these tests' scores of size ~1.
E4M3_PRODUCTS_LSE_ATOL = 6e-3


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _poison_allocator(device: str) -> None:
    """Leave NaN in freed memory so that an output row a kernel forgets shows as NaN."""
    for size in (1 << 10, 1 << 14, 1 << 18, 1 << 22, 1 << 24):
        torch.full((size,), math.nan, device=device)


def _cu(lens: list[int], device: str = DEVICE) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _paged_cache(
    seq_lens: list[int], block_size: int, width: int, cache_dtype: torch.dtype,
    gen: torch.Generator, scale: float = 1.0, device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled cache with block 0 reserved and each request's blocks drawn from a
    permutation of the rest; valid rows ~ N(0, 1) (stored / scale for fp8). Block-table
    entries past a request's blocks point far outside the cache."""
    used = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(used) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), max(used, default=0) + 1), 10**6, dtype=torch.int32)
    data = torch.full((num_blocks, block_size, width), math.nan)
    taken = 0
    for b, (n, s) in enumerate(zip(used, seq_lens)):
        table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.int32)
        taken += n
        pos = torch.arange(s)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        data.view(-1, width)[slots] = torch.randn(s, width, generator=gen)
    if cache_dtype == FP8:
        data = data / scale
    return data.to(cache_dtype).to(device), table.to(device)


def _decode_case(
    q_lens: list[int], seq_lens: list[int], num_heads: int, L: int, R: int, block_size: int,
    dtype: torch.dtype, cache_dtype: torch.dtype, seed: int, device: str = DEVICE,
) -> tuple:
    """mla_decode's arguments for requests of q_lens query tokens over seq_lens positions
    in a NaN-filled, permuted paged cache (`_paged_cache`; fp8 scaled by 0.37)."""
    gen = torch.Generator().manual_seed(seed)
    scale = 0.37 if cache_dtype == FP8 else 1.0
    data, table = _paged_cache(seq_lens, block_size, L + R, cache_dtype, gen, scale, device)
    q = torch.randn(sum(q_lens), num_heads, L + R, generator=gen).to(device, dtype)
    args = (
        q, data, torch.tensor(scale, device=device), table,
        torch.tensor(seq_lens, dtype=torch.int32, device=device), _cu(q_lens, device),
        max(q_lens), max(seq_lens), L, (L + R) ** -0.5,
    )
    return args


def _e4m3_products(args: tuple, config: DecodeConfig | None) -> bool:
    """Whether mla_decode(*args, config=config) runs the fp8 16-row kernel."""
    q, data = args[0], args[1]
    return (config is None
            and decode_kernel(q, data, q.shape[1] * args[6], args[8]).name == "decode_hopper_fp8")


def _check_decode(args: tuple, dtype: torch.dtype,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """mla_decode(*args, **kwargs) against the reference op; returns both outputs."""
    _poison_allocator(str(args[0].device))
    out, lse = mla_decode(*args, **kwargs)
    lse_atol = (E4M3_PRODUCTS_LSE_ATOL if _e4m3_products(args, kwargs.get("config"))
                else LSE_ATOL[dtype])
    # (The reference views the cache as rows: give it a contiguous copy.)
    want_out, want_lse = ref.mla_decode(args[0], args[1].contiguous(), *args[2:])
    assert out.shape == want_out.shape and out.dtype == want_out.dtype
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any()
    if dtype == torch.bfloat16:
        assert relative_error(out, want_out.double()) < 1e-2
    else:
        torch.testing.assert_close(out.float(), want_out.float(), atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=lse_atol, rtol=1e-5)
    return out, want_out


def _persistent_case(num_heads: int, q_len: int, L: int, block_size: int,
                     dtype: torch.dtype, extra: int, longest: int, seed: int) -> tuple:
    """A decode batch past one wave of stage-1 programs (slots + extra requests), so
    that stage 1 takes the persistent plan: ragged lengths from the seed (empty, one
    position, one tile and one past it, not page-aligned, up to `longest`), each
    request q_len tokens (one for an empty one), and two CUDA-graph padding rows (q_len
    0, seq_len 0) at the end."""
    batch = multiprocessor_count(torch.device(DEVICE)) + extra
    gen = torch.Generator().manual_seed(seed)
    pool = [q_len, 0, 1, 64, 65, 333, longest // 4, longest // 2, longest]
    lens = [pool[i] and max(pool[i], q_len)
            for i in torch.randint(0, len(pool), (batch - 2,), generator=gen).tolist()]
    lens[:4] = [q_len, 64, 65, longest]
    q_lens = [q_len if n else 1 for n in lens] + [0, 0]
    return _decode_case(q_lens, [*lens, 0, 0], num_heads, L, 64, block_size, dtype, dtype,
                        seed)


def _check_past_wave(block_size: int, config: DecodeConfig, seed: int,
                     check_plan: Callable[[SplitPlan], None]) -> None:
    """The decode of two batches past one wave by a third of a wave or more
    (`_persistent_case`, float32: q_len 1 at 4 heads, q_len 3 at 8 heads) against the
    reference, each batch's plan checked by check_plan."""
    extra = max(7, multiprocessor_count(torch.device(DEVICE)) // 3)
    for num_heads, q_len in ((4, 1), (8, 3)):
        args = _persistent_case(num_heads, q_len, 32, block_size, torch.float32, extra, 700,
                                seed=seed + block_size + q_len)
        plans: dict = {}
        _check_decode(args, torch.float32, config=config, plans=plans)
        (plan,) = plans.values()
        check_plan(plan)


def _assert_persistent_plan(plan: SplitPlan) -> None:
    """The plan is a persistent one: some program runs several splits."""
    assert any(b - a > 1 for a, b in itertools.pairwise(plan.starts.tolist()))


def _assert_even_plan(plan: SplitPlan) -> None:
    """The plan is the even one: rows out of their partials' order, longest first."""
    live = [row for row in plan.work.tolist() if row[0] >= 0]
    assert any(row[7] != i for i, row in enumerate(live))
    sizes = [row[2] - row[1] for row in live]
    assert sizes == sorted(sizes, reverse=True)


def _splits(work: list[list[int]]) -> list[int]:
    """The split count of each request (in request order) of a plan's used work rows."""
    return [count for _, count in sorted({row[0]: row[3] for row in work}.items())]


def _check_hopper_decode(args: tuple, num_rows: int, is_fp8: bool, num_splits: int | None,
                         kernel: str) -> None:
    """The Gluon kernel `kernel`, which the decode table must pick for the call, against
    the reference, and against the Triton kernel of the same config."""
    assert decode_kernel(args[0], args[1], num_rows, args[8]).name == kernel
    _check_decode(args, torch.bfloat16, num_splits=num_splits)
    config = pick_config(num_rows, args[0].dtype, is_fp8)
    ours = mla_decode(*args, num_splits=num_splits)
    theirs = mla_decode(*args, num_splits=num_splits, config=config)
    assert relative_error(ours[0], theirs[0].double()) < 1e-2
    lse_atol = E4M3_PRODUCTS_LSE_ATOL if _e4m3_products(args, None) else 2e-3
    torch.testing.assert_close(ours[1], theirs[1], atol=lse_atol, rtol=1e-5)


def _check_varlen(q_lens: list[int], k_lens: list[int], N: int, qk: int, dv: int,
                  dtype: torch.dtype, causal: bool, seed: int, device: str = DEVICE,
                  fn: Callable[..., tuple[torch.Tensor, torch.Tensor]] = varlen_attention,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """fn on random q, k, v of these lengths against the reference op; returns both
    outputs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), N, qk, generator=gen).to(device, dtype)
    # k and v as strided views of one buffer, as the up-projection produces them.
    kv = torch.randn(sum(k_lens), N, qk + dv, generator=gen).to(device, dtype)
    k, v = kv[..., :qk], kv[..., qk:]
    args = (q, k, v, _cu(q_lens, device), _cu(k_lens, device), max(q_lens), max(k_lens),
            qk**-0.5, causal)
    _poison_allocator(device)
    out, lse = fn(*args)
    want, want_lse = ref.varlen_attention(*args)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    if dtype == torch.bfloat16:
        assert relative_error(out, want.double()) < 1e-2
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=0)
    finite = want_lse.isfinite()
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=LSE_ATOL[dtype], rtol=1e-5)
    return out, want


SMALL = MLADims(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=24)


def _run_layer(batch: PagedBatch, backend: str, decode_threshold: int,
               workspace_rows: int | None) -> torch.Tensor:
    meta = MLAMetadataBuilder(batch.dims, block_size=batch.block_size, device=DEVICE,
                              workspace_rows=workspace_rows,
                              decode_threshold=decode_threshold).build(batch.spec)
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend=backend)
    return attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
