"""The triton backend's sparse MLA attention (`ops/triton/sparse_decode.py`) against the
float64 oracle of tests/test_sparse_mla.py (each query's selected rows gathered from the
request's latents as the cache reads them back, attended with plain torch), and on a
GPU against the reference op at DeepSeek's sizes.

Batches come from `make_paged_batch` (block 0 reserved, blocks permuted, NaN in every
slot that holds no row); the indices mix selected positions, -1 and positions past the
query's causal limit, in random order. The interpreter runs float32 only (its bfloat16
dots are wrong, tests/triton_helpers.py); the cuda tests run bfloat16.

Tolerances, float32: the kernel adds in another order than float64 over at most a few
dozen terms, with exact (IEEE) float32 dots: 1e-5 relative, lse within 1e-5, as the
reference op's own tests (test_sparse_mla).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedmla import MLADims
from pagedmla.cache import DS_MLA_SCALES_AT
from pagedmla.ops import REFERENCE
from pagedmla.ops.reference_sparse import sparse_mla_attention
from pagedmla.testing import PagedBatch, make_paged_batch, relative_error

pytest.importorskip("triton")

from pagedmla.ops.triton import TRITON_BACKEND, sparse_attention
from pagedmla.ops.triton._utils import INTERPRETED
from pagedmla.ops.triton.decode_triton import DECODE_CONFIGS
from tests.test_sparse_mla import (
    batch_tensors,
    latent_oracle,
    random_indices,
    random_queries,
    token_positions,
)
from tests.triton_helpers import DEVICE, cuda, runnable

pytestmark = runnable

TOL = 1e-5
CACHES = ["auto", "fp8", "fp8_ds_mla"]
# (query_lens, seq_lens, page size, heads): decodes of one and two tokens, a prefill
# chunk after context and one from position 0, a request with no query rows between
# two that have some.
CASES = {
    "decode1": ([1, 1, 1], [5, 17, 40], 16, 4),
    "decode2": ([2, 2], [9, 33], 1, 16),
    "prefill": ([7, 12], [7, 30], 64, 4),
    "idle": ([1, 0, 2], [3, 12, 20], 16, 16),
}
TOPK = 20  # not a multiple of the float32 tile (16 positions)


def make_batch(case: str, kv_cache_dtype: str, seed: int) -> PagedBatch:
    """A paged batch (float32) whose cache also holds the step's new rows; DeepSeek's
    widths (L = 512, R = 64) for fp8_ds_mla."""
    query_lens, seq_lens, page, heads = CASES[case]
    latent, rope = (512, 64) if kv_cache_dtype == "fp8_ds_mla" else (32, 8)
    dims = MLADims(num_heads=heads, kv_lora_rank=latent, qk_nope_head_dim=16,
                   qk_rope_head_dim=rope, v_head_dim=12)
    batch = make_paged_batch(dims, query_lens, seq_lens, page, kv_cache_dtype=kv_cache_dtype,
                             fp8_scale=0.5, seed=seed)
    flat = batch.cache.data.view(-1, batch.cache.data.shape[-1])
    flat[batch.spec.slot_mapping] = batch.store(batch.new_latents())
    return batch


def with_future_entries(batch: PagedBatch, indices: torch.Tensor) -> torch.Tensor:
    """indices with up to three of each query's -1 entries turned into positions past its
    causal limit: the next position (a row the cache holds for all but a request's last
    token), one past the request's length, one past any block table."""
    out = indices.clone()
    for t, (b, pos) in enumerate(token_positions(batch)):
        unused = (out[t] == -1).nonzero().flatten().tolist()
        for slot, value in zip(unused, (pos + 1, batch.seq_lens[b] + 5, 10**6)):
            out[t, slot] = value
    return out


def run(batch: PagedBatch, q: torch.Tensor, indices: torch.Tensor, softmax_scale: float,
        **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The triton op on DEVICE; out and lse back on the host."""
    tables = [t.to(DEVICE) for t in batch_tensors(batch)]
    out, lse = sparse_attention(q.to(DEVICE), batch.cache.data.to(DEVICE),
                                batch.cache.scale.to(DEVICE), *tables, indices.to(DEVICE),
                                batch.dims.kv_lora_rank, softmax_scale, **kwargs)
    return out.cpu(), lse.cpu()


def check(batch: PagedBatch, q: torch.Tensor, indices: torch.Tensor, out: torch.Tensor,
          lse: torch.Tensor, softmax_scale: float) -> None:
    """out and lse against the float64 oracle: shapes, dtypes, values; the queries with no
    selected position exactly 0 and -inf."""
    want, want_lse = latent_oracle(batch, q, indices, softmax_scale)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert lse.shape == want_lse.shape and lse.dtype == torch.float32
    assert relative_error(out, want) < TOL
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty].double(), want_lse[~empty], rtol=TOL, atol=TOL)


@pytest.mark.parametrize("kv_cache_dtype", CACHES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_oracle(case: str, kv_cache_dtype: str) -> None:
    batch = make_batch(case, kv_cache_dtype, seed=1)
    q = random_queries(batch, seed=2)
    indices = with_future_entries(batch, random_indices(batch, TOPK, seed=3))
    scale = batch.dims.cache_width**-0.5
    out, lse = run(batch, q, indices, scale)
    check(batch, q, indices, out, lse, scale)


@pytest.mark.parametrize(("swap_ab", "heads"), [(True, 4), (False, 40)],
                         ids=["swapped", "three-head-groups"])
def test_other_launch_parameters(swap_ab: bool, heads: int) -> None:
    """The transposed products (SWAP_AB), and heads over several programs of 16, the
    last partly masked."""
    dims = MLADims(num_heads=heads, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                   v_head_dim=12)
    batch = make_paged_batch(dims, [1, 3], [11, 26], 16, seed=4)
    flat = batch.cache.data.view(-1, batch.cache.data.shape[-1])
    flat[batch.spec.slot_mapping] = batch.store(batch.new_latents())
    q = random_queries(batch, seed=5)
    indices = with_future_entries(batch, random_indices(batch, TOPK, seed=6))
    config = replace(DECODE_CONFIGS["fp32"], swap_ab=swap_ab)  # 16 heads, 16 positions
    out, lse = run(batch, q, indices, 0.2, config=config)
    check(batch, q, indices, out, lse, 0.2)


def test_query_without_positions_is_empty() -> None:
    """All -1, all past the causal limit, or no index slot at all: out 0, lse -inf."""
    batch = make_batch("decode2", "auto", seed=7)
    q = random_queries(batch, seed=8)
    indices = random_indices(batch, TOPK, seed=9)
    indices[0] = -1
    indices[3] = -1
    indices[3, :4] = torch.tensor([33, 34, 40, 10**6])  # token 3 is at position 32
    out, lse = run(batch, q, indices, 0.2)
    assert torch.equal(out[[0, 3]], torch.zeros_like(out[[0, 3]]))
    assert torch.isneginf(lse[:, [0, 3]]).all()
    check(batch, q, indices, out, lse, 0.2)
    out, lse = run(batch, q, indices[:, :0], 0.2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def _poison(batch: PagedBatch, b: int, pos: int) -> None:
    """NaN in request b's row at position pos: in one latent value, or for fp8_ds_mla in
    its first group's scale (as the cache write leaves a group that holds a NaN)."""
    slot = batch.blocks[b][pos // batch.block_size] * batch.block_size + pos % batch.block_size
    row = batch.cache.data.view(-1, batch.cache.data.shape[-1])[slot]
    if row.dtype == torch.uint8:
        row[DS_MLA_SCALES_AT:DS_MLA_SCALES_AT + 4] = 255  # float32 0xFFFFFFFF: NaN
    else:
        row[3] = math.nan


@pytest.mark.parametrize("kv_cache_dtype", [
    "auto",
    pytest.param("fp8", marks=pytest.mark.skipif(
        INTERPRETED, reason="Triton's interpreter reads the e4m3 NaN code as 480")),
    "fp8_ds_mla"])
def test_nan_reaches_exactly_the_queries_that_select_it(kv_cache_dtype: str) -> None:
    batch = make_batch("prefill", kv_cache_dtype, seed=10)
    q = random_queries(batch, seed=11)
    indices = random_indices(batch, TOPK, seed=12)
    request = 1  # the prefill after context: 12 queries over 30 positions
    mine = [t for t, (b, _) in enumerate(token_positions(batch)) if b == request]
    for t in mine:
        indices[t][indices[t] == 0] = -1  # position 0 selected by none of them
    chosen = {t: set(indices[t].tolist()) for t in mine}
    hit = next(p for p in range(30) if 0 < sum(p in chosen[t] for t in mine) < len(mine))
    _poison(batch, request, 0)
    out, lse = run(batch, q, indices, 0.2)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    _poison(batch, request, hit)
    out, lse = run(batch, q, indices, 0.2)
    reached = torch.isnan(out).any(dim=-1)  # [T, N]
    for t in range(batch.num_tokens):
        selects = t in chosen and hit in chosen[t]
        assert reached[t].all() if selects else not reached[t].any()
        assert torch.isnan(lse[:, t]).all() if selects else not torch.isnan(lse[:, t]).any()


def test_checks_its_arguments() -> None:
    batch = make_batch("decode1", "fp8_ds_mla", seed=13)
    q = random_queries(batch, seed=14)
    indices = random_indices(batch, 4, seed=15)
    with pytest.raises(ValueError, match=r"656-byte entries .* L = 512 and q rows of 570"):
        run(batch, q[..., :570], indices, 0.2)
    with pytest.raises(ValueError, match=r"indices must have shape \[3, topk\]"):
        run(batch, q, indices[1:], 0.2)


def test_backends_hold_the_op() -> None:
    assert TRITON_BACKEND.sparse_attention is sparse_attention
    assert REFERENCE.sparse_attention is sparse_mla_attention


# --- GPU, bfloat16, DeepSeek's sizes -----------------------------------------------------


def deepseek_batch(heads: int, kv_cache_dtype: str, seed: int) -> tuple[PagedBatch, list[int]]:
    """bf16 batch on the GPU: decodes of one and two tokens and a prefill chunk of 64 on
    contexts of 1.5k-5k positions, 64-position pages; (batch, query lens)."""
    dims = MLADims(num_heads=heads, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    query_lens, seq_lens = [1, 2, 1, 64], [4100, 3000, 1500, 5000]
    batch = make_paged_batch(dims, query_lens, seq_lens, 64, dtype=torch.bfloat16,
                             kv_cache_dtype=kv_cache_dtype, fp8_scale=0.5, seed=seed,
                             device="cuda")
    flat = batch.cache.data.view(-1, batch.cache.data.shape[-1])
    flat[batch.spec.slot_mapping.cuda()] = batch.store(batch.new_latents()).cuda()
    return batch, query_lens


def topk_indices(batch: PagedBatch, topk: int, seed: int) -> torch.Tensor:
    """What an indexer gives: per query, the topk positions of random scores over its
    causal context, -1 where it sees fewer (on the GPU)."""
    gen = torch.Generator().manual_seed(seed)
    positions = token_positions(batch)
    width = max(batch.seq_lens)
    scores = torch.rand(len(positions), width, generator=gen)
    limit = torch.tensor([pos for _, pos in positions]).view(-1, 1)
    scores = scores.masked_fill(torch.arange(width).view(1, -1) > limit, -1.0)
    values, chosen = scores.topk(topk, dim=1)
    return torch.where(values >= 0, chosen, -1).int().cuda()


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("kv_cache_dtype", CACHES)
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_bf16_deepseek_sizes(heads: int, kv_cache_dtype: str) -> None:
    """Against the reference op (float32 math on the same rows), top-k 2048.
    Tolerance: the kernel rounds the softmax weights to bf16 (unit roundoff 2^-8) before
    P @ V, and an fp8 cache's products run in float16 (q rounded to it, 2^-11); averaged
    over up to 2048 rows the output's relative L2 error stays well inside 1e-2, the
    bound of the dense bf16 decode tests (triton_helpers). lse: scores of exact 16-bit
    products summed in float32 by both, which differ in order and in exp2 / log2 (and,
    with an fp8 cache, q's float16 rounding, ~2^-11 of a score of size ~3): 2e-3."""
    batch, _ = deepseek_batch(heads, kv_cache_dtype, seed=20 + heads)
    gen = torch.Generator().manual_seed(21)
    q = torch.randn(batch.num_tokens, heads, 576, generator=gen).to("cuda", torch.bfloat16)
    indices = topk_indices(batch, 2048, seed=22)
    tables = [t.cuda() for t in batch_tensors(batch)]
    args = (q, batch.cache.data, batch.cache.scale.cuda(), *tables, indices, 512, 576**-0.5)
    out, lse = sparse_attention(*args)
    want, want_lse = sparse_mla_attention(*args)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, want.double()) < 1e-2
    empty = torch.isinf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty], want_lse[~empty], atol=2e-3, rtol=0)


@pytest.mark.cuda
@cuda
def test_gpu_cuda_graph_replays_new_indices() -> None:
    """Graph safe: captured once, replayed with other indices and lengths written into
    the same tensors, it gives the eager result of the new contents."""
    batch, _ = deepseek_batch(16, "fp8_ds_mla", seed=30)
    gen = torch.Generator().manual_seed(31)
    q = torch.randn(batch.num_tokens, 16, 576, generator=gen).to("cuda", torch.bfloat16)
    tables = [t.cuda() for t in batch_tensors(batch)]
    indices = topk_indices(batch, 2048, seed=32)
    args = (q, batch.cache.data, batch.cache.scale.cuda(), *tables, indices, 512, 576**-0.5)
    sparse_attention(*args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = sparse_attention(*args)
    indices.copy_(topk_indices(batch, 2048, seed=33))
    tables[1].sub_(1)  # every request one position shorter: each limit moves down one
    graph.replay()
    want, want_lse = sparse_attention(*args)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
