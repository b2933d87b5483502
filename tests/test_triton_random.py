"""The triton backend on seeded random calls on the GPU: its ops against the reference
ops, and MLAAttention(backend="triton") against the float64 dense oracle.

tests/test_triton_<op>.py vary one or two of a call's choices at a time; here every
case draws all of them at once: heads 1-128, page sizes 1-128 (powers of two and
not), query lengths 0-16 per request (0: a CUDA graph's padding request), contexts
from 1 to ~70k positions, bf16/fp16 queries with a cache of their dtype or fp8, NoPE
and narrower latents, caches and queries as strided views, and host bounds above the
batch's true lengths (as a CUDA graph passes them); the layer cases add mixed batches
of decodes and prefills, three head shapes and workspaces that cut the context into
many chunks. Such combinations reach what those files' matrices do not: a launch
grid's axis overflowing at 128 heads x 512 tokens, a prefill without any key on
Hopper, the chunked context's precision as the chunk count grows.

The `small` cases draw the same way at interpreter sizes (the layer's with the cost
model routing extends, too) and run everywhere, CI's CPU included.

Each case draws from its own seed, the case number in the test's id, so a failure
reproduces alone (`-k "random and [17]"`). Outputs are checked row by row as well as
as a whole: a single wrong (token, head) row among thousands would pass a relative
error over the whole output. Tolerances are those of tests/triton_helpers.py for
16-bit inputs (bf16's, which bound fp16 too).
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.ops import reference as ref
from pagedmla.routing import PathCostModel
from pagedmla.testing import make_paged_batch, relative_error
from tests.triton_helpers import (
    DEVICE,
    FP8,
    TINY_DECODE,
    _bits,
    _check_decode,
    _check_varlen,
    _cu,
    _decode_case,
    _paged_cache,
    _run_layer,
    cuda,
    runnable,
)

pytest.importorskip("triton")

from pagedmla.ops.triton import (
    gather_cache,
    merge_attn_states,
    prefill_attention,
    varlen_attention,
    write_cache,
)

CASES = 48
HEADS = (1, 2, 3, 8, 16, 17, 24, 32, 48, 64, 100, 128)
PAGES = (1, 2, 5, 8, 16, 24, 32, 48, 64, 100, 128)
# (L, R): DeepSeek's widths (the Gluon kernels' only ones) three times in five.
WIDTHS = ((512, 64), (512, 64), (512, 64), (512, 0), (256, 64))
# The reference pads a batch to [B, max_query_len x N, max_seq_len] float32 scores:
# cases keep that below ~1.2 GB so that parallel workers fit beside each other.
MAX_SCORES = 3 * 10**8
ROW_RTOL = 5e-2  # a (token, head) row's relative error; a wrong row is ~1 or NaN
# merge's (atol, rtol) per output dtype: about two units in the last place.
MERGE_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2e-3),
             torch.bfloat16: (1e-2, 1.6e-2)}


def _row_errors(out: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Relative L2 error of each row [T, N] of out against want [T, N, D], in float64;
    rows whose reference is 0 (no key in sight) count their absolute error."""
    out, want = out.double(), want.double()
    err = torch.linalg.vector_norm(out - want, dim=-1)
    norm = torch.linalg.vector_norm(want, dim=-1)
    return torch.where(norm > 0, err / norm.clamp_min(1e-300), err)


def _assert_rows_close(out: torch.Tensor, want: torch.Tensor, rtol: float = ROW_RTOL,
                       desc: str = "") -> None:
    """Every (token, head) row of out [T, N, D] within rtol of want's (`_row_errors`)."""
    worst = _row_errors(out.cpu(), want.cpu()).max().item()
    assert worst < rtol, f"{desc}: worst row's relative error {worst:.3g}"


def _context_len(rng: random.Random, page: int, q_len: int, longest: int) -> int:
    """A request's context length: short, a whole number of pages, a few thousand, or
    long, at least q_len (its query tokens are its last positions)."""
    kind = rng.choice(("short", "pages", "mid", "long"))
    if kind == "short":
        n = rng.randint(1, 100)
    elif kind == "pages":
        n = page * rng.randint(1, max(1, 4096 // page))
    elif kind == "mid":
        n = rng.randint(100, 6000)
    else:
        n = rng.randint(6000, 70000)
    return max(q_len, min(n, longest))


def _strided_view(rng: random.Random, data: torch.Tensor) -> tuple[torch.Tensor, str]:
    """The cache as given, as rows of a wider buffer, or as every other page of a bigger
    one (NaN in what the view leaves out): the three layouts a caller may pass."""
    layout = rng.choice(("contiguous", "contiguous", "padded-rows", "every-other-page"))
    if layout == "padded-rows":
        wide = torch.full((*data.shape[:2], data.shape[2] + 64), math.nan,
                          device=data.device).to(data.dtype)
        wide[..., :data.shape[2]] = data
        return wide[..., :data.shape[2]], layout
    if layout == "every-other-page":
        spread = torch.full((2 * data.shape[0], *data.shape[1:]), math.nan,
                            device=data.device).to(data.dtype)
        spread[::2] = data
        return spread[::2], layout
    return data, layout


def _raise_seq_bound(args: list, by: int, page: int) -> None:
    """Raise a decode call's max_seq_len (args[7]) by `by`, as a CUDA graph passes a
    bound above the batch's lengths, and widen its block table (args[3]) with entries
    far outside the cache to cover it, as a graph's covers the model's length."""
    args[7] += by
    table = args[3]
    extra = -(-args[7] // page) - table.shape[1]
    if extra > 0:
        args[3] = torch.cat([table, torch.full_like(table[:, :1], 10**6).expand(-1, extra)], 1)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", range(CASES))
def test_decode_gpu_random(case: int) -> None:
    rng = random.Random(7000 + case)
    num_heads, page = rng.choice(HEADS), rng.choice(PAGES)
    L, R = rng.choice(WIDTHS)
    dtype = rng.choice((torch.bfloat16, torch.float16))
    cache_dtype = rng.choice((dtype, FP8))
    max_q = rng.choice((1, 1, 1, 2, 3, 4, 8, 16))
    num_reqs = rng.randint(1, 8)
    longest = max(100, min(70000, MAX_SCORES // (num_reqs * max_q * num_heads)))
    q_lens = [rng.randint(1, max_q) for _ in range(num_reqs)]
    seq_lens = [_context_len(rng, page, q, longest) for q in q_lens]
    if rng.random() < 0.25:  # a graph's padding request: no token, no context
        at = rng.randint(0, num_reqs)
        q_lens.insert(at, 0)
        seq_lens.insert(at, 0)
    args = list(_decode_case(q_lens, seq_lens, num_heads, L, R, page, dtype, cache_dtype,
                             seed=7000 + case, device="cuda"))
    args[1], layout = _strided_view(rng, args[1])
    if rng.random() < 0.3:  # q as a view with a row stride wider than its width
        q = args[0]
        wide = torch.full((*q.shape[:2], q.shape[2] + 32), math.nan, device="cuda",
                          dtype=dtype)
        wide[..., :q.shape[2]] = q
        args[0] = wide[..., :q.shape[2]]
    # Host bounds above the true lengths, as a CUDA graph's.
    args[6] = max(args[6], max_q if rng.random() < 0.5 else 0)
    _raise_seq_bound(args, rng.choice((0, 0, 1, 777)), page)
    desc = (f"N={num_heads} page={page} L,R={L},{R} {dtype} cache={cache_dtype} "
            f"{layout} q_lens={q_lens} seq_lens={seq_lens} bounds={args[6]},{args[7]}")

    print(desc)  # pytest shows it when the case fails
    out, want = _check_decode(tuple(args), torch.bfloat16)
    _assert_rows_close(out, want, desc=desc)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", range(CASES))
def test_prefill_gpu_random(case: int) -> None:
    rng = random.Random(8000 + case)
    qk, dv = rng.choice(((192, 128), (192, 128), (256, 256), (128, 128), (64, 64)))
    num_heads = rng.choice(HEADS)
    dtype = rng.choice((torch.bfloat16, torch.float16))
    causal = rng.random() < 0.6
    fn = rng.choice((varlen_attention, prefill_attention))
    num_seqs = rng.randint(1, 6)
    longest = 6000
    q_lens = [rng.choice((0, 1, rng.randint(2, 200), rng.randint(200, longest)))
              for _ in range(num_seqs)]
    if causal:  # new tokens after a context (bottom-right), now and then fewer keys
        k_lens = [max(0, q + rng.choice((0, 0, rng.randint(1, 2000), -rng.randint(1, 50))))
                  for q in q_lens]
    else:  # a context chunk: any number of keys
        k_lens = [rng.choice((0, rng.randint(1, longest))) for _ in range(num_seqs)]
    if sum(q_lens) == 0:
        q_lens[0] = 1
        k_lens[0] = max(k_lens[0], 1)
    print(f"N={num_heads} qk,dv={qk},{dv} {dtype} causal={causal} {fn.__module__} "
          f"q_lens={q_lens} k_lens={k_lens}")
    out, want = _check_varlen(q_lens, k_lens, num_heads, qk, dv, dtype, causal,
                              seed=8000 + case, device="cuda", fn=fn)
    _assert_rows_close(out, want)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", range(CASES // 2))
def test_cache_ops_gpu_random(case: int) -> None:
    # Write then gather: data movement, so bit for bit the reference ops' result.
    rng = random.Random(9000 + case)
    gen = torch.Generator().manual_seed(9000 + case)
    page = rng.choice(PAGES)
    L, R = rng.choice(WIDTHS)
    dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
    cache_dtype = rng.choice((dtype, FP8))
    num_blocks = rng.randint(2, 4000 // page + 2)
    num_tokens = rng.randint(1, num_blocks * page)
    scale = torch.tensor(rng.choice((1.0, 0.37, 3.0)), device="cuda")
    # Large enough values that fp8 saturates at +-448 after x / scale.
    kv_c = (torch.randn(num_tokens, L, generator=gen) * 200).to("cuda", dtype)
    k_pe = torch.randn(num_tokens, R, generator=gen).to("cuda", dtype)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.1] = -1
    slots = slots.to("cuda")
    data = torch.full((num_blocks, page, L + R), math.nan, device="cuda").to(cache_dtype)
    want = data.clone()
    write_cache(data, kv_c, k_pe, slots, scale)
    ref.write_cache(want, kv_c, k_pe, slots, scale)
    assert torch.equal(_bits(data), _bits(want))

    contexts = [rng.randint(1, 3000) for _ in range(rng.randint(1, 5))]
    cache, table = _paged_cache(contexts, page, L + R, cache_dtype, gen, 0.37, "cuda")
    starts = [rng.randint(0, n - 1) for n in contexts]
    counts = [rng.randint(0, n - s) for n, s in zip(contexts, starts)]
    if sum(counts) == 0:
        counts[0] = 1
    token_to_seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    args = (cache, torch.tensor(0.37, device="cuda"), table,
            torch.tensor(starts, dtype=torch.int32, device="cuda"), _cu(counts, "cuda"),
            token_to_seq.to("cuda", torch.int32))
    out_dtype = dtype if cache_dtype != FP8 else rng.choice((torch.bfloat16, torch.float32))
    out = torch.full((sum(counts), L + R), math.nan, dtype=out_dtype, device="cuda")
    expected = torch.empty_like(out)
    gather_cache(*args, out)
    ref.gather_cache(*args, expected)
    assert not out.isnan().any()
    assert torch.equal(_bits(out), _bits(expected))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", range(CASES // 2))
def test_merge_gpu_random(case: int) -> None:
    # Empty partials (lse -inf, or +inf as some backends write; NaN behind them) at
    # random, both at once in places; the result in place over the prefix now and then.
    rng = random.Random(9500 + case)
    gen = torch.Generator().manual_seed(9500 + case)
    T, N = rng.randint(1, 20000), rng.choice(HEADS)
    D = rng.choice((128, 512, 96, 192, 64))
    dtype = rng.choice((torch.bfloat16, torch.float16, torch.float32))
    po, so = (torch.randn(T, N, D, generator=gen).to("cuda", dtype) for _ in range(2))
    pl, sl = ((torch.randn(N, T, generator=gen) * 5).cuda() for _ in range(2))
    for lse, out, empty in ((pl, po, -math.inf), (sl, so, rng.choice((-math.inf, math.inf)))):
        gone = torch.rand(N, T, generator=gen).cuda() < rng.choice((0.0, 0.1, 0.5))
        lse[gone] = empty
        out[gone.T] = math.nan
    want, want_lse = torch.empty_like(po), torch.empty_like(pl)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    in_place = rng.random() < 0.3
    out = po if in_place else torch.full_like(po, math.nan)
    out_lse = pl if in_place else torch.full_like(pl, math.nan)
    merge_attn_states(po, pl, so, sl, out, out_lse)
    assert not out.isnan().any() and not out_lse.isnan().any()
    # Both round the same float32 sum to dtype: a unit in the last place apart at most.
    atol, rtol = MERGE_TOL[dtype]
    torch.testing.assert_close(out.float(), want.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-6)


# The layer's shapes: DeepSeek-V3's (L 512, R 64, P 128, V 128), GLM-5-style wider heads
# (qk 256 = P 192 + R 64, V 256) and NoPE (R = 0).
LAYER_DIMS = ((512, 128, 64, 128), (512, 128, 64, 128), (512, 192, 64, 256), (512, 128, 0, 128))


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("case", range(CASES // 2))
def test_layer_gpu_random(case: int) -> None:
    # MLAAttention(backend="triton") on a random mixed batch (decodes of up to
    # decode_threshold tokens first, then prefills with and without context, the
    # context cut into chunks by a small workspace now and then) against the float64
    # dense oracle, which shares no code with it.
    rng = random.Random(9700 + case)
    L, P, R, V = rng.choice(LAYER_DIMS)
    dims = MLADims(num_heads=rng.choice(HEADS), kv_lora_rank=L, qk_nope_head_dim=P,
                   qk_rope_head_dim=R, v_head_dim=V)
    page = rng.choice(PAGES)
    threshold = rng.choice((1, 1, 2, 4, 16))
    cache_dtype = rng.choice(("auto", "fp8"))
    # The oracle holds a request's keys and values ([seq_len, N, P + V]) and scores
    # ([N, q_len, seq_len]) in float64: ~1.6 GB at most.
    longest = min(20000, 2 * 10**8 // (dims.num_heads * (P + V)))
    budget = 10**8 // dims.num_heads  # q_len x seq_len
    q_lens, seq_lens = [], []
    for _ in range(rng.randint(0, 6)):  # decodes
        q = rng.randint(1, threshold)
        q_lens.append(q)
        seq_lens.append(q + rng.choice((0, rng.randint(1, 100), rng.randint(100, longest))))
    for _ in range(rng.randint(0 if q_lens else 1, 4)):  # prefills
        q = rng.randint(threshold + 1, threshold + rng.choice((8, 300, 1500)))
        q = min(q, max(threshold + 1, math.isqrt(budget)))
        context = rng.choice((0, rng.randint(1, 200), rng.randint(200, 6000)))
        context = min(context, max(0, budget // q - q), longest - q)
        q_lens.append(q)
        seq_lens.append(q + context)
    workspace = rng.choice((None, None, page * rng.randint(1, 8), 4096))
    workspace = None if workspace is None else max(workspace, page)
    print(f"{dims} page={page} threshold={threshold} cache={cache_dtype} "
          f"workspace={workspace} q_lens={q_lens} seq_lens={seq_lens}")
    batch = make_paged_batch(dims, q_lens, seq_lens, page, dtype=torch.bfloat16,
                             kv_cache_dtype=cache_dtype, fp8_scale=0.37, seed=9700 + case,
                             device="cuda")
    out = _run_layer(batch, "triton", decode_threshold=threshold, workspace_rows=workspace)
    want = batch.oracle(decode_threshold=threshold)
    assert relative_error(out, want) < 2e-2
    _assert_rows_close(out.view(-1, dims.num_heads, V), want.view(-1, dims.num_heads, V))
    assert batch.cache_mismatches() == 0


# --- small random calls, also on the CPU (CI: Triton's interpreter) ----------------------


@runnable
@pytest.mark.parametrize("case", range(24))
def test_decode_random_small(case: int) -> None:
    # The same draws at interpreter sizes, on float32/float16 (the interpreter's bf16
    # products are wrong, see tests/triton_helpers.py), through the small-tile configs
    # (both product formulations, bulk copies and the row gather) and the default one.
    rng = random.Random(6000 + case)
    num_heads, page = rng.randint(1, 8), rng.choice((1, 2, 3, 8, 16, 24))
    L, R = rng.choice(((32, 16), (48, 0), (64, 8), (32, 32)))
    dtype = rng.choice((torch.float32, torch.float16))
    cache_dtype = rng.choice((dtype, FP8))
    config = rng.choice((TINY_DECODE, replace(TINY_DECODE, swap_ab=True),
                         replace(TINY_DECODE, paged=False), None))
    q_lens = [rng.randint(0, 4) for _ in range(rng.randint(1, 4))]
    seq_lens = [q + rng.choice((0, rng.randint(1, 40), rng.randint(40, 200))) if q else 0
                for q in q_lens]
    if not any(q_lens):
        q_lens[0], seq_lens[0] = 1, 1
    args = list(_decode_case(q_lens, seq_lens, num_heads, L, R, page, dtype, cache_dtype,
                             seed=6000 + case))
    args[1], layout = _strided_view(rng, args[1])
    _raise_seq_bound(args, rng.choice((0, 5)), page)
    print(f"N={num_heads} page={page} L,R={L},{R} {dtype} cache={cache_dtype} {layout} "
          f"{config} q_lens={q_lens} seq_lens={seq_lens}")
    out, want = _check_decode(tuple(args), dtype, config=config,
                              num_splits=rng.choice((None, 1, 3)))
    _assert_rows_close(out, want)


@runnable
@pytest.mark.parametrize("case", range(24))
def test_prefill_random_small(case: int) -> None:
    rng = random.Random(6500 + case)
    qk, dv = rng.choice(((48, 24), (24, 8), (16, 16), (192, 128), (64, 64)))
    causal = rng.random() < 0.6
    q_lens = [rng.choice((0, 1, rng.randint(2, 70))) for _ in range(rng.randint(1, 4))]
    if causal:
        k_lens = [max(0, q + rng.choice((0, rng.randint(1, 60), -rng.randint(1, 5))))
                  for q in q_lens]
    else:
        k_lens = [rng.choice((0, rng.randint(1, 90))) for _ in q_lens]
    if sum(q_lens) == 0:
        q_lens[0] = 1
    print(f"qk,dv={qk},{dv} causal={causal} q_lens={q_lens} k_lens={k_lens}")
    out, want = _check_varlen(q_lens, k_lens, rng.randint(1, 4), qk, dv,
                              rng.choice((torch.float32, torch.float16)), causal,
                              seed=6500 + case, device=DEVICE,
                              fn=rng.choice((varlen_attention, prefill_attention)))
    _assert_rows_close(out, want)


@runnable
@pytest.mark.parametrize("case", range(16))
def test_layer_random_small(case: int) -> None:
    # MLAAttention(backend="triton") in float32 against the float64 oracle on random
    # small layers and batches: multi-token decodes, prefills with contexts cut into
    # chunks, pages of 1-16, fp8 caches, and now and then the cost model routing
    # extends to the MQA path (requests it routes there are put first, as the builder
    # asks; only with a 16/32-bit cache, where both paths read the same keys).
    rng = random.Random(5000 + case)
    dims = MLADims(num_heads=rng.randint(1, 6), kv_lora_rank=rng.choice((32, 48, 64)),
                   qk_nope_head_dim=rng.choice((16, 32)),
                   qk_rope_head_dim=rng.choice((0, 8, 16)), v_head_dim=rng.choice((8, 24)))
    page, threshold = rng.choice((1, 2, 3, 16)), rng.choice((1, 2, 4))
    cache_dtype = rng.choice(("auto", "fp8"))
    router = PathCostModel() if cache_dtype == "auto" and rng.random() < 0.5 else None
    requests = [(q, q + rng.choice((0, rng.randint(1, 40), rng.randint(40, 300))))
                for q in (rng.randint(1, threshold) for _ in range(rng.randint(0, 3)))]
    requests += [(q, q + rng.choice((0, rng.randint(1, 300))))
                 for q in (rng.randint(threshold + 1, threshold + 40)
                           for _ in range(rng.randint(0 if requests else 1, 3)))]
    builder = MLAMetadataBuilder(dims, block_size=page, device=DEVICE,
                                 workspace_rows=rng.choice((None, page, 4 * page, 64 * page)),
                                 decode_threshold=threshold, router=router)
    requests.sort(key=lambda r: not builder.uses_mqa(r[0], r[1] - r[0]))
    q_lens, seq_lens = [q for q, _ in requests], [s for _, s in requests]
    print(f"{dims} page={page} threshold={threshold} cache={cache_dtype} router={router} "
          f"workspace={builder.workspace_rows} q_lens={q_lens} seq_lens={seq_lens}")
    batch = make_paged_batch(dims, q_lens, seq_lens, page, kv_cache_dtype=cache_dtype,
                             fp8_scale=0.37, seed=5000 + case, device=DEVICE)
    attn = MLAAttention(dims, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj,
                        backend="triton")
    out = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, builder.build(batch.spec))
    want = batch.oracle(decode_threshold=threshold)
    assert relative_error(out, want) < 2e-4
    rows = (-1, dims.num_heads, dims.v_head_dim)
    _assert_rows_close(out.view(rows), want.view(rows), rtol=1e-3)
    assert batch.cache_mismatches() == 0
