"""The lightning indexer's Triton op (`ops/triton/indexer.py`) against a float64 oracle
built here: every visible (token, position) score sum_h w relu(q . k) from the keys as
the cache stores them, -inf elsewhere, and the top-k sets it implies.

Where they run (tests/triton_helpers.py): the small tests on the GPU, or on CPU tensors
in Triton's interpreter (float32: the interpreter's bf16 tl.dot is wrong); the `cuda`
tests at the released models' widths (64 heads of 128, bf16 and fp8, page 64,
contexts of thousands) and the CUDA-graph replay.

The fp8 oracle reads the stored codes and scales from the cache's bytes itself and
quantizes the queries by the rule of `reference_indexer`'s docstring (rotation by the
normalised Hadamard matrix, e4m3 with a power-of-two scale per token and head), in
float64. The small tests use D = 16 and integer queries, so the rotation (entries +-1/4)
is exact in float32 and float64 alike and both sides round the same queries: the codes
agree exactly and the logits to float32 rounding.

Tolerances, of the row's largest |score| (`check_logits`; top-k: the same of the
largest score overall). float32 (interpreter or GPU, IEEE dot) and fp8 in the
interpreter: float32 sums of exact products, 1e-5. GPU bf16: exact bf16 products summed
in float32 by the tensor cores, 1e-4. GPU fp8: the tensor cores sum e4m3 products with
~14 bits of mantissa (DeepSeek-V3's report of Hopper's fp8 MMA), 5e-3; at D = 128 the
queries are rounded from a float32 rotation, which may round a code one step (2^-3)
away from the float64 rotation's, so there the oracle takes the queries as the
reference prepares them.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.ops import REFERENCE
from pagedmla.ops import reference_indexer as spec
from pagedmla.ops.triton import TRITON_BACKEND
from pagedmla.ops.triton.indexer import (
    LogitsConfig,
    _row_chunk,
    indexer_logits,
    indexer_topk,
    pick_config,
)
from tests.triton_helpers import DEVICE, FP8, HAS_CUDA, cuda, runnable

FP8_GPU_REL = 5e-3  # the fp8 tensor cores' sums (module docstring)

# Several tiles per program and several spans per token at tiny sizes, in both
# formulations of the product (keys x queries, and queries x keys).
TINY = LogitsConfig(block_m=2, block_n=16, max_tiles=2, num_warps=4, num_stages=1)
TINY_DIRECT = replace(TINY, swap_ab=False)
# decode 1 and 2 tokens, a prefill chunk over cached context, a fresh prompt, and empty
# CUDA-graph padding rows (q_len 0, seq_len 0) between and after them.
SEQ_LENS = [37, 70, 0, 90, 20, 0]
Q_LENS = [1, 2, 0, 24, 20, 0]


def _hadamard64(dim: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix / sqrt(dim), float64, built by doubling."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(dim)


def _oracle_queries(q: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] rotated and rounded through e4m3 (scale: the smallest power of two
    >= max(amax, 1e-4) / 448 per token and head), float64."""
    x = q.double() @ _hadamard64(q.shape[-1]).to(q.device)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448)))
    return (x / scale).to(FP8).double() * scale


def _stored_keys(data: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The keys at `slots` as the cache's bytes hold them, float64 [n, D]: a float
    cache's rows, or an fp8 block's D codes of the slot's offset (its first page x D
    bytes) times the offset's float32 scale (the 4 bytes at page x D + 4 x offset)."""
    num_blocks, page, width = data.shape
    if data.dtype != torch.uint8:
        return data.reshape(-1, width)[slots].double()
    D = width - 4
    blocks = data.reshape(num_blocks, page * width)[slots // page]
    offset = (slots % page).unsqueeze(1)
    codes = blocks.gather(1, offset * D + torch.arange(D, device=data.device))
    scale = blocks.gather(1, page * D + 4 * offset + torch.arange(4, device=data.device))
    return codes.view(FP8).double() * scale.contiguous().view(torch.float32).double()


def oracle_logits(q: torch.Tensor, weights: torch.Tensor, data: torch.Tensor,
                  table: torch.Tensor, seq_lens: list[int], q_lens: list[int],
                  queries: torch.Tensor | None = None) -> torch.Tensor:
    """float64 [T, P] (P = table columns x page): the scores of every visible position,
    -inf elsewhere. queries: the float queries to score with (default: q itself, or the
    oracle's fp8 rounding of it for an fp8 cache)."""
    page = data.shape[1]
    if queries is None:
        queries = _oracle_queries(q) if data.dtype == torch.uint8 else q.double()
    out = torch.full((q.shape[0], table.shape[1] * page), -math.inf, dtype=torch.float64,
                     device=q.device)
    t = 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        pos = torch.arange(seq_len, device=q.device)
        keys = _stored_keys(data, table[b, pos // page].long() * page + pos % page)
        for i in range(q_len):
            seen = seq_len - q_len + i + 1
            dots = (queries[t] @ keys[:seen].T).relu()
            out[t, :seen] = (weights[t].double().unsqueeze(1) * dots).sum(0)
            t += 1
    return out


def make_case(seq_lens: list[int], q_lens: list[int], heads: int, dim: int, page: int,
              fp8: bool, dtype: torch.dtype = torch.float32, seed: int = 0,
              integer_q: bool = False, device: str = DEVICE) -> tuple:
    """indexer_topk's first six arguments: keys ~ N(0, 1) written by the reference writer
    into a cache of NaN (0xFF bytes for fp8: NaN codes and scales) whose blocks are a
    permutation (block 0 unused), table entries past a request's blocks far outside the
    cache; q ~ N(0, 1) (or integers in [-6, 6]); weights ~ N(0, 1) (some negative)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-s // page) for s in seq_lens]
    num_blocks = 1 + sum(used) + 2
    data = spec.allocate_indexer_cache(num_blocks, page, dim, dtype, fp8)
    data.fill_(255) if fp8 else data.fill_(math.nan)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), max(used) + 1), 10**6, dtype=torch.int32)
    taken = 0
    for b, (n, seq_len) in enumerate(zip(used, seq_lens)):
        table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.int32)
        taken += n
        pos = torch.arange(seq_len)
        slots = table[b, pos // page].long() * page + pos % page
        keys = torch.randn(seq_len, dim, generator=gen).to(dtype)
        spec.write_indexer_cache(data, keys, slots)
    T = sum(q_lens)
    if integer_q:
        q = torch.randint(-6, 7, (T, heads, dim), generator=gen).to(dtype)
    else:
        q = torch.randn(T, heads, dim, generator=gen).to(dtype)
    weights = torch.randn(T, heads, generator=gen)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, weights, data, table, torch.tensor(seq_lens, dtype=torch.int32), qsl)
    return tuple(a.to(device) for a in args)


def check_logits(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """-inf exactly where want is -inf; elsewhere within rel of the row's largest
    |score|."""
    seen = want != -math.inf
    assert torch.equal(got == -math.inf, ~seen)
    scale = want.where(seen, 0.0).abs().amax(1, keepdim=True).expand_as(want)[seen]
    err = (got.double()[seen] - want[seen]).abs()
    assert (err <= rel * scale).all(), err.max().item()


def check_topk(got: torch.Tensor, scores: torch.Tensor, topk: int, tol: float) -> None:
    """Per row: min(topk, visible) distinct visible positions, -1 in the other slots,
    each picked score within tol of the oracle's k-th best, and the oracle's top-k set
    itself where its k-th and (k + 1)-th scores are more than tol apart."""
    assert got.dtype == torch.int32 and got.shape == (scores.shape[0], topk)
    got, scores = got.cpu(), scores.cpu()
    for row, score in zip(got, scores):
        visible = int((score != -math.inf).sum())
        n = min(topk, visible)
        picks = row[row >= 0].long()
        assert (row == -1).sum() == topk - n and len(picks) == n
        assert len(set(picks.tolist())) == n and (picks < visible).all()
        if n == 0:
            continue
        ranked = score[:visible].sort(descending=True).values
        assert score[picks].min() >= ranked[n - 1] - tol
        if n == visible or ranked[n - 1] - ranked[n] > tol:
            assert set(picks.tolist()) == set(score[:visible].topk(n).indices.tolist())


@runnable
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_logits_and_topk_match_the_oracle(page: int, fp8: bool) -> None:
    args = make_case(SEQ_LENS, Q_LENS, 4, 16, page, fp8, seed=page, integer_q=fp8)
    want = oracle_logits(*args[:4], SEQ_LENS, Q_LENS)
    rel = FP8_GPU_REL if fp8 and HAS_CUDA else 1e-5
    for config in (TINY, TINY_DIRECT):
        check_logits(indexer_logits(*args, config=config), want, rel)
    if page == 64:  # pick_config's launch
        check_logits(indexer_logits(*args), want, rel)
    for topk in (5, 200):  # 200: past the logits' width (P = 91, 112, 192)
        got = indexer_topk(*args, max(SEQ_LENS), topk, config=TINY)
        check_topk(got, want, topk, tol=rel * want[want > -math.inf].abs().max())


@runnable
def test_query_chunks_give_the_same_result() -> None:
    # A budget of five logits rows: the 47 tokens run in 10 launches (chunk boundaries
    # inside requests), each chunk's token -> request map computed on the device.
    args = make_case(SEQ_LENS, Q_LENS, 4, 16, 16, fp8=True, seed=3, integer_q=True)
    P = args[3].shape[1] * 16
    assert _row_chunk(P, 5 * P + 3) == 5 and _row_chunk(P, 1) == 1
    whole = indexer_topk(*args, max(SEQ_LENS), 12, config=TINY)
    chunked = indexer_topk(*args, max(SEQ_LENS), 12, budget=5 * P + 3, config=TINY)
    assert torch.equal(whole.sort(1).values, chunked.sort(1).values)


@runnable
def test_many_heads_and_wide_keys() -> None:
    # A head count and a head dim that are not powers of two (20 heads padded to 32,
    # 24 values to 32; float cache only: the fp8 one needs the Hadamard rotation's
    # power of two).
    seq_lens, q_lens = [45, 9], [3, 9]
    args = make_case(seq_lens, q_lens, 20, 24, 16, fp8=False, seed=5)
    want = oracle_logits(*args[:4], seq_lens, q_lens)
    for config in (TINY, TINY_DIRECT):
        check_logits(indexer_logits(*args, config=config), want, 1e-5)


def test_decode_and_prefill_configs() -> None:
    # Decode: a request's tokens share one read of its keys; prefill: 128 columns.
    assert pick_config(64, 64, 64).block_m == 1
    assert pick_config(128, 64, 64).block_m == 2
    assert pick_config(4096, 1, 64).block_m * 64 == 128
    assert pick_config(4096, 1, 128).block_m == 1


def test_backends_hold_their_indexer() -> None:
    assert REFERENCE.indexer_topk is spec.indexer_topk
    assert TRITON_BACKEND.indexer_topk is indexer_topk


@runnable
def test_bad_arguments_are_refused_before_launch() -> None:
    args = make_case([5], [1], 2, 16, 16, fp8=False)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk(*args, 5, 0)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk(args[0], args[1][:, :1], *args[2:], 5, 4)
    with pytest.raises(ValueError, match="head dim"):
        indexer_topk(args[0][..., :8], *args[1:], 5, 4)
    with pytest.raises(TypeError, match="block_table"):
        indexer_topk(*args[:3], args[3].long(), *args[4:], 5, 4)


def test_bench_indexer_workloads_and_verdicts() -> None:
    # The benchmark's host side (benchmarks/bench_indexer.py): its cases and targets.
    from benchmarks import bench_indexer as bench

    args = bench.parse_args(["--out", "x.json", "--cases", "decode", "prefill_4k"])
    assert args.out == "x.json" and args.cases == ["decode", "prefill_4k"]
    assert set(bench.CASES) == {"decode", "prefill_4k", "prefill_16k"}
    decode = bench.CASES["decode"]
    assert decode.seq_lens == [65536] * 64 and decode.q_lens == [1] * 64
    assert bench.CASES["prefill_16k"].q_lens == bench.CASES["prefill_16k"].seq_lens
    assert bench.verdict({"case": "decode", "total_ms": 0.3}) == "pass"
    assert bench.parse_args(["--sweep"]).sweep
    for decode in (True, False):
        configs = bench.candidate_configs(decode, 64)
        assert len(set(configs)) == len(configs)
        assert pick_config(64 if decode else 4096, 64 if decode else 1, 64) in configs
    assert bench.verdict({"case": "prefill_16k", "total_ms": 7.0}) == "miss"


# --- GPU: the released models' widths ----------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_model_widths(fp8: bool) -> None:
    # 64 heads of 128, page 64: decode rows (1 and 2 tokens), a 1000-token chunk over
    # 3000 cached positions, a fresh 2048-token prompt; top-k 2048 as released.
    seq_lens, q_lens = [5000, 8191, 4000, 2048, 1], [1, 2, 1000, 2048, 1]
    args = make_case(seq_lens, q_lens, 64, 128, 64, fp8, torch.bfloat16, seed=11)
    queries = spec.prepare_queries(args[0], True).double() if fp8 else None
    want = oracle_logits(*args[:4], seq_lens, q_lens, queries)
    rel = FP8_GPU_REL if fp8 else 1e-4
    check_logits(indexer_logits(*args), want, rel)
    got = indexer_topk(*args, max(seq_lens), 2048)
    check_topk(got, want, 2048, tol=rel * want[want > -math.inf].abs().max())
    chunked = indexer_topk(*args, max(seq_lens), 2048, budget=1 << 20)
    assert torch.equal(got.sort(1).values, chunked.sort(1).values)


@pytest.mark.cuda
@cuda
def test_gpu_decode_replays_in_a_cuda_graph() -> None:
    # Captured once for a decode batch, replayed with every request one token shorter,
    # then as captured: the same results as eager calls (no host sync, no shape taken
    # from seq_lens).
    seq_lens, q_lens = [300, 1000, 64, 2000], [1, 2, 1, 1]
    args = make_case(seq_lens, q_lens, 64, 128, 64, True, torch.bfloat16, seed=12)
    lens = args[4]
    graph = torch.cuda.CUDAGraph()
    indexer_topk(*args, 2048, 256)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = indexer_topk(*args, 2048, 256)
    for grow in (0, 1):
        lens.copy_(torch.tensor(seq_lens, dtype=torch.int32) - 1 + grow)
        graph.replay()
        assert torch.equal(out.sort(1).values, indexer_topk(*args, 2048, 256).sort(1).values)
