"""The Triton backend's kernels on a GPU at the sizes the kernel benchmarks time.

Every kernel against the reference op (`ops/reference.py`) on fresh random inputs, the
memory the allocator hands out for outputs NaN-poisoned; the paged caches of the decode
sweep and of the gather hold NaN in every unused slot, their pages permuted and their
block-table entries past a request's pages far out of range. Decode on pages
of 1 / 16 / 64 positions, 1-128 heads, bf16 and fp8 caches, 1-16 query tokens, contexts
up to 128k, and a CUDA graph captured with short contexts and replayed with long ones;
the benchmark's decode baseline (`benchmarks.baselines.torch_decode`) too, or its
speed-ups would mean nothing. Merge with empty sides; cache write and gather bit for
bit; varlen prefill with empty and odd sequences; the backend's prefill op.

Bounds: bf16 outputs within 1e-2 relative L2 error and lse within 2e-3 (softmax weights
rounded to bf16 before the PV product); merge (rounding only) 1e-3 and 1e-5; data
movement exact. GPU only (`pytest -m cuda tests/test_kernel_sweep.py`).
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.baselines import torch_decode
from benchmarks.workloads import FP8, L, R, cu_lens, decode_inputs
from pagedmla.ops import reference as ref
from pagedmla.ops.triton import (
    gather_cache,
    merge_attn_states,
    mla_decode,
    prefill_attention,
    varlen_attention,
    write_cache,
)
from pagedmla.testing import relative_error

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
BF16 = torch.bfloat16


def _generator(seed: int = 1234) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _poison() -> None:
    """Fill the caching allocator's blocks with NaN, so that an output element a kernel
    leaves unwritten shows."""
    for size in (1 << 12, 1 << 18, 1 << 24, 1 << 27):
        torch.full((size,), math.nan, device=DEV)


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def _scatter_cache(seq_lens: list[int], block_size: int, cache: torch.dtype,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled cache [W, block_size, L + R] with block 0 reserved, each request's
    pages drawn from a permutation of the rest (valid rows ~ N(0, 1)), and block-table
    entries past a request's pages far out of range; returns (cache, table [B, ...])."""
    used = [-(-s // block_size) for s in seq_lens]
    blocks = 1 + sum(used) + 2
    data = torch.full((blocks, block_size, L + R), math.nan, device=DEV)
    order = (torch.randperm(blocks - 1, device=DEV, generator=gen) + 1).int()
    table = torch.full((len(seq_lens), max(used) + 1), 10**6, dtype=torch.int32, device=DEV)
    taken = 0
    for b, (n, s) in enumerate(zip(used, seq_lens)):
        table[b, :n] = order[taken:taken + n]
        taken += n
        pos = torch.arange(s, device=DEV)
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        data.view(-1, L + R)[slots] = torch.randn(s, L + R, device=DEV, generator=gen)
    return data.to(cache), table


# --- decode -------------------------------------------------------------------------------


@pytest.mark.parametrize("q_lens", [[1] * 5, [1, 4, 16, 2, 3]], ids=["decode", "multi-token"])
@pytest.mark.parametrize("cache", [BF16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode(block_size: int, heads: int, cache: torch.dtype, q_lens: list[int]) -> None:
    # Lengths 1, 2, a page + 1, odd ones; each at least its request's query tokens.
    gen = _generator()
    seq_lens = [max(q, s) for q, s in zip(q_lens, [1, 2, block_size + 1, 777, 3001])]
    data, table = _scatter_cache(seq_lens, block_size, cache, gen)
    q = torch.randn(sum(q_lens), heads, L + R, device=DEV, generator=gen)
    args = (q.to(BF16), data, torch.tensor(0.37, device=DEV), table,
            torch.tensor(seq_lens, dtype=torch.int32, device=DEV), cu_lens(q_lens),
            max(q_lens), max(seq_lens), L, (L + R) ** -0.5)
    _poison()
    out, lse = mla_decode(*args)
    want, want_lse = ref.mla_decode(*args)
    assert relative_error(out, want) < 1e-2
    assert _max_diff(lse, want_lse) < 2e-3


@pytest.mark.parametrize(("heads", "context"), [(16, 131072), (128, 65536)])
def test_decode_one_long_request(heads: int, context: int) -> None:
    # B = 1 over a long context: many splits, then the combine.
    args = decode_inputs(1, heads, context, seed=7)
    out, lse = mla_decode(*args)
    want, want_lse = ref.mla_decode(*args)
    assert relative_error(out, want) < 1e-2
    assert _max_diff(lse, want_lse) < 2e-3


@pytest.mark.parametrize(("batch", "heads", "context", "page"),
                         [(4, 16, 2048, 64), (2, 128, 4096, 16)])
def test_decode_baseline(batch: int, heads: int, context: int, page: int) -> None:
    # The benchmark's baseline attends as the reference does, or its time would mean
    # nothing.
    args = decode_inputs(batch, heads, context, block_size=page, seed=8)
    out, lse = torch_decode(*args)
    want, want_lse = ref.mla_decode(*args)
    assert relative_error(out, want) < 1e-2
    assert _max_diff(lse, want_lse) < 2e-3


@pytest.mark.parametrize(("heads", "cache"), [(16, BF16), (128, BF16), (128, FP8)],
                         ids=["N16-bf16", "N128-bf16", "N128-fp8"])
def test_decode_graph_replay(heads: int, cache: torch.dtype) -> None:
    # Captured with short contexts, replayed with 100k-token ones and with one
    # 100k-token request among short ones: the split plan is made on the device from
    # each replay's lengths. 16 heads (the 16-row kernel on Hopper), 128 (the 64-row one).
    batch, long_ctx = 4, 100_000
    args = list(decode_inputs(batch, heads, long_ctx, cache=cache, seed=3))
    seq_lens = args[4]
    seq_lens.fill_(37)
    mla_decode(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = mla_decode(*args)
    for lengths in ([37] * batch, [5000] * batch, [long_ctx] * batch,
                    [long_ctx] + [37] * (batch - 1)):
        seq_lens.copy_(torch.tensor(lengths))
        graph.replay()
        want, want_lse = ref.mla_decode(*args)
        assert relative_error(out, want) < 1e-2, f"ctx={lengths}"
        assert _max_diff(lse, want_lse) < 2e-3, f"ctx={lengths}"


# --- merge, cache write and gather ----------------------------------------------------------


def test_merge_in_place() -> None:
    # Empty sides (lse -inf on the prefix, +inf on the suffix) with NaN behind them,
    # a strided lse view, the result written over the prefix.
    T, N, D = 4096, 128, 128
    po = torch.randn(T, N, D, device=DEV, dtype=BF16)
    so = torch.randn(T, N, D, device=DEV, dtype=BF16)
    pl = torch.randn(N, 2 * T, device=DEV)[:, ::2] * 3
    sl = torch.randn(N, T, device=DEV) * 3
    pl[:, :7] = -math.inf
    po[:7] = math.nan
    sl[:, 3:11] = math.inf
    so[3:11] = math.nan
    want, want_lse = torch.empty_like(po), torch.empty(N, T, device=DEV)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    merge_attn_states(po, pl, so, sl, po, pl)  # in place over the prefix
    assert relative_error(po, want) < 1e-3  # bf16 rounding: ~1e-5
    both = want_lse.isfinite()
    assert _max_diff(pl[both], want_lse[both]) < 1e-5
    assert (pl.isneginf() != want_lse.isneginf()).sum() == 0


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("cache", [BF16, FP8], ids=["bf16", "fp8"])
def test_write_cache_bits(cache: torch.dtype, block_size: int) -> None:
    # Bit-exact, fp8 quantization included; slots of -1 (padding) are skipped.
    tokens, blocks = 3000, 3000 // block_size + 8
    data = torch.full((blocks, block_size, L + R), math.nan, device=DEV).to(cache)
    want = data.clone()
    kv_c = torch.randn(tokens, L, device=DEV, dtype=BF16) * 100
    k_pe = torch.randn(tokens, R, device=DEV, dtype=BF16)
    slots = torch.randperm(blocks * block_size, device=DEV)[:tokens]
    slots[::17] = -1
    s = torch.tensor(0.37, device=DEV)
    write_cache(data, kv_c, k_pe, slots, s)
    ref.write_cache(want, kv_c, k_pe, slots, s)
    assert (data.view(torch.uint8) != want.view(torch.uint8)).sum() == 0


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("cache", [BF16, FP8], ids=["bf16", "fp8"])
def test_gather_cache_bits(cache: torch.dtype, block_size: int) -> None:
    # Dequantized rows of three requests from their start positions, bit for bit.
    seq_lens = [block_size * 3 + 5, 1, 1000]
    data, table = _scatter_cache(seq_lens, block_size, cache, _generator())
    s = torch.tensor(0.37, device=DEV)
    starts = torch.tensor([2, 0, 100], dtype=torch.int32, device=DEV)
    counts = [seq_lens[0] - 2, 1, 900]
    cu = torch.tensor([0, counts[0], counts[0] + 1, sum(counts)], dtype=torch.int32,
                      device=DEV)
    t2s = torch.repeat_interleave(torch.arange(3, device=DEV),
                                  torch.tensor(counts, device=DEV)).int()
    out = torch.full((sum(counts), L + R), math.nan, device=DEV, dtype=BF16)
    want = torch.empty_like(out)
    gather_cache(data, s, table, starts, cu, t2s, out)
    ref.gather_cache(data, s, table, starts, cu, t2s, want)
    assert (out.view(torch.int16) != want.view(torch.int16)).sum() == 0


# --- prefill ------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (256, 256), (128, 128)],
                         ids=["192-128", "256-256", "128-128"])
def test_varlen_attention(qk: int, dv: int, heads: int, causal: bool) -> None:
    # Sequences of 0, 1 and odd lengths; a query that sees no key gets lse -inf.
    q_lens = [0, 1, 300, 1029]
    k_lens = q_lens if causal else [5, 0, 2000, 1029]
    q = torch.randn(sum(q_lens), heads, qk, device=DEV, dtype=BF16)
    kv = torch.randn(sum(k_lens), heads, qk + dv, device=DEV, dtype=BF16)
    args = (q, kv[..., :qk], kv[..., qk:], cu_lens(q_lens), cu_lens(k_lens), max(q_lens),
            max(k_lens), qk**-0.5, causal)
    _poison()
    out, lse = varlen_attention(*args)
    want, want_lse = ref.varlen_attention(*args)
    assert relative_error(out, want) < 1e-2
    fin = want_lse.isfinite()
    assert _max_diff(lse[fin], want_lse[fin]) < 2e-3
    assert (lse.isneginf() != ~fin).sum() == 0


@pytest.mark.parametrize(("lens_q", "lens_k", "causal"),
                         [([512, 512], [512, 512], True), ([64, 64], [300, 300], False)],
                         ids=["causal-square", "unmasked"])
def test_prefill_attention_dense(lens_q: list[int], lens_k: list[int], causal: bool) -> None:
    # The backend's prefill op on equal-length batches (cuDNN where available).
    q = torch.randn(sum(lens_q), 16, 192, device=DEV, dtype=BF16)
    kv = torch.randn(sum(lens_k), 16, 320, device=DEV, dtype=BF16)
    cq = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32, device=DEV)
    ck = torch.tensor([0, lens_k[0], sum(lens_k)], dtype=torch.int32, device=DEV)
    args = (q, kv[..., :192], kv[..., 192:], cq, ck, lens_q[0], lens_k[0], 0.07, causal)
    _poison()
    out, lse = prefill_attention(*args)
    want, want_lse = ref.varlen_attention(*args)
    assert relative_error(out, want) < 1e-2
    assert _max_diff(lse, want_lse) < 2e-3
