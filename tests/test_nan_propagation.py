"""A NaN in any input reaches every output row that depends on it, on every path
(decode, prefill without context, prefill with chunked context) and backend.

A NaN is planted in one place of a random batch (`make_paged_batch`): a query row of
one head, a new token's latent, or a cached context latent. The oracle of what depends
on it is the attention's structure, not the code under test: a query row only feeds its
own token's output for its own head; a latent feeds every head of every token that sees
its position (bottom-right causal: every new token sees the whole context, new token i
sees new tokens 0..i). Everything else must stay finite, and an empty partial (lse -inf)
must still mean "no key", never NaN. On the CPU the triton backend runs in Triton's
interpreter; the cuda cases run the GPU kernels at DeepSeek's widths (the Gluon kernels
on Hopper), with 16-bit and fp8 caches.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.ops.registry import get_backend
from pagedmla.testing import PagedBatch, make_paged_batch

# Triton's interpreter reduces with numpy, which warns on the NaN rows these tests plant.
pytestmark = pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")

SMALL = MLADims(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=24)
V2_LITE = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128)
V3_HEADS = MLADims(num_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)

# (query_lens, seq_lens, chunked: a workspace of one page, so that the last request's
# context takes several chunks): the request that gets the NaN is the last one.
PATHS = {
    "decode": ([1, 1, 1], [9, 40, 70], False),
    "decode, split-KV": ([1, 1], [40, 900], False),  # the long request is cut into splits
    "prefill": ([1, 7, 20], [30, 7, 20], False),
    "chunked context": ([1, 6, 5], [30, 23, 200], True),
}

# (device, backend, dims, dtype, cache dtype, page size)
CASES = [
    *(pytest.param(("cpu", backend, SMALL, torch.float32, "auto", 16), id=f"cpu-{backend}")
      for backend in ("reference", "triton")),
    *(pytest.param(("cuda", "triton", dims, torch.bfloat16, cache, 64), marks=pytest.mark.cuda,
                   id=f"cuda-{dims.num_heads}heads-{cache}")
      for dims in (V2_LITE, V3_HEADS) for cache in ("auto", "fp8")),
]


def _run(batch: PagedBatch, backend: str, workspace_rows: int | None) -> torch.Tensor:
    builder = MLAMetadataBuilder(batch.dims, block_size=batch.block_size,
                                 device=batch.q.device, workspace_rows=workspace_rows)
    meta = builder.build(batch.spec)
    attn = MLAAttention(batch.dims, softmax_scale=batch.softmax_scale,
                        kv_b_proj=batch.kv_b_proj, backend=backend)
    out = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta)
    return out.view(batch.num_tokens, batch.dims.num_heads, batch.dims.v_head_dim).float()


def _assert_nan_exactly_where(out: torch.Tensor, depends: torch.Tensor) -> None:
    """out [T, N, V]: every element of a (token, head) that depends is NaN, every other
    finite."""
    nan = torch.isnan(out).cpu()
    want = depends[:, :, None].expand_as(nan)
    lost = sorted({(t, h) for t, h, _ in torch.nonzero(want & ~nan).tolist()})
    assert not lost, f"NaN lost in (token, head) {lost}"
    bad = ~want & ~torch.isfinite(out.cpu())
    stray = sorted({(t, h) for t, h, _ in torch.nonzero(bad).tolist()})
    assert not stray, f"NaN or inf in (token, head) {stray}, which do not depend on it"


@pytest.fixture(params=CASES)
def case(request) -> tuple:
    device, backend = request.param[:2]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu" and backend == "triton" and torch.cuda.is_available():
        pytest.skip("Triton runs CPU tensors only in its interpreter (machines without CUDA)")
    return request.param


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("where", ["query row", "new latent", "context latent"])
def test_a_nan_reaches_every_row_that_depends_on_it(case: tuple, path: str, where: str) -> None:
    device, backend, dims, dtype, cache, block_size = case
    query_lens, seq_lens, chunked = PATHS[path]
    if where == "context latent" and seq_lens[-1] == query_lens[-1]:
        pytest.skip("this path's last request has no context")
    batch = make_paged_batch(dims, query_lens, seq_lens, block_size, dtype=dtype,
                             kv_cache_dtype=cache, seed=len(where) * 31 + len(path),
                             device=device)
    rows = batch.token_slices[-1]
    depends = torch.zeros(batch.num_tokens, dims.num_heads, dtype=torch.bool)
    if where == "query row":
        token, head = rows.stop - 1, dims.num_heads // 2
        batch.q[token, head, 3] = math.nan
        depends[token, head] = True
    elif where == "new latent":
        # The request's first new token: every new token of the request sees it.
        batch.kv_c[rows.start, 5] = math.nan
        depends[rows] = True
    else:
        position = (seq_lens[-1] - query_lens[-1]) // 2
        block = batch.blocks[-1][position // block_size]
        batch.cache.data[block, position % block_size, 7] = math.nan
        depends[rows] = True
    _assert_nan_exactly_where(_run(batch, backend, block_size if chunked else None), depends)


BACKENDS = ["reference", "triton"]


def _device(backend: str) -> str:
    """Where `backend` runs: the triton backend on the GPU when there is one (else in
    Triton's interpreter), the reference on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_attn_states_passes_a_nan_lse_on(backend: str) -> None:
    """A NaN lse is not an empty partial: its row comes out NaN (output and lse), while
    -inf and +inf still mean empty."""
    T, N, D = 5, 3, 8
    gen = torch.Generator().manual_seed(7)
    out_p, out_s = torch.randn(2, T, N, D, generator=gen)
    lse_p, lse_s = torch.randn(2, N, T, generator=gen)
    lse_p[1, 2] = math.nan  # head 1, token 2
    lse_s[0, 4] = math.nan  # head 0, token 4
    lse_p[2, 0] = -math.inf  # empty partials: not NaN
    lse_s[2, 0] = math.inf
    device = _device(backend)
    out_p, lse_p, out_s, lse_s = (t.to(device) for t in (out_p, lse_p, out_s, lse_s))
    output, output_lse = torch.empty(T, N, D, device=device), torch.empty(N, T, device=device)
    get_backend(backend, device).merge_attn_states(out_p, lse_p, out_s, lse_s, output,
                                                   output_lse)
    output, output_lse = output.cpu(), output_lse.cpu()
    nan_rows = {(2, 1), (4, 0)}  # (token, head)
    for t in range(T):
        for h in range(N):
            assert bool(torch.isnan(output[t, h]).all()) == ((t, h) in nan_rows)
            assert bool(torch.isnan(output_lse[h, t])) == ((t, h) in nan_rows)
    assert bool((output[0, 2] == 0).all()) and output_lse[2, 0] == -math.inf


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_partials_passes_a_nan_lse_on(backend: str) -> None:
    """Decode context parallelism's merge of D ranks' partials: a NaN lse on one rank
    makes its row NaN; a row empty on every rank comes out 0."""
    D, T, N, L = 3, 4, 2, 16
    gen = torch.Generator().manual_seed(8)
    out = torch.randn(D, T, N, L, generator=gen)
    lse = torch.randn(D, T, N, generator=gen)
    lse[1, 3, 0] = math.nan
    lse[:, 2, 1] = -math.inf
    device = _device(backend)
    merged = get_backend(backend, device).merge_partials(out.to(device), lse.to(device),
                                                         torch.float32).cpu()
    nan = torch.isnan(merged).all(dim=-1)
    assert nan.tolist() == [[False, False], [False, False], [False, False], [True, False]]
    assert bool((merged[2, 1] == 0).all()) and bool(torch.isfinite(merged[~nan]).all())
