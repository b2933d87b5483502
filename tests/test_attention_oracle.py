"""Every path of MLAAttention(backend="reference") against the dense float64 oracle.

Batches come from `pagedmla.testing.make_paged_batch`: block 0 reserved, the other
blocks permuted, NaN in every cache slot that holds no context row, block-table
padding that points far outside the cache. Each test draws fresh inputs from its own
seed. Tolerances (relative L2 error against the float64 oracle):

* float32 (auto or fp8 cache): 2e-4. Everything is computed in float32 from the same
  values the oracle sees (fp8: the oracle reads the same quantized latents), so the
  only difference is float32 rounding in sums of at most a few thousand terms
  (~1e-6 in practice); 2e-4 leaves a wide margin above that.
* bfloat16: 2e-2. Projections and attention run on bf16 inputs (8-bit mantissa,
  unit roundoff 4e-3); a few roundings of that size add up to under 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedmla import BatchSpec, MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.testing import PagedBatch, dense_mla_reference, make_paged_batch, relative_error

FLOAT32_TOL = 2e-4  # float32 paths vs the float64 oracle (see the module docstring)
BF16_TOL = 2e-2  # bfloat16 inputs, weights and cache (see the module docstring)

SMALL = MLADims(num_heads=16, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=24)
V2_LITE = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128)
V3 = MLADims(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
             v_head_dim=128, q_lora_rank=1536)


def run(
    batch: PagedBatch,
    decode_threshold: int = 1,
    workspace_rows: int | None = None,
):
    """Build the metadata for `batch`, run one forward step; returns (out, meta)."""
    builder = MLAMetadataBuilder(
        batch.dims, block_size=batch.block_size, workspace_rows=workspace_rows,
        decode_threshold=decode_threshold,
    )
    meta = builder.build(batch.spec)
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend="reference")
    out = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
    return out, meta


def check(batch: PagedBatch, out: torch.Tensor, decode_threshold: int, tol: float) -> float:
    """Output shape, no NaN, error vs the oracle below tol, cache written exactly."""
    d = batch.dims
    assert out.shape == (batch.num_tokens, d.num_heads * d.v_head_dim)
    assert out.dtype == batch.q.dtype
    assert not torch.isnan(out).any(), "NaN in the attention output"
    err = relative_error(out, batch.oracle(decode_threshold))
    assert err < tol, f"relative error {err:.3g} >= {tol} for {batch.query_lens=} {batch.seq_lens=}"
    mismatches = batch.cache_mismatches()
    assert mismatches == 0, f"{mismatches} cache slots differ from the expected cache"
    return err


def run_and_check(batch: PagedBatch, decode_threshold: int = 1,
                  workspace_rows: int | None = None, tol: float = FLOAT32_TOL):
    out, meta = run(batch, decode_threshold, workspace_rows)
    check(batch, out, decode_threshold, tol)
    return meta


# --- decode ------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_only(block_size: int) -> None:
    # Seq lens not multiples of the page size, a decode with no context (seq_len 1).
    batch = make_paged_batch(SMALL, [1] * 6, [1, 17, 33, 100, 5, 64], block_size,
                             seed=100 + block_size)
    meta = run_and_check(batch)
    assert meta.num_decodes == 6 and meta.prefill is None


@pytest.mark.parametrize("threshold", [2, 4, 8])
def test_multi_token_decode_uniform(threshold: int) -> None:
    # Every request has q_len == threshold: all decode, bottom-right causal in the MQA path.
    q_lens = [threshold] * 4
    seq_lens = [threshold, threshold + 13, 70, 129]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, 16, seed=200 + threshold)
    meta = run_and_check(batch, decode_threshold=threshold)
    assert meta.num_decodes == 4 and meta.num_decode_tokens == 4 * threshold
    assert meta.prefill is None


@pytest.mark.parametrize("threshold", [2, 4, 8])
def test_multi_token_decode_mixed_lengths(threshold: int) -> None:
    # Varlen decodes (1..threshold tokens) followed by prefills just above the threshold.
    q_lens = [1, threshold, max(1, threshold // 2), threshold, threshold + 1, threshold + 5]
    seq_lens = [30, threshold + 2, 45, 200, threshold + 1, 90]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, 16, seed=300 + threshold)
    meta = run_and_check(batch, decode_threshold=threshold)
    assert meta.num_decodes == 4 and meta.num_prefills == 2


# --- prefill -----------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_mixed_batch(block_size: int) -> None:
    q_lens = [1, 1, 1, 7, 13, 5]
    seq_lens = [3, 1, 80, 7, 150, 40]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, block_size, seed=400 + block_size)
    meta = run_and_check(batch)
    assert (meta.num_decodes, meta.num_prefills) == (3, 3)
    assert meta.num_decode_tokens == 3 and meta.num_prefill_tokens == 25


def test_prefill_without_context() -> None:
    batch = make_paged_batch(SMALL, [9, 33, 2, 17], [9, 33, 2, 17], 16, seed=500)
    meta = run_and_check(batch)
    assert meta.num_decodes == 0 and meta.prefill is not None
    assert meta.prefill.context is None


def test_prefill_with_long_context_one_chunk() -> None:
    # 1000 context rows fit the default workspace: one chunk, no continuation.
    batch = make_paged_batch(SMALL, [20, 3], [1020, 50], 16, seed=600)
    meta = run_and_check(batch)
    chunks = meta.prefill.context.chunks
    assert len(chunks) == 1 and not chunks[0].is_continuation


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_forced_chunking_with_continuations(block_size: int) -> None:
    # Workspace of two pages against contexts of hundreds: many chunks, continuations,
    # plus a context-free prefill between two with context and a decode in front.
    q_lens = [1, 11, 6, 9, 4]
    contexts = [40, 300, 0, 2 * block_size + 5, 257]
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, block_size, seed=700 + block_size)
    meta = run_and_check(batch, workspace_rows=2 * block_size)
    chunks = meta.prefill.context.chunks
    assert len(chunks) >= 5
    assert sum(c.is_continuation for c in chunks) >= 2
    assert all(c.num_context_tokens <= 2 * block_size for c in chunks)
    assert meta.prefill.context.empty_token_slices == [slice(11, 17)]


def test_forced_chunking_packs_several_requests_per_chunk() -> None:
    # Workspace 48 rows, block 16: small contexts share a chunk; the long one is split,
    # and its remainder (a continuation) shares a chunk with the next request.
    q_lens = [5, 3, 7, 2, 6]
    contexts = [10, 20, 100, 4, 30]
    seq_lens = [q + c for q, c in zip(q_lens, contexts)]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, 16, seed=800)
    meta = run_and_check(batch, workspace_rows=48)
    chunks = meta.prefill.context.chunks
    assert any(c.request_slice.stop - c.request_slice.start >= 2 for c in chunks)
    assert any(c.is_continuation and c.request_slice.stop - c.request_slice.start >= 2
               for c in chunks)


def test_slot_minus_one_is_not_written() -> None:
    # Prefill tokens attend to their new latents directly, so skipping their cache write
    # (slot -1) leaves the output unchanged and those slots untouched (still NaN).
    batch = make_paged_batch(SMALL, [6, 9], [6, 40], 16, seed=900)
    batch.spec.slot_mapping[[0, 2, 7]] = -1
    meta = run_and_check(batch)
    assert meta.num_prefills == 2


# --- heads, dims, NoPE --------------------------------------------------------------------


@pytest.mark.parametrize("num_heads", [1, 16, 128])
def test_head_counts(num_heads: int) -> None:
    dims = MLADims(num_heads=num_heads, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16)
    batch = make_paged_batch(dims, [1, 2, 6], [10, 3, 37], 16, seed=1000 + num_heads)
    run_and_check(batch, decode_threshold=2, workspace_rows=16)


def test_deepseek_v2_lite_dims_mixed_chunked() -> None:
    q_lens = [1, 1, 12, 5]
    seq_lens = [70, 19, 12, 205]
    batch = make_paged_batch(V2_LITE, q_lens, seq_lens, 16, seed=1100)
    meta = run_and_check(batch, workspace_rows=64)
    assert len(meta.prefill.context.chunks) == 4


def test_deepseek_v3_dims_small() -> None:
    # 128 heads with the real V3 widths; T and S kept tiny to stay fast on a CPU.
    batch = make_paged_batch(V3, [1, 2, 4], [9, 20, 24], 16, seed=1200)
    run_and_check(batch, decode_threshold=2, workspace_rows=16)


def test_nope_mla() -> None:
    # R = 0: keys are the up-projected latents alone; cache rows are L wide.
    dims = MLADims(num_heads=8, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=0,
                   v_head_dim=16)
    batch = make_paged_batch(dims, [1, 3, 8, 5], [33, 3, 8, 120], 16, seed=1300)
    assert batch.cache.data.shape[-1] == 48
    meta = run_and_check(batch, decode_threshold=3, workspace_rows=32)
    assert len(meta.prefill.context.chunks) >= 4


# --- cache dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", torch.float8_e4m3fn])
def test_fp8_cache_non_power_of_two_scale(kv_cache_dtype) -> None:
    # Decodes read their new tokens back quantized, prefills use theirs unquantized; the
    # oracle sees exactly those values, so the float32 tolerance applies.
    q_lens = [1, 1, 3, 10, 7]
    seq_lens = [50, 1, 60, 10, 230]
    batch = make_paged_batch(SMALL, q_lens, seq_lens, 16, kv_cache_dtype=kv_cache_dtype,
                             fp8_scale=0.37, seed=1400)
    assert batch.cache.is_fp8 and batch.cache.data.dtype == torch.float8_e4m3fn
    assert math.isclose(batch.cache.scale.item(), 0.37, rel_tol=1e-6)
    meta = run_and_check(batch, decode_threshold=4, workspace_rows=32)
    assert len(meta.prefill.context.chunks) >= 7


def test_fp8_decode_really_reads_quantized_new_tokens() -> None:
    # Guard on the oracle itself: for fp8 the decode answer must differ measurably from
    # the one computed with unquantized new tokens (else the fp8 test proves nothing).
    batch = make_paged_batch(SMALL, [4, 4], [4, 30], 16, kv_cache_dtype="fp8",
                             fp8_scale=0.37, seed=1500)
    out, _ = run(batch, decode_threshold=4)
    check(batch, out, 4, FLOAT32_TOL)
    assert relative_error(out, batch.oracle(decode_threshold=0)) > 10 * FLOAT32_TOL


def test_bfloat16_mixed_batch() -> None:
    q_lens = [1, 2, 9, 12]
    seq_lens = [77, 30, 9, 300]
    batch = make_paged_batch(V2_LITE, q_lens, seq_lens, 16, dtype=torch.bfloat16, seed=1600)
    run_and_check(batch, decode_threshold=2, workspace_rows=128, tol=BF16_TOL)


def test_bfloat16_context_in_many_chunks_keeps_its_precision() -> None:
    # A 3000-token context in chunks of 4 rows, 750 merges: the running partial is held
    # in float32, so every query row is as close to the oracle as with one chunk. Merged
    # in bf16, each merge would round it, and the worst row here would be ~5% off.
    dims = MLADims(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                   v_head_dim=32)
    batch = make_paged_batch(dims, [5], [3005], 4, dtype=torch.bfloat16, seed=1610)
    out, meta = run(batch, workspace_rows=4)
    assert meta.prefill is not None and meta.prefill.context is not None
    assert len(meta.prefill.context.chunks) == 750
    want = batch.oracle().view(5, 4, 32)
    err = (out.double().view(5, 4, 32) - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.max() < 1e-2, f"worst row's relative error {err.max():.3g}"


# --- across steps ----------------------------------------------------------------------------


def test_decode_after_prefill_reads_what_the_prefill_wrote() -> None:
    # Step 1 prefills a prompt into an empty (NaN) cache; step 2 decodes 2 tokens per
    # request with the same block tables. Step 2 must equal one dense computation over
    # the prompt's and the new latents.
    dims = SMALL
    prompt = [21, 40]
    first = make_paged_batch(dims, prompt, prompt, 16, seed=1700)
    run_and_check(first)
    gen = torch.Generator().manual_seed(1701)
    q_lens, seq_lens = [2, 2], [p + 2 for p in prompt]
    slots = [first.blocks[b][p // 16] * 16 + p % 16
             for b in range(2) for p in range(prompt[b], seq_lens[b])]
    spec = BatchSpec(q_lens, seq_lens, first.spec.block_table,
                     torch.tensor(slots, dtype=torch.int64))
    q = torch.randn(4, dims.num_heads, dims.qk_head_dim, generator=gen)
    kv_c = torch.randn(4, dims.kv_lora_rank, generator=gen)
    k_pe = torch.randn(4, dims.qk_rope_head_dim, generator=gen)
    meta = MLAMetadataBuilder(dims, block_size=16, decode_threshold=2).build(spec)
    attn = MLAAttention(dims, kv_b_proj=first.kv_b_proj, backend="reference")
    out = attn(q, kv_c, k_pe, first.cache, meta)
    refs = []
    for b in range(2):
        rows = slice(2 * b, 2 * b + 2)
        lat = torch.cat([first.kv_c[first.token_slices[b]], kv_c[rows]])
        pe = torch.cat([first.k_pe[first.token_slices[b]], k_pe[rows]])
        refs.append(dense_mla_reference(q[rows], lat, pe, first.kv_b_proj,
                                        dims.qk_head_dim**-0.5, 2))
    assert relative_error(out, torch.cat(refs)) < FLOAT32_TOL


# --- random batch compositions ----------------------------------------------------------------


@st.composite
def batch_compositions(draw):
    threshold = draw(st.sampled_from([1, 2, 4]))
    block_size = draw(st.sampled_from([1, 4, 16]))
    decodes = draw(st.lists(st.tuples(st.integers(1, threshold), st.integers(0, 70)),
                            max_size=4))
    prefills = draw(st.lists(st.tuples(st.integers(threshold + 1, threshold + 12),
                                       st.integers(0, 150)), max_size=3))
    if not decodes and not prefills:
        prefills = [(threshold + 1, 0)]
    requests = decodes + prefills
    q_lens = [q for q, _ in requests]
    seq_lens = [q + c for q, c in requests]
    workspace = draw(st.sampled_from([None, 1, 2, 3, 8]))
    workspace_rows = None if workspace is None else workspace * max(block_size, 8)
    cache_dtype = draw(st.sampled_from(["auto", "fp8"]))
    rope = draw(st.sampled_from([0, 8]))
    seed = draw(st.integers(0, 2**31 - 1))
    return threshold, block_size, q_lens, seq_lens, workspace_rows, cache_dtype, rope, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch_compositions())
def test_random_batches_match_oracle(case) -> None:
    # Any mix of (multi-token) decodes, prefills, contexts, pages, workspaces, cache dtypes.
    threshold, block_size, q_lens, seq_lens, workspace_rows, cache_dtype, rope, seed = case
    dims = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=rope,
                   v_head_dim=8)
    batch = make_paged_batch(dims, q_lens, seq_lens, block_size, kv_cache_dtype=cache_dtype,
                             fp8_scale=0.37, seed=seed)
    run_and_check(batch, decode_threshold=threshold, workspace_rows=workspace_rows)
