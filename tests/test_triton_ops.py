"""The triton backend's kernels against the reference ops and the float64 oracle.

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
  step): the in-place merge race found on an H200 is covered by test_merge_gpu_bf16.
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

import math
import time
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.ops import reference as ref
from pagedmla.testing import make_paged_batch, relative_error

pytest.importorskip("triton")

import importlib
import itertools

import triton

from pagedmla.ops.triton import (
    _utils,
    gather_cache,
    merge_attn_states,
    mla_decode,
    prefill_attention,
    varlen_attention,
    write_cache,
)
from pagedmla.ops.triton import decode as decode_module
from pagedmla.ops.triton import split_plan as split_plan_module
from pagedmla.ops.triton._utils import (
    GRID_YZ_MAX,
    INTERPRETED,
    cdiv,
    gluon_builds,
    gluon_modules,
    multiprocessor_count,
)
from pagedmla.ops.triton.decode import (
    DECODE_CONFIGS,
    FEW_REQUESTS,
    DecodeConfig,
    _page_descriptors,
    hopper_kernel,
    pick_config,
)
from pagedmla.ops.triton.split_plan import (
    EXTRA_WAVES,
    LONE_WAVE,
    MAX_SPLITS,
    OVERHEAD_TILES,
    PARTIAL_ROWS_PER_ROW,
    STREAM_TILES,
    WHOLE_WAVES,
    SplitPlan,
    plan_bounds,
    plan_splits,
)

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
# their size, 2.5e-3 at most in these tests' scores of size ~1 (session 17's kernel on
# an H200; session 18's adds the terms' products in one accumulator, with less error).
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
):
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


def _e4m3_products(args, config: DecodeConfig | None) -> bool:
    """Whether mla_decode(*args, config=config) runs the fp8 16-row kernel."""
    q, data = args[0], args[1]
    kernel = (hopper_kernel(q, data, q.shape[1] * args[6], args[8])
              if config is None or config.hopper else None)
    return kernel is not None and kernel.__name__.endswith(".decode_hopper_fp8")


def _check_decode(args, dtype: torch.dtype, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
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


# --- decode ------------------------------------------------------------------------------


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@TINY_CONFIGS
def test_decode_single_token(block_size: int, dtype: torch.dtype, config: DecodeConfig) -> None:
    # seq_len 1 (no context), lengths not page-aligned, a long one crossing many tiles.
    args = _decode_case([1] * 5, [1, 2, block_size + 1, 37, 150], 5, 64, 16, block_size,
                        dtype, dtype, seed=10 + block_size)
    _check_decode(args, dtype, config=config, num_splits=3)


@runnable
@pytest.mark.parametrize("max_q", [2, 3, 4])
@TINY_CONFIGS
def test_decode_multi_token_bottom_right_causal(max_q: int, config: DecodeConfig) -> None:
    # q_len 1..max_q per request (varlen), q_len == seq_len included; 5 heads x max_q
    # rows share one program, so rows of different tokens see different prefixes.
    q_lens = [1, max_q, max(1, max_q - 1), max_q]
    seq_lens = [9, max_q, 41, 100]
    args = _decode_case(q_lens, seq_lens, 5, 32, 16, 16, torch.float32, torch.float32,
                        seed=20 + max_q)
    _check_decode(args, torch.float32, config=config, num_splits=4)


@runnable
@pytest.mark.parametrize("num_splits", [1, 2, 7, None])
@TINY_CONFIGS
def test_decode_split_counts_agree(num_splits: int | None, config: DecodeConfig) -> None:
    # 1: stage 1 writes the output directly; 7: most splits of short requests are empty
    # (lse -inf, never read); None: the planner's choice.
    args = _decode_case([1, 2, 1], [3, 90, 200], 4, 64, 16, 16, torch.float32,
                        torch.float32, seed=30)
    _check_decode(args, torch.float32, config=config, num_splits=num_splits)


@runnable
def test_decode_many_pieces_merge_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    # 100 pieces of one request (forced) and the combine's tile cut to 256 elements, so
    # that its two passes run over chunks of 16 pieces. A short request beside it stays
    # whole.
    monkeypatch.setattr(decode_module, "COMBINE_ELEMENTS", 256)
    assert decode_module.combine_blocks(16, 2, 100, 100, 64, 4)[1] == 16
    args = _decode_case([1, 1], [1600, 40], 16, 64, 16, 16, torch.float32, torch.float32,
                        seed=33)
    _check_decode(args, torch.float32, config=TINY_DECODE, num_splits=100)


@runnable
def test_decode_combine_grid_smaller_than_its_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The combine's grid covering one entry at a time, so that its programs merge the
    # same row of every cut request in turn (`combine_entries`; three cut here) and
    # stop at the plan's first idle cut row. Requests of 1-3 tokens, cut in 1-3 pieces.
    monkeypatch.setattr(decode_module, "combine_entries", lambda *_: 1)
    args = _decode_case([1, 3, 2, 1, 2], [150, 190, 40, 2, 120], 4, 64, 16, 16,
                        torch.float32, torch.float32, seed=36)
    _check_decode(args, torch.float32, config=TINY_DECODE, num_splits=3)


def test_combine_entries_cap_the_grid_not_the_work() -> None:
    # 32 programs per SM on 132 SMs: entries of 128 rows (N = 128), 100 of them a bound
    # past one wave, 33 at once; 131 entries of 16 rows (N = 16) fit whole; at least
    # one entry always.
    assert decode_module.COMBINE_PROGRAMS_PER_SM == 32
    assert decode_module.combine_entries(128, 100, 132) == 33
    assert decode_module.combine_entries(16, 131, 132) == 131
    assert decode_module.combine_entries(16384, 3, 132) == 1


@pytest.mark.parametrize("scale", [0.0, -0.125, math.nan, math.inf])
def test_decode_rejects_a_softmax_scale_that_is_not_finite_and_positive(scale: float) -> None:
    # The 64-row kernel scales each row's maximum rather than every score, which holds
    # only for a positive scale: the op refuses the others before any kernel runs.
    args = _decode_case([1], [5], 4, 64, 16, 16, torch.float32, torch.float32, seed=34)
    with pytest.raises(ValueError, match="softmax_scale"):
        mla_decode(*args[:-1], scale)


def test_decode_rejects_a_cache_without_positions() -> None:
    args = list(_decode_case([1], [5], 4, 64, 16, 16, torch.float32, torch.float32, seed=37))
    args[1] = args[1][:0]
    with pytest.raises(ValueError, match=r"data: a cache of shape \(0, 16, 80\)"):
        mla_decode(*args)


def test_decode_refuses_more_pieces_than_a_grid_axis_holds(monkeypatch) -> None:
    # Stage 1's pieces are its grid's second axis (65535 programs at most on a GPU): a
    # batch whose plan needs more gets a ValueError naming the batch, not a failed
    # launch. The limit is lowered here so that four requests exceed it.
    args = _decode_case([1] * 4, [5] * 4, 4, 64, 16, 16, torch.float32, torch.float32,
                        seed=35)
    monkeypatch.setattr(decode_module, "GRID_YZ_MAX", 3)
    with pytest.raises(ValueError, match="seq_lens: a batch of 4 requests"):
        mla_decode(*args)


def test_packed_blocks_bound_every_cut_of_the_tokens() -> None:
    # The prefill grid (`packed_blocks`) must hold every sequence's query blocks for any
    # cut of T tokens into B sequences of at most max_q; and it is exact where it can be.
    from pagedmla.ops.triton.prefill import packed_blocks

    gen = torch.Generator().manual_seed(37)
    for _ in range(2000):
        B = int(torch.randint(1, 12, (1,), generator=gen))
        lens = torch.randint(0, 300, (B,), generator=gen).tolist()
        T = sum(lens) + int(torch.randint(0, 3, (1,), generator=gen))  # rows past them
        need = sum(cdiv(n, 64) for n in lens)
        assert need <= packed_blocks(T, B, max(lens), 64)
    assert packed_blocks(300, 1, 300, 128) == 3
    assert packed_blocks(256, 2, 128, 128) == 2  # two full blocks, no partial one
    assert packed_blocks(4, 4, 1, 128) == 4


@runnable
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_more_sequences_than_one_lookup_chunk(causal: bool) -> None:
    # 150 sequences, more than the SEQ_CHUNK (128) a program's lookup of its (sequence,
    # block) reads at once, with lengths 0 among them: every packed block finds its own.
    from pagedmla.ops.triton.prefill import SEQ_CHUNK

    gen = torch.Generator().manual_seed(38)
    q_lens = torch.randint(0, 40, (150,), generator=gen).tolist()
    q_lens[0] = q_lens[129] = 0
    k_lens = q_lens if causal else torch.randint(0, 40, (150,), generator=gen).tolist()
    assert len(q_lens) > SEQ_CHUNK.value
    _check_varlen(q_lens, k_lens, 2, 16, 16, torch.float32, causal, seed=39)


def test_combine_blocks_fit_the_real_piece_count() -> None:
    # B = 1 at N = 128 on 132 SMs: the plan allows 66 pieces (two head groups) and cuts a
    # 64k request into 64, so one load should hold 64 pieces, not 128 (half masked).
    assert decode_module.combine_blocks(128, 1, 66, 66, 512, 132) == (64, 64)
    # 100 pieces are nearer 128 than 64: one load of 128 pieces, 32 columns wide.
    assert decode_module.combine_blocks(128, 1, 100, 100, 512, 132) == (32, 128)
    for pieces in range(1, 129):
        block_c, block_s = decode_module.combine_blocks(16, 4, pieces, 128, 512, 132)
        assert block_c * block_s <= decode_module.COMBINE_ELEMENTS
        assert 2 * block_s >= pieces  # at most two rounds of the combine's loop


@runnable
def test_decode_default_config_and_planner() -> None:
    # The production configs (not TINY_DECODE) on a small case: 17 heads, not a power of 2.
    args = _decode_case([1, 1, 2], [5, 300, 77], 17, 64, 16, 16, torch.float16,
                        torch.float16, seed=35)
    _check_decode(args, torch.float16)


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@TINY_CONFIGS
def test_decode_fp8_cache(dtype: torch.dtype, config: DecodeConfig) -> None:
    # The per-tensor scale (0.37) is applied in the kernel, to scores and outputs.
    args = _decode_case([1, 3, 1], [1, 50, 130], 4, 64, 16, 16, dtype, FP8, seed=40)
    _check_decode(args, dtype, config=config, num_splits=3)


@runnable
@TINY_CONFIGS
def test_decode_nope_and_odd_widths(config: DecodeConfig) -> None:
    # R = 0 (NoPE), L = 48 (not a power of two); then R = 8 (padded to 16 with masks).
    args = _decode_case([1, 2], [20, 33], 3, 48, 0, 16, torch.float32, torch.float32, seed=50)
    _check_decode(args, torch.float32, config=config, num_splits=2)
    args = _decode_case([1, 2], [20, 33], 3, 40, 8, 1, torch.float32, torch.float32, seed=51)
    _check_decode(args, torch.float32, config=config, num_splits=2)


@runnable
@pytest.mark.parametrize("layout", ["padded-rows", "every-other-block"])
def test_decode_strided_cache_layouts(layout: str) -> None:
    # The cache as a view: rows padded to a wider buffer (pages still contiguous: bulk
    # copies with a row stride) or every other block of a bigger one (pages not adjacent
    # in rows: the descriptors are refused and the row gather runs). Same answers.
    args = list(_decode_case([1, 2], [40, 75], 4, 32, 16, 16, torch.float32, torch.float32,
                             seed=65))
    data = args[1]
    if layout == "padded-rows":
        wide = torch.full((*data.shape[:2], data.shape[2] + 16), math.nan, device=data.device)
        wide[..., :data.shape[2]] = data
        args[1] = wide[..., :data.shape[2]]
    else:
        spread = torch.full((2 * data.shape[0], *data.shape[1:]), math.nan, device=data.device)
        spread[::2] = data
        args[1] = spread[::2]
    assert (_page_descriptors(args[1], 16, 16, 16, 32) is None) == (
        layout == "every-other-block")
    _check_decode(tuple(args), torch.float32, config=TINY_DECODE, num_splits=2)


@runnable
@TINY_CONFIGS
def test_decode_padded_request_is_harmless(config: DecodeConfig) -> None:
    # A CUDA-graph padding request (q_len 0, seq_len 0) between real ones.
    args = list(_decode_case([1, 1], [30, 12], 4, 32, 16, 16, torch.float32, torch.float32,
                             seed=60))
    q, table = args[0], args[3]
    table = torch.cat([table[:1], torch.full_like(table[:1], 10**6), table[1:]])
    seq_lens = torch.tensor([30, 0, 12], dtype=torch.int32, device=q.device)
    qsl = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=q.device)
    args[3:6] = table, seq_lens, qsl
    _check_decode(tuple(args), torch.float32, config=config, num_splits=3)


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


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@TINY_CONFIGS
def test_decode_persistent_plan(block_size: int, config: DecodeConfig) -> None:
    # A batch past one wave (on the interpreter: 4 programs) by a third of a wave or
    # more: the persistent plan runs several pieces per program, short requests packed
    # into one program, long ones cut across programs and merged by the combine; q_len
    # 1 and 3 (3 x 8 heads: two head groups of 16 rows), seq_len 0 requests among them.
    _check_past_wave(block_size, config, 90, _assert_persistent_plan)


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
    """The plan is a persistent one: some program runs several pieces."""
    assert any(b - a > 1 for a, b in itertools.pairwise(plan.starts.tolist()))


def _assert_even_plan(plan: SplitPlan) -> None:
    """The plan is the even one: rows out of their partials' order, longest first."""
    live = [row for row in plan.work.tolist() if row[0] >= 0]
    assert any(row[7] != i for i, row in enumerate(live))
    sizes = [row[2] - row[1] for row in live]
    assert sizes == sorted(sizes, reverse=True)


@runnable
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_even_plan(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The even plan (the persistent plan's pieces, a program each, rows longest first,
    # partials at their own indices) on the Triton kernel, which runs any plan's rows: a
    # batch past one wave, the plan made as for a kernel of one piece per program, with
    # the even plan priced cheapest. q_len 1 and 3 (two head groups of 16 rows), empty
    # requests and graph padding rows among them.
    monkeypatch.setattr(split_plan_module, "STREAM_TILES", -10**6)
    one_per_program = decode_module.plan_splits

    def plan(*args):  # (persistent is plan_splits' tenth argument)
        return one_per_program(*args[:9], False, *args[10:])

    monkeypatch.setattr(decode_module, "plan_splits", plan)
    _check_past_wave(block_size, TINY_DECODE, 60, _assert_even_plan)


@runnable
def test_decode_few_requests_take_shorter_pieces() -> None:
    # A config's few_min_chunk replaces its min_chunk for batches of at most
    # FEW_REQUESTS requests (one or two requests in 256-position pieces left SMs idle),
    # and larger batches keep min_chunk: the plan kept in `plans` records which one it
    # was made with (its key's seventh field). The outputs match the reference.
    cfg = replace(TINY_DECODE, min_chunk=64, few_min_chunk=16)
    for lens, want in (([200], 16), ([200, 90], 16), ([200, 90, 5], 64)):
        assert (len(lens) <= FEW_REQUESTS) == (want == 16)
        args = _decode_case([1] * len(lens), lens, 4, 32, 16, 16, torch.float32,
                            torch.float32, seed=70 + len(lens))
        plans: dict = {}
        _check_decode(args, torch.float32, config=cfg, plans=plans)
        (key,) = plans
        assert key[6] == want


def _plan(lens: list[int], head_groups: int, slots: int, cfg: DecodeConfig,
          forced: int | None = None, persistent: bool = False, past_overhead: int = 0,
          lone_wave: float = LONE_WAVE) -> tuple[SplitPlan, list[list[int]]]:
    """A plan for lengths `lens` (one query token each), checked for what every plan must
    be: each request's positions [0, len) covered by its pieces in the order of their
    partial indices, which are consecutive, each piece of whole tiles but the last, at
    most max_pieces pieces, each row with its request's seq_len, first token and q_len;
    every request once; the partial indices of the used rows a permutation of them, and
    the rows in their order (or, in the even plan, longest first); the other rows idle;
    the cut requests listed in the order of their partials, with their first; program
    p's pieces the rows starts[p] .. starts[p + 1] - 1 (row p alone but in a persistent
    plan). Returns the plan and its used rows."""
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    plan = plan_splits(seq_lens, _cu([1] * len(lens)), head_groups, max(lens), slots,
                       cfg.block_n, cfg.min_chunk, cfg.block_h, forced, persistent,
                       past_overhead, lone_wave)
    work = plan.work.tolist()
    starts = plan.starts.tolist()
    assert len(starts) == plan.programs + 1 and starts[0] == 0
    assert all(a <= b for a, b in itertools.pairwise(starts))
    taken = sum(1 for row in work if row[0] >= 0)
    assert all(row[0] >= 0 for row in work[:taken])
    assert all(r == [-1] + [0] * 7 for r in work[taken:])
    assert sorted(row[7] for row in work[:taken]) == list(range(taken))
    by_partial = sorted(work[:taken], key=lambda row: row[7])
    if [row[7] for row in work[:taken]] != list(range(taken)):  # the even plan
        assert plan.rows == plan.programs
        _assert_even_plan(plan)
    at, cut, seen = 0, [], []
    while at < taken:
        b, count = by_partial[at][0], by_partial[at][3]
        n = lens[b]
        assert 1 <= count <= plan.max_pieces
        rows = by_partial[at:at + count]
        assert all(r[0] == b and r[3] == count and r[4:7] == [n, b, 1] for r in rows)
        assert rows[0][1] == 0 and rows[-1][2] == n
        for row, after in itertools.pairwise(rows):
            assert row[2] == after[1] and row[1] < row[2] and (row[2] - row[1]) % cfg.block_n == 0
        if count > 1:
            cut.append([b, at, 0, count, n, b, 1, 0])
        seen.append(b)
        at += count
    assert sorted(seen) == list(range(len(lens)))
    assert starts[-1] == taken
    if plan.rows == plan.programs:
        assert starts == [min(p, taken) for p in range(plan.programs + 1)]
    assert plan.cut.tolist() == cut + [[-1] + [0] * 7] * (plan.cut.shape[0] - len(cut))
    return plan, work[:taken]


def _pieces(work: list[list[int]]) -> list[int]:
    """The piece count of each request (in request order) of a plan's used work rows."""
    return [count for _, count in sorted({row[0]: row[3] for row in work}.items())]


def _tiles(piece: list[int], block_n: int) -> int:
    return -(-(piece[2] - piece[1]) // block_n)


@runnable
def test_split_plan_uniform_batches() -> None:
    # H200: 132 multiprocessors. Uniform batches cut as a host planner would.
    cfg16, cfg64 = DECODE_CONFIGS["rows16"], replace(DECODE_CONFIGS["rows64"], block_h=64)
    # B = 1, N = 128 (two head groups of 64), 64k: 64 pieces of 1024 positions, one wave.
    plan, work = _plan([65536], 2, 132, cfg64)
    assert len(work) == 64 and plan.programs == 66
    # B = 1, N = 16, 128k: a piece per multiprocessor, at most MAX_SPLITS.
    plan, work = _plan([131072], 1, 132, cfg16)
    assert 0.9 * 132 <= len(work) <= MAX_SPLITS
    # B = 64 x 2k: two pieces each (128 programs of 16 tiles).
    plan, work = _plan([2048] * 64, 1, 132, cfg16)
    assert len(work) == 128 and max(_tiles(w, 64) for w in work) == 16
    # A wave of requests: none is cut, and the combine has nothing to do.
    plan, work = _plan([8192] * 128, 1, 132, cfg16)
    assert len(work) == 128
    # Its last wave is nearly full (124 of 132), so it stays whole and its grid leaves one
    # wave of room for cut pieces, not EXTRA_WAVES.
    plan, work = _plan([4096] * 256, 1, 132, cfg16)
    assert len(work) == 256 and plan.programs == 256 + 132
    # Just past a wave, a second wave of whole requests would run 8 of them alone for
    # as long as the first. Priced for the fp8 16-row kernel (one piece per program,
    # bound by its chains: each piece pays its start, and a partial wave runs hardly
    # faster than a full one), the batch takes the even plan: runs of 68 tiles, each a
    # whole request and 4 tiles of the next, their pieces a program each, longest first
    # (140 x 4k on an H200: 148.8 us whole, 122.0 in three waves of 2 or 3 pieces per
    # request, 106.6 so; session 41).
    from pagedmla.ops.triton import decode_hopper_fp8

    fp8 = {"past_overhead": decode_hopper_fp8.PAST_WAVE_TILES,
           "lone_wave": decode_hopper_fp8.LONE_WAVE}
    plan, work = _plan([4096] * 140, 1, 132, cfg16, **fp8)
    assert plan.programs == 140 + EXTRA_WAVES * 132
    assert len(work) == 263 and [_tiles(w, 64) for w in work[:9]] == [64] * 9
    assert any(w[7] != i for i, w in enumerate(work))  # rows out of their partials' order
    # Short requests too: 133 x 1088 in runs of 18 tiles (48.3 us; 54.8 in two waves of
    # 1 or 2 pieces per request). At 170 x 1088 (runs of 22 tiles, 294 pieces) the
    # busiest slot would run three programs: two waves of 1 or 2 pieces per request
    # (56.0 us; 58.5 the even plan).
    plan, work = _plan([1088] * 133, 1, 132, cfg16, **fp8)
    assert len(work) == 251 and max(_tiles(w, 64) for w in work) == 17
    plan, work = _plan([1088] * 170, 1, 132, cfg16, **fp8)
    assert sorted(set(_pieces(work))) == [1, 2] and len(work) == 2 * 132
    assert all(w[7] == i for i, w in enumerate(work))
    # A uniform batch that nearly fills its second wave stays whole (256 x 4k: 163.6 us;
    # the even plan 173.3).
    plan, work = _plan([4096] * 256, 1, 132, cfg16, **fp8)
    assert len(work) == 256
    # A last wave of whole requests filled to 0.67 (220 requests) leaves EXTRA_WAVES of
    # room for finer pieces where a partial wave is priced above that (fp8: 0.9), one
    # wave where it is priced below (a memory-bound kernel's 0.6).
    assert plan_bounds(220, 1, 4096, 132, 64, cfg16.min_chunk)[0] == 220 + 132
    assert (plan_bounds(220, 1, 4096, 132, 64, cfg16.min_chunk, lone_wave=0.9)[0]
            == 220 + EXTRA_WAVES * 132)
    # Pieces never go below min_chunk positions: short requests stay whole.
    plan, work = _plan([100, 0, 255], 1, 132, cfg16)
    assert len(work) == 3 and plan.max_pieces == 1


def _random_lens(gen: torch.Generator, fewest: int) -> list[int]:
    """A random batch of fewest..300 requests, lengths 0-200k from a heavy-tailed mix
    (uniform below a random power of ten per request), the first at least 1."""
    batch = int(torch.randint(fewest, 301, (), generator=gen))
    scale = 10 ** torch.randint(1, 6, (batch,), generator=gen).float()
    lens = (torch.rand(batch, generator=gen) * scale).long().clamp(max=200_000).tolist()
    lens[0] = max(lens[0], 1)
    return lens


@runnable
def test_split_plan_on_random_batches() -> None:
    # Fresh random batches (sizes 1-300, lengths 0-200k from a heavy-tailed mix, 1-4 head
    # groups, 4 or 132 multiprocessors): every plan covers every request exactly
    # (`_plan` checks) within its grid. The seed is printed for a failing run.
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    cfg16 = DECODE_CONFIGS["rows16"]
    for _ in range(12):
        lens = _random_lens(gen, 1)
        groups = int(torch.randint(1, 5, (), generator=gen))
        slots = 4 if torch.rand((), generator=gen) < 0.3 else 132
        _plan(lens, groups, slots, cfg16)


def _rule_choice(lens: list[int], head_groups: int, slots: int, cfg: DecodeConfig,
                 programs: int, max_pieces: int, past_overhead: int = 0,
                 lone_wave: float = LONE_WAVE, one_per_program: bool = False,
                 ) -> tuple[float, list[int], bool] | None:
    """The plan by the rule `split_plan`'s docstring states, worked out here in float64
    within the plan's bounds (programs, max_pieces): (the cheapest candidate's cost,
    each request's piece count, whether it is the even plan); None where two candidates
    sit at a margin, which float32 may round either way. past_overhead and lone_wave: the
    stage-1 kernel's cost of a piece past one wave and of a last partial wave there
    (`plan_splits`); one_per_program: the kernel runs a piece per program, so that the
    even plan is a candidate past one wave."""
    tiles = [-(-n // cfg.block_n) for n in lens]
    t_max, empty = max(tiles), tiles.count(0)
    live = len(tiles) - empty
    past_wave = live * head_groups > slots
    min_tiles = max(1, cfg.min_chunk // cfg.block_n)
    partial = -(-PARTIAL_ROWS_PER_ROW * cfg.block_h // cfg.block_n)

    def waves(count: int) -> float:
        full, rest = divmod(count * head_groups, slots)
        return full + ((max(lone_wave, rest / slots) if past_wave else 1) if rest else 0)

    def evened(t: int, n: int) -> int:  # pieces of equal whole-tile size
        return -(-t // -(-t // n)) if t else 1

    candidates = []  # (cost, pieces, is uniform, layout)
    for s in range(1, max_pieces + 1):
        size = max(-(-t_max // s), min_tiles)
        layout = [evened(t, -(-t // size)) for t in tiles]
        count = sum(layout) - empty
        if count + empty <= programs:
            overhead = ((past_overhead if past_wave else OVERHEAD_TILES)
                        + (partial if count > live else 0))
            candidates.append((waves(count) * (size + overhead), count, 0, layout))
    total, goal = sum(tiles), -(-slots // head_groups)
    for k in range(1, WHOLE_WAVES + 1) if past_wave else ():
        share = [0, *itertools.accumulate(tiles)]
        layout = [evened(t, max(1, min(
            math.floor(share[b + 1] * k * goal / total + 0.5)
            - math.floor(share[b] * k * goal / total + 0.5), max_pieces, t // min_tiles)))
            for b, t in enumerate(tiles)]
        count = sum(layout) - empty
        if count + empty <= programs:
            mean = total / count
            largest = max(-(-t // n) for t, n in zip(tiles, layout) if t)
            per_piece = past_overhead + (partial if count > live else 0)
            cost = waves(count) * (mean + per_piece) + largest - mean
            candidates.append((cost, count, 1, layout))
    best = min(c[0] for c in candidates)
    if any(abs(c[0] * 0.97 - best) < 1e-5 * best for c in candidates):
        return None
    if one_per_program and past_wave:
        # The even plan: the persistent plan's runs for one wave of programs, their pieces
        # a program each; the busiest slot runs ceil(pieces x head_groups / slots).
        runs = _stream_runs(lens, goal, cfg.block_n)
        layout = [0] * len(lens)
        for run in runs:
            for b, *_ in run:
                layout[b] += 1
        count = sum(n for n, t in zip(layout, tiles) if t)
        share = -(-sum(max(t, 1) for t in tiles) // goal)
        cost = share + STREAM_TILES + -(-count * head_groups // slots) * (past_overhead + partial)
        if max(layout) <= max_pieces and sum(layout) <= programs:
            if abs(cost - best) < 1e-5 * best:
                return None
            if cost < best:
                return cost, layout, True
    return (best, min((c for c in candidates if c[0] * 0.97 <= best), key=lambda c: c[1:3])[3],
            False)


def _rule_order(lens: list[int], pieces: list[int], cfg: DecodeConfig) -> list[int] | None:
    """The order of the requests' programs by `split_plan`'s docstring: those whose
    pieces are at least the mean piece first, then the others, each in request order;
    None where a piece is within float32's reach of the mean."""
    tiles = [-(-n // cfg.block_n) for n in lens]
    steps = [-(-t // n) if t else 0 for t, n in zip(tiles, pieces)]
    mean = sum(tiles) / max(1, sum(n for t, n in zip(tiles, pieces) if t))
    if any(abs(step - mean) < 1e-3 for step in steps):
        return None
    big = [b for b, step in enumerate(steps) if step >= mean]
    return big + [b for b, step in enumerate(steps) if step < mean]


@runnable
@pytest.mark.parametrize("kernel", ["decode_hopper", "decode_hopper_fp8", "decode_hopper_heads"])
def test_split_plan_prices_waves_as_documented(kernel: str) -> None:
    # The plan kernel's choices (each request's pieces, the requests' order) against the
    # rule worked out in Python: batches around one and two waves of 132 (uniform, and
    # with graph padding rows), then fresh random ones (1-300 requests, 0-200k
    # positions, 1-2 head groups); under each stage-1 kernel's prices past a wave (a
    # piece's start, a last partial wave). The seed is printed.
    module = importlib.import_module(f"pagedmla.ops.triton.{kernel}")
    prices = (module.PAST_WAVE_TILES, module.LONE_WAVE)
    cfg16 = DECODE_CONFIGS["rows16"]
    cases = [([n] * b, 1) for n in (1088, 4096) for b in (100, 132, 133, 200, 256, 300)]
    cases += [([1088] * 132 + [0] * 12, 1), ([4096] * 70, 2), ([131072] + [4096] * 199, 1)]
    cases += [([4096] * 140, 1), ([1088] * 132 + [0] * 12 + [4096] * 8, 1), ([2048] * 150, 2)]
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(8):
        cases.append((_random_lens(gen, 1), int(torch.randint(1, 3, (), generator=gen))))
    checked = 0
    kinds = set()
    for lens, groups in cases:
        plan, work = _plan(lens, groups, 132, cfg16, None, False, *prices)
        choice = _rule_choice(lens, groups, 132, cfg16, plan.programs, plan.max_pieces,
                              *prices, one_per_program=True)
        if choice is not None and choice[2]:  # the even plan: its pieces, longest first
            kinds.add("even")
            want = [piece for run in _stream_runs(lens, -(-132 // groups), cfg16.block_n)
                    for piece in run]
            assert sorted(row[:3] for row in work) == sorted(want), (len(lens), groups)
            checked += 1
        elif choice is not None:
            kinds.add("scored")
            want = choice[1]
            assert _pieces(work) == want, (len(lens), groups, max(lens))
            order = _rule_order(lens, want, cfg16)
            firsts = [row[0] for i, row in enumerate(work) if i == 0 or work[i - 1][0] != row[0]]
            assert order is None or firsts == order, (len(lens), groups, max(lens))
            checked += 1
    assert checked >= len(cases) - 2 and kinds == {"even", "scored"}


@runnable
def test_split_plan_follows_the_lengths() -> None:
    # One long request among short ones: it is cut finely enough that no program holds
    # much more than a fair share of the batch's tiles (a plan from max_seq_len alone,
    # the same pieces per request, gave the long request's 2 programs 1024 tiles each).
    cfg16 = DECODE_CONFIGS["rows16"]
    lens = [131072] + [2048] * 63
    _, work = _plan(lens, 1, 132, cfg16)
    fair = sum(-(-n // 64) for n in lens) / 132
    assert len(work) <= 132 and max(_tiles(w, 64) for w in work) <= 1.2 * fair
    # A batch past one wave: the long request is cut, the short ones are not.
    lens = [131072] + [4096] * 199
    _, work = _plan(lens, 1, 132, cfg16)
    counts = _pieces(work)
    assert counts[0] > 1 and set(counts[1:]) == {1}
    assert max(_tiles(w, 64) for w in work) <= 64
    # Graph padding rows (seq_len 0) get one empty piece; a forced count is honoured.
    _, work = _plan([0, 700, 0], 1, 4, TINY_DECODE, forced=7)
    assert _pieces(work) == [1, 7, 1]
    # Their programs exit at once, so they count in no wave: a wave of requests stays
    # one wave, uncut, when a graph pads it past the multiprocessors (they used to push
    # the plan to two pieces per request).
    for padding in (0, 12, 68):
        plan, work = _plan([1100] * 132 + [0] * padding, 1, 132, cfg16)
        assert _pieces(work) == [1] * (132 + padding) and plan.cut[0, 0] == -1


def _stream_runs(lens: list[int], programs: int, block_n: int) -> list[list[list[int]]]:
    """Each program's pieces [request, lo, hi] by the persistent rule `split_plan`'s
    docstring states, worked out here by walking the tiles: the batch's tiles in request
    order, an empty request weighing one tile, runs of ceil(total / programs) tiles."""
    weights = [max(1, -(-n // block_n)) for n in lens]
    share = -(-sum(weights) // programs)
    runs: list[list[list[int]]] = [[] for _ in range(programs)]
    at = 0  # the stream's tile where the request begins
    for b, (n, w) in enumerate(zip(lens, weights)):
        t = 0
        while t < w:
            p = (at + t) // share
            take = min(w - t, (p + 1) * share - at - t)
            runs[p].append([b, min(t * block_n, n), min((t + take) * block_n, n)])
            t += take
        at += w
    return runs


@runnable
def test_split_plan_persistent_runs() -> None:
    # A kernel that runs several pieces per program gets a grid of a program per
    # request for a batch past one wave, and the plan takes, by the rule worked out in
    # Python, either the scored plan (whole requests, one per program) or the
    # persistent one: one wave of programs that each take an even run of the batch's
    # tiles, checked program by program. Uniform batches around one and two waves,
    # graph padding, one long request among short ones, short requests packed several
    # to a program, then fresh random batches of 133-300 requests.
    cfg16 = DECODE_CONFIGS["rows16"]
    cases = [[4096] * 140, [1088] * 133, [4096] * 256, [1088] * 132 + [0] * 12 + [4096] * 8,
             [131072] + [64] * 199, [40] * 300, [0] * 140 + [100], [4096, 2048] * 70,
             [1088] * 132 + [0] * 12, [4096] * 200]
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    for _ in range(6):
        cases.append(_random_lens(gen, 133))
    kinds = set()
    for lens in cases:
        plan, work = _plan(lens, 1, 132, cfg16, persistent=True)
        assert plan.programs == len(lens) and plan.rows == len(lens) + 132
        tiles = [-(-n // 64) for n in lens]
        share = -(-sum(max(t, 1) for t in tiles) // 132)
        choice = _rule_choice(lens, 1, 132, cfg16, plan.programs, plan.max_pieces)
        if choice is None or abs(share + STREAM_TILES - choice[0]) < 1e-3 * share:
            continue
        starts = plan.starts.tolist()
        if len(tiles) - tiles.count(0) > 132 and share + STREAM_TILES < choice[0]:
            kinds.add("persistent")
            runs = [[row[:3] for row in work[starts[p]:starts[p + 1]]]
                    for p in range(plan.programs)]
            assert runs == [*_stream_runs(lens, 132, 64), *[[]] * (plan.programs - 132)]
        else:
            kinds.add("scored")
            assert _pieces(work) == choice[1], (len(lens), max(lens))
            assert starts == [min(p, len(work)) for p in range(plan.programs + 1)]
    assert kinds == {"persistent", "scored"}
    # A batch within one wave keeps the scored plan's grid, as does a forced piece count.
    for lens, forced in (([4096] * 132, None), ([4096] * 140, 2)):
        plan, _ = _plan(lens, 1, 132, cfg16, forced, persistent=True)
        assert plan.rows == plan.programs



# --- merge -------------------------------------------------------------------------------


def _merge_inputs(T: int, N: int, D: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    po = torch.randn(T, N, D, generator=gen).to(DEVICE, dtype)
    so = torch.randn(T, N, D, generator=gen).to(DEVICE, dtype)
    # lse as strided [N, T] views: every other column of a wider buffer, and a slice.
    pl = (torch.randn(N, 2 * T, generator=gen) * 3).to(DEVICE)[:, ::2]
    sl = (torch.randn(N, T + 5, generator=gen) * 3).to(DEVICE)[:, 5:]
    # Empty partials (-inf, +inf) with NaN outputs behind them; both empty; huge gap.
    for t, h in ((0, 0), (1, 2), (3, N - 1)):
        pl[h, t] = -math.inf
        po[t, h] = math.nan
    sl[1, 0] = math.inf
    so[0, 1] = math.nan
    pl[2, 4], sl[2, 4] = -math.inf, -math.inf
    po[4, 2] = so[4, 2] = math.nan
    pl[0, 5], sl[0, 5] = 80.0, -80.0
    return po, pl, so, sl


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [24, 128])
def test_merge_matches_reference(dtype: torch.dtype, D: int) -> None:
    po, pl, so, sl = _merge_inputs(9, 5, D, dtype, seed=70 + D)
    out = torch.full_like(po, math.nan)
    out_lse = torch.full((5, 9), math.nan, device=DEVICE)
    merge_attn_states(po, pl, so, sl, out, out_lse)
    want, want_lse = torch.empty_like(po), torch.empty_like(out_lse)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    assert not out.isnan().any() and not out_lse.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-6)
    assert out_lse[2, 4] == -math.inf and (out[4, 2] == 0).all()


@runnable
def test_merge_in_place_without_lse() -> None:
    # output aliases prefix_output, output_lse aliases prefix_lse (a strided slice);
    # then output alone in place with output_lse None.
    po, pl, so, sl = _merge_inputs(9, 5, 24, torch.float32, seed=80)
    want, want_lse = torch.empty_like(po), torch.empty(5, 9, device=DEVICE)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    buf, lse_buf = po.clone(), pl.clone()
    merge_attn_states(buf, lse_buf, so, sl, buf, lse_buf)
    torch.testing.assert_close(buf, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse_buf, want_lse, atol=1e-5, rtol=1e-6)
    buf = so.clone()
    merge_attn_states(po, pl, buf, sl, buf, None)
    torch.testing.assert_close(buf, want, atol=2e-5, rtol=0)


# --- cache write and gather ---------------------------------------------------------------


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, FP8),
     (torch.float16, FP8)],
)
def test_write_cache_bit_exact(block_size: int, dtype: torch.dtype,
                               cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(90 + block_size)
    L, R, T, num_blocks = 64, 16, 21, 24
    # Large values so that fp8 saturates at +-448 after x / 0.37.
    kv_c = (torch.randn(T, L, generator=gen) * 60).to(DEVICE, dtype)
    k_pe = torch.randn(T, 2 * R, generator=gen).to(DEVICE, dtype)[:, ::2]  # strided view
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.tensor([0, 5, 6])] = -1
    slots = slots.to(DEVICE)
    scale = torch.tensor(0.37, device=DEVICE)
    data = torch.full((num_blocks, block_size, L + R), math.nan).to(DEVICE, cache_dtype)
    want = data.clone()
    write_cache(data, kv_c, k_pe, slots, scale)
    ref.write_cache(want, kv_c, k_pe, slots, scale)
    assert torch.equal(_bits(data), _bits(want))


@runnable
def test_write_cache_nope() -> None:
    data = torch.full((3, 4, 32), math.nan, device=DEVICE)
    want = data.clone()
    kv_c = torch.randn(5, 32, device=DEVICE)
    k_pe = torch.empty(5, 0, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 11, 7], device=DEVICE)
    scale = torch.tensor(1.0, device=DEVICE)
    write_cache(data, kv_c, k_pe, slots, scale)
    ref.write_cache(want, kv_c, k_pe, slots, scale)
    assert torch.equal(_bits(data), _bits(want))


def _gather_case(block_size: int, width: int, cache_dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    contexts = [3 * block_size + 2, 1, 40]
    data, table = _paged_cache(contexts, block_size, width, cache_dtype, gen, 0.37)
    starts = [1, 0, 7]
    counts = [contexts[0] - 1, 1, 20]
    token_to_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    return (data, torch.tensor(0.37, device=DEVICE), table,
            torch.tensor(starts, dtype=torch.int32, device=DEVICE), _cu(counts),
            token_to_seq.to(DEVICE, torch.int32))


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize(
    ("cache_dtype", "out_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (FP8, torch.float32),
     (FP8, torch.float16)],
)
def test_gather_cache_bit_exact(block_size: int, cache_dtype: torch.dtype,
                                out_dtype: torch.dtype) -> None:
    args = _gather_case(block_size, 80, cache_dtype, seed=100 + block_size)
    rows = args[-1].shape[0]
    out = torch.full((rows, 80), math.nan, dtype=out_dtype, device=DEVICE)
    want = torch.empty_like(out)
    gather_cache(*args, out)
    ref.gather_cache(*args, want)
    assert not out.isnan().any()
    assert torch.equal(_bits(out), _bits(want))


@runnable
@pytest.mark.parametrize("width", [48, 40, 64])
def test_gather_cache_widths(width: int) -> None:
    # 48 = 32 + 16, 40 = 32 + 8, 64 = 64 + 0 (NoPE): the power-of-two split of a row.
    args = _gather_case(16, width, torch.float32, seed=110 + width)
    out = torch.full((args[-1].shape[0], width), math.nan, device=DEVICE)
    want = torch.empty_like(out)
    gather_cache(*args, out)
    ref.gather_cache(*args, want)
    assert torch.equal(out, want)


# --- varlen prefill attention --------------------------------------------------------------


def _check_varlen(q_lens, k_lens, N, qk, dv, dtype, causal, seed, device=DEVICE,
                  fn=varlen_attention) -> tuple[torch.Tensor, torch.Tensor]:
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


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("qk", "dv"), [(48, 24), (24, 8), (16, 16)])
def test_varlen_causal(dtype: torch.dtype, qk: int, dv: int) -> None:
    # Lengths 0 and 1, one block, several blocks with a partial last one.
    lens = [0, 1, 5, 33, 70]
    _check_varlen(lens, lens, 3, qk, dv, dtype, True, seed=120 + qk)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("q_lens", "k_lens", "causal", "on_cudnn"), [
    ([300], [300], True, True),  # one sequence
    ([64, 64, 64], [64, 64, 64], True, True),  # equal lengths: dense [3, N, 64, D]
    ([40, 40], [100, 100], False, True),  # a context chunk's shape, unmasked
    ([5, 77], [5, 77], True, False),  # varlen: the Triton kernel
    ([40, 40], [90, 90], True, False),  # causal, not square: cuDNN's mask would differ
], ids=["one", "equal", "context", "varlen", "rect-causal"])
def test_prefill_selection(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                           q_lens: list[int], k_lens: list[int], causal: bool,
                           on_cudnn: bool) -> None:
    # The backend's prefill op: cuDNN for equal-length batches, else the Triton kernel;
    # both against the reference, with the path taken checked.
    from pagedmla.ops.triton import prefill_select

    calls: list[int] = []
    dense = prefill_select._cudnn_dense
    monkeypatch.setattr(prefill_select, "_cudnn_dense",
                        lambda *a: calls.append(1) or dense(*a))
    _check_varlen(q_lens, k_lens, 16, 192, 128, dtype, causal, seed=135, device="cuda",
                  fn=prefill_attention)
    assert bool(calls) == on_cudnn


@cuda
def test_prefill_selection_falls_back_when_cudnn_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    # A cuDNN refusal (RuntimeError) sends the call, and later calls of the same kind,
    # to the Triton kernel; the answer stays right.
    from pagedmla.ops.triton import prefill_select

    calls: list[int] = []

    def refuse(*args: object) -> None:
        calls.append(1)
        raise RuntimeError("unsupported")

    monkeypatch.setattr(prefill_select, "_cudnn_dense", refuse)
    monkeypatch.setattr(prefill_select, "_REFUSED", set())
    for seed in (136, 137):
        _check_varlen([64, 64], [64, 64], 4, 192, 128, torch.bfloat16, True, seed=seed,
                      device="cuda", fn=prefill_attention)
    assert len(calls) == 1 and len(prefill_select._REFUSED) == 1


@runnable
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_without_any_key(causal: bool) -> None:
    # k and v empty (no sequence has a key): out 0 and lse -inf. On a Hopper GPU (these
    # widths and float16 take the Gluon kernel) the copy descriptors refused the empty k
    # with a bare assertion until the op learned to run no kernel then; found by
    # tests/test_triton_random.py.
    for fn in (varlen_attention, prefill_attention):
        out, _ = _check_varlen([3, 0, 5], [0, 0, 0], 2, 192, 128, torch.float16, causal,
                               seed=131, fn=fn)
        assert torch.equal(out, torch.zeros_like(out))


@runnable
def test_varlen_causal_fewer_keys_than_queries() -> None:
    # Bottom-right alignment with q_len > k_len: the first queries see no key at all.
    _check_varlen([6, 40], [2, 35], 2, 48, 24, torch.float32, True, seed=130)


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_unmasked_context(dtype: torch.dtype) -> None:
    # Context chunks: separate query and key lengths, keys 0 (no key: out 0, lse -inf).
    _check_varlen([3, 1, 9, 40], [7, 0, 1, 90], 2, 48, 24, dtype, False, seed=140)


@runnable
def test_varlen_deepseek_dims_small() -> None:
    # 192 / 128 (DeepSeek): the qk dot is a 128-wide and a 64-wide tl.dot.
    _check_varlen([1, 20], [1, 20], 2, 192, 128, torch.float16, True, seed=150)


# --- the public layer against the float64 oracle --------------------------------------------


SMALL = MLADims(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=24)


def _run_layer(batch, backend: str, decode_threshold: int, workspace_rows: int | None):
    meta = MLAMetadataBuilder(batch.dims, block_size=batch.block_size, device=DEVICE,
                              workspace_rows=workspace_rows,
                              decode_threshold=decode_threshold).build(batch.spec)
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend=backend)
    return attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)


@runnable
@pytest.mark.parametrize(
    ("dims", "cache_dtype", "block_size"),
    [(SMALL, "auto", 16), (SMALL, "fp8", 1),
     (MLADims(num_heads=3, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=0,
              v_head_dim=16), "auto", 64)],
    ids=["float32", "fp8-page1", "nope-page64"],
)
def test_layer_matches_oracle(dims: MLADims, cache_dtype: str, block_size: int) -> None:
    # Decodes (1 and 2 tokens), then prefills with and without context, context forced
    # into several chunks with a continuation: every op of the backend is used.
    q_lens = [1, 2, 1, 7, 5]
    seq_lens = [40, 19, 1, 7, 60]
    batch = make_paged_batch(dims, q_lens, seq_lens, block_size, kv_cache_dtype=cache_dtype,
                             fp8_scale=0.37, seed=160 + block_size, device=DEVICE)
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=max(16, block_size))
    assert not out.isnan().any()
    err = relative_error(out, batch.oracle(decode_threshold=2))
    assert err < 2e-4, f"relative error {err:.3g}"
    assert batch.cache_mismatches() == 0


# --- GPU: the matrix at real sizes ------------------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 2])
def test_decode_gpu_ragged_batch(num_heads: int, cache: str, q_len: int) -> None:
    # One long request among short ones: the plan cuts the long one into pieces
    # (partials, the combine) and leaves the short ones whole (stage 1 writes their
    # output) in the same launch; the Gluon kernels on Hopper (16 and 64 rows).
    seq_lens = [40001, q_len, 65, 1000, 4097, 333, 2049]
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = _decode_case([q_len] * len(seq_lens), seq_lens, num_heads, 512, 64, 64,
                        torch.bfloat16, cache_dtype, seed=230 + num_heads + q_len)
    # The plan the kernel makes: its config, the Gluon kernels' rows per program and tile.
    rows = num_heads * q_len
    cfg = pick_config(rows, torch.bfloat16, cache == "fp8")
    block_h = 16 if rows <= 16 else 64
    plan = plan_splits(args[4], args[5], cdiv(rows, block_h), max(seq_lens),
                       multiprocessor_count(args[0].device) * cfg.programs_per_sm, 64,
                       cfg.min_chunk, block_h)
    counts = _pieces([row for row in plan.work.tolist() if row[0] >= 0])
    assert counts[0] > 4 and max(counts[1:]) < counts[0]
    _check_decode(args, torch.bfloat16)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("num_heads", [1, 16, 64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_gpu_matrix(num_heads: int, block_size: int, cache: str) -> None:
    # Lengths 1, 2, page + 1, not page-aligned, a few thousand; q_len 1.
    seq_lens = [1, 2, block_size + 1, 1000, 4097, 333]
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = _decode_case([1] * len(seq_lens), seq_lens, num_heads, 512, 64, block_size,
                        torch.bfloat16, cache_dtype, seed=200 + num_heads + block_size)
    _check_decode(args, torch.bfloat16)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("max_q", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_decode_gpu_multi_token(max_q: int, num_heads: int) -> None:
    q_lens = [max_q, 1, max(1, max_q // 2), max_q]
    seq_lens = [max_q, 700, 2049, 5000]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, 64, torch.bfloat16,
                        torch.bfloat16, seed=300 + max_q)
    _check_decode(args, torch.bfloat16)


@pytest.mark.cuda
@cuda
def test_decode_gpu_more_rows_than_a_grid_axis_holds() -> None:
    # 128 heads x 512 tokens per request are 65536 query rows, one more than a launch
    # grid's second axis holds: the combine runs on one axis (it failed to launch while
    # rows were its second). Two requests, so that the plan may cut one and the combine
    # runs.
    args = _decode_case([512, 512], [4608, 1000], 128, 512, 64, 64, torch.bfloat16,
                        torch.bfloat16, seed=240)
    assert GRID_YZ_MAX < 128 * 512
    _check_decode(args, torch.bfloat16)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("num_heads", "seq_len"), [(16, 131072), (128, 131072), (128, 65536)])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_decode_gpu_long_context(num_heads: int, seq_len: int, cache: str) -> None:
    # B = 1 with up to 128k positions: many splits and the combine pass.
    gen = torch.Generator(device="cuda").manual_seed(400)
    block_size, L, R = 64, 512, 64
    blocks = seq_len // block_size + 2
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    data = torch.randn(blocks, block_size, L + R, device="cuda", generator=gen)
    data = data.to(cache_dtype)
    table = (torch.randperm(blocks - 1, device="cuda", generator=gen) + 1).int()[None]
    q = torch.randn(1, num_heads, L + R, device="cuda", generator=gen).bfloat16()
    args = (q, data, torch.tensor(0.5 if cache == "fp8" else 1.0, device="cuda"), table,
            torch.tensor([seq_len], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"), 1, seq_len, L,
            (L + R) ** -0.5)
    _check_decode(args, torch.bfloat16)


@pytest.mark.parametrize("num_rows", [16, 128])
def test_hopper_kernels_only_take_cuda_tensors(num_rows: int) -> None:
    # The Gluon modules import with the installed Triton (CI: the CPU build), and the
    # dispatcher never hands them CPU tensors (the interpreter cannot run Gluon), even
    # where the shapes suit them.
    from pagedmla.ops.triton import decode_hopper, decode_hopper_heads

    q = torch.zeros(1, num_rows, 576, dtype=torch.bfloat16)
    data = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    module = decode_hopper if num_rows <= 16 else decode_hopper_heads
    assert module.supported(q, data, num_rows, 512)
    assert hopper_kernel(q, data, num_rows, 512) is None


@pytest.mark.parametrize(
    ("q_dtype", "cache", "page", "num_rows", "L", "takes"),
    [
        (torch.bfloat16, torch.bfloat16, 64, 16, 512, "16"),
        (torch.float16, FP8, 128, 1, 512, "16"),
        (torch.bfloat16, FP8, 32, 16, 512, "16"),  # a tile from two copies of 32 rows
        (torch.bfloat16, torch.bfloat16, 16, 16, 512, "16"),
        (torch.bfloat16, torch.bfloat16, 24, 16, 512, "16"),  # copies of 8 rows
        (torch.bfloat16, torch.bfloat16, 4, 16, 512, None),  # copies under 8 rows
        (torch.bfloat16, torch.bfloat16, 64, 17, 512, "64"),
        (torch.bfloat16, FP8, 64, 32, 512, "16"),  # fp8: two head groups of 16 rows
        (torch.bfloat16, FP8, 64, 33, 512, "64"),
        (torch.bfloat16, FP8, 4, 32, 512, "64"),  # pages the copies cannot fill
        (torch.bfloat16, torch.bfloat16, 64, 32, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 128, 128, 512, "64"),
        (torch.bfloat16, FP8, 32, 128, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 32, 128, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 1, 128, 512, None),
        (torch.bfloat16, FP8, 16, 128, 512, "64"),  # fp8 rows: any page size
        (torch.bfloat16, FP8, 1, 128, 512, "64"),
        (torch.float16, torch.bfloat16, 64, 128, 512, None),  # cache dtype != q dtype
        (torch.float32, torch.float32, 64, 128, 512, None),
        (torch.bfloat16, torch.bfloat16, 64, 128, 256, None),  # not DeepSeek widths
    ],
)
def test_hopper_kernel_choice(q_dtype: torch.dtype, cache: torch.dtype, page: int,
                              num_rows: int, L: int, takes: str | None) -> None:
    # Which Gluon kernel (if any) takes a call on a Hopper GPU, from the shapes alone:
    # the 16-row kernel up to 16 query rows (fp8: up to 32, in two head groups), the
    # 64-row one above; 16-bit q; a cache of q's dtype or fp8; pages the copies can
    # fill tiles from (a multiple of 8 rows), except fp8 in the 64-row kernel, whose
    # widener loads rows of any page.
    # `decode.hopper_kernel` takes the first of its modules that supports the call: the
    # e4m3-product kernel for an fp8 cache up to 32 rows.
    from pagedmla.ops.triton import decode_hopper, decode_hopper_fp8, decode_hopper_heads

    q = torch.zeros(1, num_rows, L + 64, dtype=q_dtype)
    data = torch.zeros(3, page, L + 64).to(cache)
    chosen = next((m for m in (decode_hopper_fp8, decode_hopper, decode_hopper_heads)
                   if m.supported(q, data, num_rows, L)), None)
    rows16 = decode_hopper_fp8 if cache == FP8 else decode_hopper
    assert chosen is {None: None, "16": rows16, "64": decode_hopper_heads}[takes]


@pytest.mark.parametrize(
    ("cache", "layout", "takes"),
    [
        (torch.bfloat16, "every-other-block", False),  # the copies need adjacent pages
        (FP8, "every-other-block", True),  # the widener: pages through their stride
        (FP8, "padded-rows", True),  # rows 16-byte aligned
        (FP8, "odd-row-stride", False),  # rows not 16-byte aligned
        (FP8, "page-stride-off-rows", False),  # pages not a whole number of rows apart
    ],
)
def test_hopper_kernel_choice_layouts(cache: torch.dtype, layout: str, takes: bool) -> None:
    # Cache views the 64-row kernel takes or refuses (128 query rows, page 16).
    from pagedmla.ops.triton import decode_hopper_heads

    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16)
    if layout == "every-other-block":
        data = torch.zeros(8, 16, 576).to(cache)[::2]
    elif layout == "padded-rows":
        data = torch.zeros(4, 16, 592).to(cache)[..., :576]
    elif layout == "odd-row-stride":
        data = torch.zeros(4, 16, 584).to(cache)[..., :576]
    else:
        data = torch.zeros(4 * 16 * 576 + 4 * 16).to(cache)
        data = data.as_strided((4, 16, 576), (16 * 576 + 16, 576, 1))
    assert decode_hopper_heads.supported(q, data, 128, 512) == takes


@pytest.mark.parametrize(("page", "rows"), [(1, 0), (4, 0), (8, 8), (12, 0), (16, 16),
                                            (24, 8), (48, 16), (64, 32), (96, 32),
                                            (128, 32)])
def test_fp8_prefetch_rows(page: int, rows: int) -> None:
    # The fp8 widener's L2 requests: the largest power of two up to 32 dividing the page
    # (a request stays inside its page), none under 8 rows.
    from pagedmla.ops.triton.decode_hopper_heads import _prefetch_rows

    assert _prefetch_rows(page) == rows


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [8, 16, 48, 64, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 6, 16), ([2, 1, 2, 1, 2, 2], 8), ([4, 1, 3, 4, 2, 4], 4),
                          ([1] * 6, 1)], ids=["q1-N16", "q2-N8", "q4-N4", "q1-N1"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_kernel(cache: str, block_size: int, q_lens: list[int],
                                  num_heads: int, num_splits: int | None) -> None:
    # The warp-specialized kernel (<= 16 query rows, 64-row tiles; pages of fewer than
    # 64 rows fill a tile with several copies: 8 rows per copy at page 8, 16 at 48):
    # lengths of one tile exactly, one past it, partial last tiles (NaN slots after
    # them), multi-token rows; direct output, forced splits and the planner's. It must
    # match the reference and the Triton kernel of the same config.
    from pagedmla.ops.triton import decode_hopper, decode_hopper_fp8

    seq_lens = [max(q_lens), 65, 64, 1000, 4097, 333]
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        cache_dtype, seed=800 + block_size + num_heads)
    kernel = decode_hopper_fp8 if cache == "fp8" else decode_hopper
    assert hopper_kernel(args[0], args[1], num_heads * max(q_lens), 512) is kernel
    _check_hopper_decode(args, num_heads * max(q_lens), cache == "fp8", num_splits)


def test_gluon_kernels_only_with_their_triton_release(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    # Gluon's API changes with each Triton release and the Gluon kernels are written for
    # one (_utils.GLUON_TRITON): built for sm_90a, they fail with 3.5, 3.7, 3.8 and 3.9
    # (benchmarks/compile_sm90.py). On a Hopper GPU with another release the Triton
    # kernels run, after one warning, instead of a compile error at the first call.
    major, minor = _utils.GLUON_TRITON
    assert gluon_builds(f"{major}.{minor}.0") and gluon_builds(f"{major}.{minor}.1+git5d9c6c3")
    for other in ("3.5.1", "3.7.0", "3.8.0", "3.9.0", "3.10.0", "4.6.0"):
        assert not gluon_builds(other)
    from pagedmla.ops.triton import split_plan

    hopper_gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_utils, "INTERPRETED", False)
    monkeypatch.setattr(_utils, "is_hopper", lambda device: True)
    gluon_modules.cache_clear()
    _utils._warn_no_gluon.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        with pytest.warns(RuntimeWarning, match=r"Triton 3\.9\.0 is installed"):
            assert gluon_modules(hopper_gpu, "split_plan") is None
        monkeypatch.setattr(triton, "__version__", f"{major}.{minor}.0")
        gluon_modules.cache_clear()  # (the answer is kept per device and names)
        assert gluon_modules(hopper_gpu, "split_plan") == (split_plan,)
    finally:
        gluon_modules.cache_clear()


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 6, 32), ([2, 1, 2, 1, 2, 2], 16), ([4, 1, 3, 4, 2, 4], 8),
                          ([3, 1, 2, 3, 3, 1], 10)],
                         ids=["q1-N32", "q2-N16", "q4-N8", "q3-N10"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_fp8_two_head_groups(block_size: int, q_lens: list[int],
                                               num_heads: int,
                                               num_splits: int | None) -> None:
    # 17-32 query rows with an fp8 cache: the e4m3-product kernel in two head groups of
    # 16 rows (the second one partial at 30 rows), which read the same tiles; as the
    # 16-row test above, against the reference and the Triton kernel.
    from pagedmla.ops.triton import decode_hopper_fp8

    seq_lens = [max(q_lens), 65, 64, 1000, 4097, 333]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        FP8, seed=870 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    assert 16 < num_rows <= decode_hopper_fp8.MAX_ROWS
    assert hopper_kernel(args[0], args[1], num_rows, 512) is decode_hopper_fp8
    _check_hopper_decode(args, num_rows, True, num_splits)


def _check_hopper_decode(args: tuple, num_rows: int, is_fp8: bool,
                         num_splits: int | None) -> None:
    """The Gluon kernel against the reference, and against the Triton kernel of the
    same config."""
    _check_decode(args, torch.bfloat16, num_splits=num_splits)
    config = pick_config(num_rows, args[0].dtype, is_fp8)
    assert config.hopper
    ours = mla_decode(*args, num_splits=num_splits)
    theirs = mla_decode(*args, num_splits=num_splits, config=replace(config, hopper=False))
    assert relative_error(ours[0], theirs[0].double()) < 1e-2
    lse_atol = E4M3_PRODUCTS_LSE_ATOL if _e4m3_products(args, None) else 2e-3
    torch.testing.assert_close(ours[1], theirs[1], atol=lse_atol, rtol=1e-5)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("q_len", "num_heads"), [(1, 16), (2, 8), (1, 1)])
def test_decode_gpu_hopper_persistent(dtype: torch.dtype, block_size: int, q_len: int,
                                      num_heads: int) -> None:
    # The 16-row kernel on a batch past one wave: programs run several pieces each, the
    # ring going on from one piece to the next, q reloaded per piece.
    from pagedmla.ops.triton import decode_hopper

    args = _persistent_case(num_heads, q_len, 512, block_size, dtype, 40, 4097,
                            seed=950 + block_size)
    assert hopper_kernel(args[0], args[1], num_heads * q_len, 512) is decode_hopper
    plans: dict = {}
    _check_decode(args, torch.bfloat16, plans=plans)
    (plan,) = plans.values()
    _assert_persistent_plan(plan)
    _check_hopper_decode(args, num_heads * q_len, False, None)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(("kernel", "num_heads", "q_len", "cache"),
                         [("decode_hopper_fp8", 16, 1, "fp8"), ("decode_hopper_fp8", 16, 2, "fp8"),
                          ("decode_hopper_heads", 128, 1, "bf16"),
                          ("decode_hopper_heads", 64, 2, "fp16"),
                          ("decode_hopper_heads", 128, 1, "fp8")])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_gpu_hopper_even_plan(kernel: str, num_heads: int, q_len: int, cache: str,
                                     block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernels that run one piece per program, on a batch past one wave (ragged
    # lengths, empty requests, graph padding rows) with the even plan made the cheapest:
    # pieces of unequal size, their rows longest first and their partials at their
    # indices, not their rows'. The 64-row kernel's wave is half as many requests (two
    # head groups at N = 128; q_len 2 x N 64).
    module = importlib.import_module(f"pagedmla.ops.triton.{kernel}")
    monkeypatch.setattr(split_plan_module, "STREAM_TILES", -10**6)
    sms = multiprocessor_count(torch.device("cuda"))
    extra = 40 if num_heads * q_len <= 32 else 40 - sms // 2
    dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    args = _persistent_case(num_heads, q_len, 512, block_size, dtype, extra, 4097,
                            seed=980 + block_size + num_heads + q_len)
    if cache == "fp8":
        args = (args[0], (args[1].float() / 2).to(FP8), torch.tensor(2.0, device="cuda"),
                *args[3:])
    num_rows = num_heads * q_len
    assert hopper_kernel(args[0], args[1], num_rows, 512) is module
    plans: dict = {}
    _check_decode(args, torch.bfloat16, plans=plans)
    (plan,) = plans.values()
    _assert_even_plan(plan)
    _check_hopper_decode(args, num_rows, cache == "fp8", None)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 5, 128), ([1] * 5, 64), ([2, 1, 2, 2, 1], 64),
                          ([1] * 5, 40), ([3, 1, 2, 3, 3], 16), ([2, 1, 2, 2, 1], 16)],
                         ids=["q1-N128", "q1-N64", "q2-N64", "q1-N40", "q3-N16", "q2-N16"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_heads_kernel(dtype: torch.dtype, block_size: int,
                                        q_lens: list[int], num_heads: int,
                                        num_splits: int | None) -> None:
    # The 64-row kernel (more than 16 query rows): two head groups (N = 128), one
    # (N = 64), rows past N * q_len in the last group (N = 40, q_len 3 x N 16, and 32
    # rows of the rows32 config), rows of several tokens with their own causal limits;
    # lengths of one tile, one past it, and partial tiles followed by NaN slots.
    from pagedmla.ops.triton import decode_hopper_heads

    seq_lens = [max(q_lens), 65, 64, 1000, 4097]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, dtype, dtype,
                        seed=900 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    assert hopper_kernel(args[0], args[1], num_rows, 512) is decode_hopper_heads
    _check_hopper_decode(args, num_rows, False, num_splits)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("block_size", [1, 16, 32, 48, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 5, 128), ([2, 1, 2, 2, 1], 64), ([1] * 5, 40),
                          ([3, 1, 2, 3, 3], 16), ([2, 1, 2, 2, 1], 20)],
                         ids=["q1-N128", "q2-N64", "q1-N40", "q3-N16", "q2-N20"])
@pytest.mark.parametrize("num_splits", [1, None])
def test_decode_gpu_hopper_heads_kernel_fp8(block_size: int, q_lens: list[int],
                                            num_heads: int, num_splits: int | None) -> None:
    # The 64-row kernel with an fp8 cache: rows loaded through the block table and
    # widened by the producer warpgroup (rows past the slice end zeroed there, NaN
    # slots after them), any page size: 1 and 16 (several pages per tile, L2 requests
    # of 16 rows or none), 32 and 48 (tiles across pages), 128.
    from pagedmla.ops.triton import decode_hopper_heads

    seq_lens = [max(q_lens), 33, 64, 1000, 4097]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        FP8, seed=950 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    assert hopper_kernel(args[0], args[1], num_rows, 512) is decode_hopper_heads
    _check_hopper_decode(args, num_rows, True, num_splits)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_decode_gpu_hopper_fp8_widening_is_exact(dtype: torch.dtype, num_heads: int) -> None:
    # One visible position: its softmax weight is exactly 1, so the output row is the
    # cached latent row itself. Fill it with every finite e4m3 value (subnormals, both
    # signs, +-448) and expect each exactly (e4m3 values are exact in bf16 and fp16;
    # compared as values: -0 comes back as +0 from the accumulator). 16 heads: the
    # 16-row kernel; 128: the 64-row one.
    from pagedmla.ops.triton import decode_hopper_fp8, decode_hopper_heads

    L, R, page = 512, 64, 64
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = codes[codes.float().isfinite()]
    row = finite.repeat(3)[: L + R]
    data = torch.full((2, page, L + R), math.nan, device="cuda").to(FP8)
    data[1, 0] = row.cuda()
    q = torch.randn(1, num_heads, L + R, device="cuda").to(dtype)
    args = (q, data, torch.tensor(1.0, device="cuda"),
            torch.tensor([[1]], dtype=torch.int32, device="cuda"),
            torch.tensor([1], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"), 1, 1, L, (L + R) ** -0.5)
    kernel = decode_hopper_fp8 if num_heads == 16 else decode_hopper_heads
    assert hopper_kernel(q, data, num_heads, L) is kernel
    out = mla_decode(*args)[0]
    want = row[:L].float().cuda().expand(num_heads, L)
    assert torch.equal(out[0].float(), want)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu_hopper_fp8_products_keep_q(dtype: torch.dtype) -> None:
    # The fp8 16-row kernel multiplies e4m3 codes, q included, as two e4m3 terms per
    # entry scaled per row (within 2^-8 of each entry). Rows whose magnitudes differ by
    # up to 2^24 (bf16) / 2^12 (fp16, whose range is smaller), entries within a row
    # spread over 2^-12..1 of its largest, one row with scores in the hundreds (a
    # near-one-hot softmax): the outputs must stay within the 16-bit kernels' tolerance
    # of the float64 reference, and lse within 2^-8 of it relative to its size (the
    # scores' own error; an e4m3 cache entry is itself only within 2^-4 of the value
    # it stores).
    from pagedmla.ops.triton import decode_hopper_fp8

    args = list(_decode_case([1, 1, 1], [700, 4097, 64], 16, 512, 64, 64, dtype, FP8,
                             seed=951))
    gen = torch.Generator().manual_seed(952)
    span = 24 if dtype == torch.bfloat16 else 12
    row_exp = torch.linspace(-span / 2, span / 2, 16).round()
    spread = torch.exp2(-12 * torch.rand(args[0].shape, generator=gen))
    q = args[0].float().cpu() * spread * torch.exp2(row_exp)[None, :, None]
    q[:, 3] *= 4096 / q[:, 3].abs().amax()  # large scores: a near-one-hot softmax
    args[0] = q.to(args[0].device, dtype)
    assert hopper_kernel(args[0], args[1], 16, 512) is decode_hopper_fp8
    want_out, want_lse = ref.mla_decode(*args)
    assert want_lse[3].abs().min() > 100
    for num_splits in (1, None):
        _poison_allocator("cuda")
        out, lse = mla_decode(*args, num_splits=num_splits)
        assert relative_error(out, want_out.double()) < 1e-2
        torch.testing.assert_close(lse, want_lse, atol=LSE_ATOL[torch.bfloat16], rtol=2**-8)


@pytest.mark.cuda
@hopper
def test_decode_gpu_hopper_heads_fp8_scattered_pages() -> None:
    # The fp8 64-row kernel on every other block of a bigger cache (NaN in the blocks
    # between): pages not adjacent in rows, which the 16-bit path's bulk copies cannot
    # take; the fp8 widener addresses each page through its stride.
    from pagedmla.ops.triton import decode_hopper_heads

    args = list(_decode_case([1] * 4, [1, 65, 1000, 4097], 128, 512, 64, 16, torch.bfloat16,
                             FP8, seed=995))
    data = args[1]
    spread = torch.full((2 * data.shape[0], *data.shape[1:]), math.nan, device="cuda")
    spread = spread.to(FP8)
    spread[::2] = data
    args[1] = spread[::2]
    assert hopper_kernel(args[0], args[1], 128, 512) is decode_hopper_heads
    _check_hopper_decode(tuple(args), 128, True, None)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_decode_gpu_hopper_padded_rows(cache: str, num_heads: int) -> None:
    # The Gluon kernels on a cache whose rows are padded to 640 columns, NaN in the
    # padding: the bulk copies (16-bit) and the fp8 widener's row loads follow the row
    # stride. 16 heads: the 16-row kernel; 128: the 64-row one.
    from pagedmla.ops.triton import decode_hopper, decode_hopper_fp8, decode_hopper_heads

    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = list(_decode_case([1] * 4, [1, 65, 1000, 4097], num_heads, 512, 64, 64,
                             torch.bfloat16, cache_dtype, seed=990 + num_heads))
    data = args[1]
    wide = torch.full((*data.shape[:2], 640), math.nan, device="cuda").to(cache_dtype)
    wide[..., :data.shape[2]] = data
    args[1] = wide[..., :data.shape[2]]
    rows16 = decode_hopper_fp8 if cache == "fp8" else decode_hopper
    kernel = rows16 if num_heads == 16 else decode_hopper_heads
    assert hopper_kernel(args[0], args[1], num_heads, 512) is kernel
    _check_hopper_decode(tuple(args), num_heads, cache == "fp8", None)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (256, 256), (128, 128)])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu(qk: int, dv: int, num_heads: int, causal: bool) -> None:
    q_lens = [0, 1, 300, 1029]
    k_lens = q_lens if causal else [5, 0, 2000, 1029]
    _check_varlen(q_lens, k_lens, num_heads, qk, dv, torch.bfloat16, causal, seed=500)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_ragged_many_sequences(causal: bool) -> None:
    # 300 sequences of 0-300 tokens and one of 3000: the packed query blocks of both
    # kernels (the Gluon one on Hopper), across three lookup chunks of 128 sequences.
    gen = torch.Generator().manual_seed(501)
    q_lens = [*torch.randint(0, 300, (300,), generator=gen).tolist(), 3000]
    q_lens[7] = 0
    k_lens = q_lens if causal else torch.randint(0, 500, (301,), generator=gen).tolist()
    _check_varlen(q_lens, k_lens, 16, 192, 128, torch.bfloat16, causal, seed=502)


@pytest.mark.parametrize(
    ("dtype", "qk", "dv", "heads", "view", "takes"),
    [
        (torch.bfloat16, 192, 128, 16, "kv", True),  # DeepSeek: k, v views of one buffer
        (torch.float16, 128, 128, 4, "kv", True),
        (torch.bfloat16, 256, 256, 2, "kv", True),
        (torch.bfloat16, 64, 64, 1, "kv", True),
        (torch.float32, 192, 128, 16, "kv", False),
        (torch.bfloat16, 48, 24, 2, "kv", False),  # head dims the copy boxes do not cover
        (torch.bfloat16, 192, 96, 2, "kv", False),
        (torch.bfloat16, 192, 128, 16, "odd-stride", False),  # head stride not 16 bytes
        (torch.bfloat16, 192, 128, 16, "heads-outer", False),  # [N, T, D] memory order
    ],
)
def test_prefill_hopper_kernel_choice(dtype: torch.dtype, qk: int, dv: int, heads: int,
                                      view: str, takes: bool) -> None:
    # Which calls the Gluon prefill kernel takes on a Hopper GPU, from the tensors alone,
    # and that the dispatcher never hands it CPU tensors.
    from pagedmla.ops.triton import prefill_hopper
    from pagedmla.ops.triton.prefill import hopper_kernel as prefill_kernel

    pad = 4 if view == "odd-stride" else 0
    q = torch.zeros(5, heads, qk, dtype=dtype)
    kv = torch.zeros(7, heads, qk + dv + pad, dtype=dtype)
    if view == "heads-outer":
        kv = torch.zeros(heads, 7, qk + dv, dtype=dtype).transpose(0, 1)
    k, v = kv[..., :qk], kv[..., qk:qk + dv]
    assert prefill_hopper.supported(q, k, v, 0.1) is takes
    assert not prefill_hopper.supported(q, k, v, 0.0)
    assert not prefill_hopper.supported(q, k, v, -0.1)
    assert prefill_kernel(q, k, v, 0.1) is None


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (128, 128), (256, 256), (64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_heads", [1, 16])
def test_varlen_gpu_hopper_kernel(qk: int, dv: int, dtype: torch.dtype, causal: bool,
                                  num_heads: int) -> None:
    # The warp-specialized prefill kernel: lengths 0 and 1, one tile exactly, one past
    # it, several tiles with a partial last one; query blocks of 128 rows spilling into
    # the next sequence; unmasked context with more or fewer keys than queries.
    from pagedmla.ops.triton import prefill_hopper
    from pagedmla.ops.triton.prefill import hopper_kernel as prefill_kernel

    q_lens = [0, 1, 128, 129, 64, 700]
    k_lens = q_lens if causal else [5, 0, 300, 129, 1000, 77]
    q = torch.empty(1, num_heads, qk, dtype=dtype, device="cuda")
    kv = torch.empty(1, num_heads, qk + dv, dtype=dtype, device="cuda")
    assert prefill_kernel(q, kv[..., :qk], kv[..., qk:], qk**-0.5) is prefill_hopper
    _check_varlen(q_lens, k_lens, num_heads, qk, dv, dtype, causal, seed=510 + qk + dv,
                  device="cuda")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_hopper_head_groups(causal: bool) -> None:
    # Programs are launched in groups of heads sized to L2 (`head_group`): a long
    # sequence makes the groups smaller than N = 10, so the last group is partial.
    from pagedmla.ops.triton import prefill_hopper

    N, qk, dv = 10, 192, 128
    q_lens = [5000, 300, 1]
    k_lens = q_lens if causal else [5000, 700, 1]
    probe = torch.empty(1, N, qk, dtype=torch.bfloat16, device="cuda")
    group = prefill_hopper.head_group(N, max(k_lens), qk + dv, probe)
    assert 1 < group < N and N % group != 0, group
    _check_varlen(q_lens, k_lens, N, qk, dv, torch.bfloat16, causal, seed=530, device="cuda")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("causal", [True, False])
def test_varlen_gpu_hopper_rows_past_a_sequence(causal: bool) -> None:
    # The copy engine reads whole 128-row tiles, so a sequence's last key tile holds the
    # next sequence's rows: infinite values there must not reach the sequence's output
    # (P is 0 for them, and 0 x inf is NaN unless the rows are zeroed).
    N, qk, dv = 4, 192, 128
    q_lens = [100, 60]
    k_lens = q_lens if causal else [150, 60]
    gen = torch.Generator().manual_seed(520)
    q = torch.randn(sum(q_lens), N, qk, generator=gen).cuda().bfloat16()
    kv = torch.randn(sum(k_lens), N, qk + dv, generator=gen).cuda().bfloat16()
    kv[k_lens[0]:] = math.inf
    k, v = kv[..., :qk], kv[..., qk:]
    out, lse = varlen_attention(q, k, v, _cu(q_lens, "cuda"), _cu(k_lens, "cuda"),
                                max(q_lens), max(k_lens), qk**-0.5, causal)
    first = slice(0, q_lens[0])
    want, want_lse = ref.varlen_attention(
        q[first], k[:k_lens[0]], v[:k_lens[0]], _cu(q_lens[:1], "cuda"),
        _cu(k_lens[:1], "cuda"), q_lens[0], k_lens[0], qk**-0.5, causal)
    assert out[first].isfinite().all()
    assert relative_error(out[first], want.double()) < 1e-2
    torch.testing.assert_close(lse[:, first], want_lse, atol=2e-3, rtol=1e-5)


@pytest.mark.cuda
@cuda
def test_merge_gpu_bf16() -> None:
    po, pl, so, sl = _merge_inputs(2048, 128, 128, torch.bfloat16, seed=600)
    out, out_lse = torch.full_like(po, math.nan), torch.full((128, 2048), math.nan,
                                                              device="cuda")
    merge_attn_states(po, pl, so, sl, out, out_lse)
    want, want_lse = torch.empty_like(po), torch.empty_like(out_lse)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    # Only bf16 rounding of the result separates the two (~1e-5 relative).
    assert relative_error(out, want.double()) < 1e-3
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-6)
    # In place over the prefix (as the chunked-context prefill does): the lse is read
    # and written by different warps of one program.
    merge_attn_states(po, pl, so, sl, po, pl)
    assert relative_error(po, want.double()) < 1e-3
    torch.testing.assert_close(pl, want_lse, atol=1e-5, rtol=1e-6)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_cache_gpu_fp8_bits(dtype: torch.dtype) -> None:
    # The hardware fp32 -> e4m3 conversion vs torch's, on every e4m3 value, every
    # midpoint between neighbours (ties to even) and values past the +-448 clamp.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -1e6, 449.0])])
    values = torch.cat([values, torch.randn(4096) * 100])
    L = 64
    values = torch.cat([values, values.new_zeros(-values.numel() % L)]).view(-1, L)
    values = values.to("cuda", dtype)
    rows = values.shape[0]
    for scale in (1.0, 0.37):
        s = torch.tensor(scale, device="cuda")
        data = torch.zeros(rows, 1, L, dtype=FP8, device="cuda")
        want = data.clone()
        slots = torch.arange(rows, device="cuda")
        pe = values.new_zeros(rows, 0)
        write_cache(data, values, pe, slots, s)
        ref.write_cache(want, values, pe, slots, s)
        assert torch.equal(_bits(data), _bits(want))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_layer_gpu_bf16_oracle(cache_dtype: str) -> None:
    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    q_lens = [1, 1, 2, 300, 37]
    seq_lens = [1, 900, 70, 300, 2000]
    batch = make_paged_batch(dims, q_lens, seq_lens, 64, dtype=torch.bfloat16,
                             kv_cache_dtype=cache_dtype, fp8_scale=0.37, seed=700,
                             device="cuda")
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=1024)
    assert relative_error(out, batch.oracle(decode_threshold=2)) < 2e-2
    assert batch.cache_mismatches() == 0


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8191, 3 * 8192 + 5])
def test_stream_read_sums_every_element(dtype: torch.dtype, n: int) -> None:
    # The benchmark's read-ceiling kernel (kernel_bench.stream_read): one partial sum per
    # run of 8192 elements, the masked tail included, adding up to the tensor's sum.
    from pagedmla.kernel_bench import stream_read

    x = torch.randn(n, device=DEVICE).to(dtype)
    parts = stream_read(x)()
    assert parts.shape == (math.ceil(n / 8192),)
    assert math.isclose(parts.double().sum().item(), x.double().sum().item(), abs_tol=1e-3)


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_baseline_attends_as_the_reference(block_size: int) -> None:
    # The benchmark's decode baseline (kernel_bench.torch_decode, gather + bf16 bmm) must
    # compute what mla_decode computes, or the speed-ups against it would mean nothing.
    from pagedmla.kernel_bench import torch_decode

    seq_lens = [4 * block_size] * 3
    args = _decode_case([1, 1, 1], seq_lens, 16, 512, 64, block_size, torch.bfloat16,
                        torch.bfloat16, seed=41, device="cpu")
    out, lse = torch_decode(*args)
    want, want_lse = ref.mla_decode(*args)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert relative_error(out, want.double()) < 1e-2
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        torch_decode(*args[:7], 4 * block_size - 1, *args[8:])


@pytest.mark.cuda
@cuda
def test_bench_covered_keeps_host_work_off_the_clock() -> None:
    # A call whose host side takes 2 ms ahead of a ~30 µs kernel: timed as `bench`
    # times it, the GPU's wait for the host counts; `bench_covered` gives the kernel's
    # time (also after a read-only wipe), and `host_us` the host's.
    from pagedmla.kernel_bench import bench, bench_covered, host_us

    x = torch.randn(1 << 24, device=DEVICE)

    def call() -> None:
        time.sleep(2e-3)
        x.mul_(1.0)

    kernel_us = bench_covered(lambda: x.mul_(1.0), rep_ms=20)
    assert kernel_us < 500
    # After a wipe that reads instead of writing, no write-back shares the call's HBM.
    assert bench_covered(lambda: x.mul_(1.0), rep_ms=20, clean_l2=True) < kernel_us + 50
    assert bench_covered(call, rep_ms=20, max_calls=20) < kernel_us + 100
    assert bench(call, rep_ms=40) > 1500
    assert 1900 < host_us(call, calls=10) < 20000


def test_sm_clock_median_skips_what_is_not_a_number() -> None:
    # kernel_bench.SmClock's samples: nvidia-smi prints one clock per line, "[N/A]" where
    # it has none; the median is over the numbers, None without any.
    from pagedmla.kernel_bench import median_sample

    assert median_sample("1980\n1410\n[N/A]\n1755\n") == 1755.0
    assert median_sample("1500\n1400\n") == 1450.0
    assert median_sample("") is None
    assert median_sample("[N/A]\n") is None
