"""Sparse MLA attention (`ops/reference_sparse.py`, `attention/sparse.py`) against
float64 oracles written here.

The oracles gather each query's selected rows from the request's latents as
`pagedmla.testing` reads them back from the cache (float64, no paging) and attend with
plain torch: the op's absorbed MQA over the latent rows directly, the layer's output by
the non-absorbed formula (up-projected keys and values). Batches come from
`make_paged_batch`: block 0 reserved, the other blocks permuted, NaN in every slot that
holds no row; the step's new rows are stored at their slots with the oracle's own
encoder (`PagedBatch.store`), as a forward's cache write leaves them.

Tolerances: float32 math against float64 over sums of at most a few hundred terms
(~1e-6 relative); the op's checks allow 1e-5, the layer's (whose W_UK and W_UV products
are float32 too) 1e-4, as in test_attention_oracle. bfloat16 queries: 2e-2.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.attention.decode import absorb_query
from pagedmla.attention.sparse import sparse_mla
from pagedmla.metadata import MLAMetadata
from pagedmla.ops import REFERENCE
from pagedmla.ops.output_quant import OutputQuant, QuantizedOutput
from pagedmla.ops.reference_sparse import (
    check_sparse_indices,
    sparse_mla_attention,
    sparse_query_rows,
)
from pagedmla.testing import PagedBatch, make_paged_batch, relative_error

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12)
DS_DIMS = MLADims(num_heads=2, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
                  v_head_dim=16)
CACHES = ["auto", "fp8", "fp8_ds_mla"]
OP_TOL = 1e-5
LAYER_TOL = 1e-4
BF16_TOL = 2e-2

# (query_lens, seq_lens, block_size): decodes of one and two tokens, prefills with and
# without context, a mixed step; page sizes 1, 16, 64.
CASES = {
    "decode1": ([1, 1, 1], [5, 17, 40], 16),
    "decode2": ([2, 2], [9, 33], 1),
    "prefill": ([7, 12], [7, 30], 16),
    "mixed": ([1, 2, 9], [20, 3, 70], 64),
}


def paged(case: str, kv_cache_dtype: str = "auto", seed: int = 0,
          dtype: torch.dtype = torch.float32) -> PagedBatch:
    """A paged batch whose cache also holds the step's new rows."""
    query_lens, seq_lens, block_size = CASES[case]
    dims = DS_DIMS if kv_cache_dtype == "fp8_ds_mla" else DIMS
    batch = make_paged_batch(dims, query_lens, seq_lens, block_size, dtype=dtype,
                             kv_cache_dtype=kv_cache_dtype, fp8_scale=0.5, seed=seed)
    flat = batch.cache.data.view(-1, batch.cache.data.shape[-1])
    flat[batch.spec.slot_mapping] = batch.store(batch.new_latents())
    return batch


def batch_tensors(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_table, seq_lens and query_start_loc (int32) of the whole batch."""
    starts = [0]
    for q in batch.query_lens:
        starts.append(starts[-1] + q)
    return (batch.spec.block_table, torch.tensor(batch.seq_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32))


def token_positions(batch: PagedBatch) -> list[tuple[int, int]]:
    """(request, position) of every query token."""
    return [(b, s - q + i) for b, (q, s) in enumerate(zip(batch.query_lens, batch.seq_lens))
            for i in range(q)]


def random_indices(batch: PagedBatch, topk: int, seed: int) -> torch.Tensor:
    """Per query, a random number (0 to topk) of distinct visible positions, the other
    entries -1, in random order."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _, pos in token_positions(batch):
        count = int(torch.randint(0, min(topk, pos + 1) + 1, (1,), generator=gen))
        chosen = torch.randperm(pos + 1, generator=gen)[:count].tolist()
        row = torch.tensor(chosen + [-1] * (topk - count), dtype=torch.int32)
        rows.append(row[torch.randperm(topk, generator=gen)])
    return torch.stack(rows)


def all_positions(batch: PagedBatch, topk: int) -> torch.Tensor:
    """Every visible position of each query, then -1."""
    return torch.tensor([list(range(pos + 1)) + [-1] * (topk - pos - 1)
                         for _, pos in token_positions(batch)], dtype=torch.int32)


def selected_rows(batch: PagedBatch, indices: torch.Tensor) -> list[torch.Tensor]:
    """Each query's selected rows [k, L + R] in float64, as the cache reads them back."""
    full = [batch.full_latents(b, through_cache=True) for b in range(len(batch.query_lens))]
    out = []
    for t, (b, pos) in enumerate(token_positions(batch)):
        chosen = [i for i in indices[t].tolist() if 0 <= i <= pos]
        out.append(full[b][chosen])
    return out


def latent_oracle(batch: PagedBatch, q_mqa: torch.Tensor, indices: torch.Tensor,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MQA over the selected rows: out [T, N, L], lse [N, T], float64."""
    L = batch.dims.kv_lora_rank
    T, N = q_mqa.shape[:2]
    out = torch.zeros(T, N, L, dtype=torch.float64)
    lse = torch.full((N, T), -math.inf, dtype=torch.float64)
    for t, rows in enumerate(selected_rows(batch, indices)):
        if rows.shape[0]:
            scores = q_mqa[t].double() @ rows.T * scale  # [N, k]
            lse[:, t] = torch.logsumexp(scores, dim=-1)
            out[t] = torch.softmax(scores, dim=-1) @ rows[:, :L]
    return out, lse


def layer_oracle(batch: PagedBatch, indices: torch.Tensor) -> torch.Tensor:
    """The non-absorbed MLA output [T, N * V] over each query's selected rows, float64."""
    d = batch.dims
    N, L, P, V = d.num_heads, d.kv_lora_rank, d.qk_nope_head_dim, d.v_head_dim
    w = batch.kv_b_proj.double().view(N, P + V, L)
    out = torch.zeros(batch.num_tokens, N, V, dtype=torch.float64)
    for t, rows in enumerate(selected_rows(batch, indices)):
        if not rows.shape[0]:
            continue
        k_nope = torch.einsum("sl,npl->nsp", rows[:, :L], w[:, :P])
        k = torch.cat([k_nope, rows[:, L:].expand(N, -1, -1)], dim=-1)
        v = torch.einsum("sl,nvl->nsv", rows[:, :L], w[:, P:])
        scores = torch.einsum("nd,nsd->ns", batch.q[t].double(), k) * batch.softmax_scale
        out[t] = torch.einsum("ns,nsv->nv", torch.softmax(scores, dim=-1), v)
    return out.view(batch.num_tokens, N * V)


def random_queries(batch: PagedBatch, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch.num_tokens, batch.dims.num_heads, batch.dims.cache_width)
    return torch.randn(*shape, generator=gen).to(batch.q.dtype)


def run_op(batch: PagedBatch, q_mqa: torch.Tensor, indices: torch.Tensor, scale: float,
           **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    return sparse_mla_attention(q_mqa, batch.cache.data, batch.cache.scale,
                                *batch_tensors(batch), indices, batch.dims.kv_lora_rank,
                                scale, **kwargs)


def check_lse(lse: torch.Tensor, want: torch.Tensor) -> None:
    empty = torch.isinf(want)
    assert torch.equal(torch.isneginf(lse), empty)
    torch.testing.assert_close(lse[~empty].double(), want[~empty], rtol=OP_TOL, atol=OP_TOL)


@pytest.mark.parametrize("kv_cache_dtype", CACHES)
@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_latent_oracle(case: str, kv_cache_dtype: str) -> None:
    batch = paged(case, kv_cache_dtype, seed=1)
    q_mqa = random_queries(batch, seed=2)
    indices = random_indices(batch, topk=8, seed=3)
    scale = batch.dims.cache_width**-0.5
    out, lse = run_op(batch, q_mqa, indices, scale)
    want_out, want_lse = latent_oracle(batch, q_mqa, indices, scale)
    assert out.shape == want_out.shape and out.dtype == q_mqa.dtype
    assert relative_error(out, want_out) < OP_TOL
    check_lse(lse, want_lse)


def test_op_bfloat16_queries() -> None:
    batch = paged("mixed", "fp8_ds_mla", seed=4, dtype=torch.bfloat16)
    q_mqa = random_queries(batch, seed=5)
    indices = random_indices(batch, topk=8, seed=6)
    scale = batch.dims.cache_width**-0.5
    out, lse = run_op(batch, q_mqa, indices, scale)
    want_out, _ = latent_oracle(batch, q_mqa, indices, scale)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert relative_error(out, want_out) < BF16_TOL


def test_query_without_positions_is_empty() -> None:
    batch = paged("mixed")
    q_mqa = random_queries(batch, seed=7)
    indices = random_indices(batch, topk=6, seed=8)
    indices[[0, 2]] = -1  # a decode token and a multi-token decode's first token
    out, lse = run_op(batch, q_mqa, indices, 0.2)
    assert torch.equal(out[[0, 2]], torch.zeros_like(out[[0, 2]]))
    assert torch.isneginf(lse[:, [0, 2]]).all()
    assert torch.isfinite(out).all()
    # No index slot at all: every query is empty.
    out, lse = run_op(batch, q_mqa, indices[:, :0], 0.2)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_positions_past_the_causal_limit_are_masked() -> None:
    batch = paged("decode2")
    q_mqa = random_queries(batch, seed=9)
    indices = random_indices(batch, topk=6, seed=10)
    future = indices.clone()
    for t, (b, pos) in enumerate(token_positions(batch)):
        unused = (future[t] == -1).nonzero().flatten().tolist()
        # The next position (for a first token, a row the cache holds), past the request's
        # length, past any block table.
        for slot, value in zip(unused, (pos + 1, batch.seq_lens[b] + 5, 10**6)):
            future[t, slot] = value
    assert not torch.equal(future, indices)
    out, lse = run_op(batch, q_mqa, future, 0.2)
    want_out, want_lse = run_op(batch, q_mqa, indices, 0.2)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
    with pytest.raises(ValueError, match="outside"):
        check_sparse_indices(future, batch.query_lens, batch.seq_lens)


def test_check_sparse_indices() -> None:
    batch = paged("mixed")
    indices = random_indices(batch, topk=6, seed=11)
    check_sparse_indices(indices, batch.query_lens, batch.seq_lens)
    check_sparse_indices(all_positions(batch, 75), batch.query_lens, batch.seq_lens)
    repeated = indices.clone()
    repeated[3, :2] = 1  # token 3 is at position 2 of request 1: 1 is visible
    with pytest.raises(ValueError, match=r"query token 3 .* 1 is repeated"):
        check_sparse_indices(repeated, batch.query_lens, batch.seq_lens)
    negative = indices.clone()
    negative[0, 0] = -2
    with pytest.raises(ValueError, match=r"query token 0 .* -2 is outside"):
        check_sparse_indices(negative, batch.query_lens, batch.seq_lens)
    with pytest.raises(TypeError, match="int32"):
        check_sparse_indices(indices.long(), batch.query_lens, batch.seq_lens)
    with pytest.raises(ValueError, match=r"shape \[12, topk\]"):
        check_sparse_indices(indices[1:], batch.query_lens, batch.seq_lens)


def _poison(batch: PagedBatch, b: int, pos: int) -> None:
    """NaN in one latent value of request b's row at position pos."""
    slot = batch.blocks[b][pos // batch.block_size] * batch.block_size + pos % batch.block_size
    row = batch.cache.data.view(-1, batch.cache.data.shape[-1])[slot]
    row[3] = 255 if row.dtype == torch.uint8 else math.nan  # 0xFF: an e4m3 NaN code


@pytest.mark.parametrize("kv_cache_dtype", CACHES)
def test_nan_reaches_exactly_the_queries_that_select_it(kv_cache_dtype: str) -> None:
    batch = paged("mixed", kv_cache_dtype, seed=12)
    q_mqa = random_queries(batch, seed=13)
    indices = random_indices(batch, topk=8, seed=14)
    tokens = token_positions(batch)
    request = 2  # the prefill: its 9 queries select different positions of its 70
    mine = [t for t, (b, _) in enumerate(tokens) if b == request]
    for t in mine:
        # Position 0 unselected: an unused entry's read falls back to it, and must not show.
        indices[t][indices[t] == 0] = -1
    chosen = {t: set(indices[t].tolist()) for t in mine}
    hit = next(p for p in range(70) if 0 < sum(p in chosen[t] for t in mine) < len(mine))
    _poison(batch, request, 0)
    out, lse = run_op(batch, q_mqa, indices, 0.2)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    _poison(batch, request, hit)
    out, lse = run_op(batch, q_mqa, indices, 0.2)
    reached = torch.isnan(out).any(dim=-1)  # [T, N]
    for t in range(batch.num_tokens):
        selects = t in chosen and hit in chosen[t]
        assert reached[t].all() if selects else not reached[t].any()
        assert torch.isnan(lse[:, t]).all() if selects else not torch.isnan(lse[:, t]).any()


@pytest.mark.parametrize("rows", [1, 3])
def test_chunked_queries_equal_one_chunk(rows: int) -> None:
    batch = paged("mixed", seed=15)
    q_mqa = random_queries(batch, seed=16)
    indices = random_indices(batch, topk=8, seed=17)
    N, width = batch.dims.num_heads, batch.dims.cache_width
    per_row = 8 * (3 * N + 2 * width)
    assert sparse_query_rows(N, width, 8, rows * per_row) == rows
    assert sparse_query_rows(N, width, 8, 1) == 1
    whole, whole_lse = run_op(batch, q_mqa, indices, 0.2)
    assert sparse_query_rows(N, width, 8, 1 << 26) >= batch.num_tokens
    out, lse = run_op(batch, q_mqa, indices, 0.2, chunk_elements=rows * per_row)
    torch.testing.assert_close(out, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-6, atol=1e-6)


def sparse_meta(batch: PagedBatch, topk: int) -> MLAMetadata:
    builder = MLAMetadataBuilder(batch.dims, block_size=batch.block_size, index_topk=topk)
    return builder.build(batch.spec)


def _layer(batch: PagedBatch, indices: torch.Tensor) -> torch.Tensor:
    """MLAAttention with the indices: the cache write, then sparse attention."""
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend="reference")
    meta = sparse_meta(batch, indices.shape[1])
    return attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta, indices=indices)


@pytest.mark.parametrize("kv_cache_dtype", CACHES)
@pytest.mark.parametrize("case", ["decode2", "mixed"])
def test_layer_matches_non_absorbed_oracle(case: str, kv_cache_dtype: str) -> None:
    batch = paged(case, kv_cache_dtype, seed=18)
    indices = random_indices(batch, topk=8, seed=19)
    out = _layer(batch, indices)
    d = batch.dims
    assert out.shape == (batch.num_tokens, d.num_heads * d.v_head_dim)
    assert relative_error(out, layer_oracle(batch, indices)) < LAYER_TOL


@pytest.mark.parametrize("case", list(CASES))
def test_all_positions_equal_dense_attention(case: str) -> None:
    """The selection of every visible position is dense MLA: the layer equals
    MLAAttention's decode and prefill paths and the dense float64 oracle."""
    batch = paged(case, seed=20)
    threshold = 2 if case == "decode2" else 1
    builder = MLAMetadataBuilder(batch.dims, block_size=batch.block_size,
                                 decode_threshold=threshold)
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend="reference")
    dense = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, builder.build(batch.spec))
    topk = max(batch.seq_lens) + 3
    assert sparse_meta(batch, max(batch.seq_lens)).sparse.dense
    assert not sparse_meta(batch, max(batch.seq_lens) - 1).sparse.dense
    sparse = _layer(batch, all_positions(batch, topk))
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)
    assert relative_error(sparse, batch.oracle(decode_threshold=threshold)) < LAYER_TOL


def test_sparse_mla_checks_its_arguments() -> None:
    batch = paged("mixed")
    attn = MLAAttention(batch.dims, kv_b_proj=batch.kv_b_proj, backend="reference")
    q_mqa = absorb_query(batch.q, attn.W_UK)
    indices = random_indices(batch, topk=4, seed=21)
    sparse = sparse_meta(batch, 4).sparse

    def call(**change):
        args = dict(q_mqa=q_mqa, indices=indices, cache=batch.cache, W_UV=attn.W_UV,
                    sparse=sparse, softmax_scale=0.1, ops=REFERENCE)
        return sparse_mla(**{**args, **change})

    with pytest.raises(ValueError, match="indices must be int32"):
        call(indices=indices.long())
    with pytest.raises(ValueError, match=r"indices must have shape \[12, 4\]"):
        call(indices=indices[1:])
    with pytest.raises(ValueError, match=r"q_mqa must have shape \[12, 4, 40\]"):
        call(q_mqa=batch.q)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[4\]"):
        call(sparse=replace(sparse, query_start_loc=sparse.query_start_loc[:-1]))
    with pytest.raises(TypeError, match="sparse must be SparseMetadata"):
        call(sparse=None)
    with pytest.raises(ValueError, match="W_UV must have shape"):
        call(W_UV=attn.W_UV[:2])
    with pytest.raises(TypeError, match="cache must be a LatentKVCache"):
        call(cache=batch.cache.data)
    with pytest.raises(ValueError, match="softmax_scale"):
        call(softmax_scale=0.0)
    with pytest.raises(ValueError, match=r"out must have shape \[12, 48\]"):
        call(out=torch.empty(12, 47))
    out = torch.full((12, 48), math.nan)
    assert call(out=out) is out and torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_layer_output_quantized_for_o_proj(backend: str) -> None:
    """Sparse attention's output as fp8 codes for o_proj (`ops/output_quant.py`): within
    e4m3's rounding (half a step: 2^-4 of a value, 2^-10 of its scale) of the oracle."""
    batch = paged("mixed", seed=21)
    indices = random_indices(batch, topk=8, seed=22)
    d = batch.dims
    width = d.num_heads * d.v_head_dim
    out = QuantizedOutput.empty(batch.num_tokens, width, OutputQuant(group=16), batch.q.device)
    attn = MLAAttention(d, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj,
                        backend=backend)
    attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, sparse_meta(batch, 8), out=out,
         indices=indices)
    ref = layer_oracle(batch, indices)
    step = out.scales.double().repeat_interleave(16, dim=1)
    bound = ref.abs() * 2.0**-4 + step * 2.0**-10 + 1e-5 * ref.abs().max()
    assert ((out.dequantize().double() - ref).abs() <= bound).all()
