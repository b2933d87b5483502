"""Paged latent decode (`mla_decode`) with the portable Triton stage-1 kernel against the
reference op: both product forms and tile loaders (TINY_CONFIGS), splits, fp8 caches,
odd widths, cache views, padding requests, the persistent and even plans, and the
op's refusals. Runs in the interpreter (tests/triton_helpers.py says what it cannot
check).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.ops.triton import decode as decode_module
from pagedmla.ops.triton import mla_decode
from pagedmla.ops.triton import split_plan as split_plan_module
from pagedmla.ops.triton.decode_triton import FEW_REQUESTS, DecodeConfig, _page_descriptors
from pagedmla.ops.triton.split_plan import SplitPlan
from tests.triton_helpers import (
    FP8,
    TINY_CONFIGS,
    TINY_DECODE,
    _assert_even_plan,
    _assert_persistent_plan,
    _check_decode,
    _check_past_wave,
    _decode_case,
    runnable,
)


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
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [2, 3, 1]])
def test_decode_max_seq_len_past_the_longest(q_lens: list[int]) -> None:
    # CUDA graphs, and the engine's eager decode rows, pass max_model_len: a bound far
    # past the batch's longest request (its block table as narrow as the batch needs)
    # changes the plan's bounds, not the result.
    args = _decode_case(q_lens, [5, 90, 200], 4, 64, 16, 16, torch.float32, torch.float32,
                        seed=31)
    out, _ = _check_decode(args, torch.float32)  # (out: ours, against the reference)
    loose = mla_decode(*args[:7], 4096, *args[8:])
    torch.testing.assert_close(loose[0], out, atol=1e-5, rtol=0)
    torch.testing.assert_close(loose[1], mla_decode(*args)[1], atol=1e-5, rtol=0)


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


def test_decode_refuses_more_splits_than_a_grid_axis_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Stage 1's splits are its grid's second axis (65535 programs at most on a GPU): a
    # batch whose plan needs more gets a ValueError naming the batch, not a failed
    # launch. The limit is lowered here so that four requests exceed it.
    args = _decode_case([1] * 4, [5] * 4, 4, 64, 16, 16, torch.float32, torch.float32,
                        seed=35)
    monkeypatch.setattr(decode_module, "GRID_YZ_MAX", 3)
    with pytest.raises(ValueError, match="seq_lens: a batch of 4 requests"):
        mla_decode(*args)


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


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@TINY_CONFIGS
def test_decode_persistent_plan(block_size: int, config: DecodeConfig) -> None:
    # A batch past one wave (on the interpreter: 4 programs) by a third of a wave or
    # more: the persistent plan runs several splits per program, short requests packed
    # into one program, long ones cut across programs and merged by the combine; q_len
    # 1 and 3 (3 x 8 heads: two head groups of 16 rows), seq_len 0 requests among them.
    _check_past_wave(block_size, config, 90, _assert_persistent_plan)


@runnable
@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_even_plan(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The even plan (the persistent plan's splits, a program each, rows longest first,
    # partials at their own indices) on the Triton kernel, which runs any plan's rows: a
    # batch past one wave, the plan made as for a kernel of one split per program, with
    # the even plan costed cheapest. q_len 1 and 3 (two head groups of 16 rows), empty
    # requests and graph padding rows among them.
    monkeypatch.setattr(split_plan_module, "STREAM_TILES", -10**6)
    one_per_program = decode_module.plan_splits

    def plan(*args: Any) -> SplitPlan:  # (persistent is plan_splits' tenth argument)
        return one_per_program(*args[:9], False, *args[10:])

    monkeypatch.setattr(decode_module, "plan_splits", plan)
    _check_past_wave(block_size, TINY_DECODE, 60, _assert_even_plan)


@runnable
def test_decode_few_requests_take_shorter_splits() -> None:
    # A config's few_min_chunk replaces its min_chunk for batches of at most
    # FEW_REQUESTS requests (one or two requests in 256-position splits would leave SMs
    # idle), and larger batches keep min_chunk: the plan kept in `plans` records which
    # one it is made with (its key's seventh field). The outputs match the reference.
    cfg = replace(TINY_DECODE, min_chunk=64, few_min_chunk=16)
    for lens, want in (([200], 16), ([200, 90], 16), ([200, 90, 5], 64)):
        assert (len(lens) <= FEW_REQUESTS) == (want == 16)
        args = _decode_case([1] * len(lens), lens, 4, 32, 16, 16, torch.float32,
                            torch.float32, seed=70 + len(lens))
        plans: dict = {}
        _check_decode(args, torch.float32, config=cfg, plans=plans)
        (key,) = plans
        assert key[6] == want
