"""Paged latent decode on the GPU at real sizes (the issue's matrix: bf16 and fp8
caches, 1-128 heads, contexts up to 128k), with whichever stage-1 kernel the GPU runs.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.ops.triton._utils import GRID_YZ_MAX, cdiv, multiprocessor_count
from pagedmla.ops.triton.decode_triton import pick_config
from pagedmla.ops.triton.split_plan import plan_splits
from tests.triton_helpers import FP8, _check_decode, _decode_case, _splits, cuda


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("q_len", [1, 2])
def test_decode_gpu_ragged_batch(num_heads: int, cache: str, q_len: int) -> None:
    # One long request among short ones: the plan cuts the long one into splits
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
    counts = _splits([row for row in plan.work.tolist() if row[0] >= 0])
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
    # grid's second axis holds: the combine runs on one axis (a grid with rows on its
    # second would not launch). Two requests, so that the plan may cut one and the
    # combine runs.
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
