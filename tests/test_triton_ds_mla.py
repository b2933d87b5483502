"""The triton backend over an fp8_ds_mla cache: the write and the gather (bit for bit
the reference ops'), the portable decode kernel (against a float64 oracle over the
entries read back by `testing.ds_mla_rows`), the attention layer, and (on a GPU) CUDA
graphs through the engine. The decode table's choice is in test_triton_selection.

The interpreter runs tiny shapes in float32 and float16 (its bfloat16 dots are wrong,
see tests/triton_helpers.py); the cuda tests run bf16 at DeepSeek's sizes.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedmla import LLM, MLADims, SamplingParams
from pagedmla.ops import reference as ref
from pagedmla.testing import ds_mla_entries, ds_mla_rows, make_paged_batch, relative_error

pytest.importorskip("triton")

from pagedmla.ops.triton import gather_cache, mla_decode, write_cache
from tests.engine_helpers import assert_same_completions
from tests.triton_helpers import DEVICE, TINY_DECODE, _cu, _run_layer, cuda, runnable

DS_DIMS = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                  v_head_dim=32)


def _ds_cache(seq_lens: list[int], page: int, gen: torch.Generator,
              device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8_ds_mla cache poisoned with 0xFF (NaN in every field) whose requests'
    positions hold entries of random rows (each 128-value group ~ N(0, 1) times a power
    of two in 2^-2 .. 2^2, so that a row's four scales differ), in blocks drawn from a
    permutation; block-table entries past a request's blocks point far outside."""
    used = [-(-s // page) for s in seq_lens]
    num_blocks = 1 + sum(used) + 2
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), max(used) + 1), 10**6, dtype=torch.int32)
    data = torch.full((num_blocks, page, 656), 0xFF, dtype=torch.uint8)
    taken = 0
    for b, (n, s) in enumerate(zip(used, seq_lens)):
        table[b, :n] = torch.tensor(order[taken:taken + n], dtype=torch.int32)
        taken += n
        pos = torch.arange(s)
        slots = table[b, pos // page].long() * page + pos % page
        magnitude = 2.0 ** torch.randint(-2, 3, (s, 4, 1), generator=gen)
        kv_c = (torch.randn(s, 4, 128, generator=gen) * magnitude).view(s, 512)
        data.view(-1, 656)[slots] = ds_mla_entries(kv_c, torch.randn(s, 64, generator=gen))
    return data.to(device), table.to(device)


def _oracle(q: torch.Tensor, data: torch.Tensor, table: torch.Tensor, seq_lens: list[int],
            q_lens: list[int], softmax_scale: float) -> torch.Tensor:
    """Absorbed MQA in float64 over the entries read back (`ds_mla_rows`): out [T, N, 512]."""
    page = data.shape[1]
    flat = data.cpu().view(-1, 656)
    outs, first = [], 0
    for b, (q_len, s) in enumerate(zip(q_lens, seq_lens)):
        pos = torch.arange(s)
        slots = table[b, pos // page].cpu().long() * page + pos % page
        rows = ds_mla_rows(flat[slots])  # [S, 576]
        queries = q[first:first + q_len].cpu().double()  # [q_len, N, 576]
        scores = torch.einsum("tnd,sd->tns", queries, rows) * softmax_scale
        limit = s - q_len + torch.arange(q_len) + 1
        scores = scores.masked_fill(pos.view(1, 1, -1) >= limit.view(-1, 1, 1), -math.inf)
        outs.append(torch.einsum("tns,sd->tnd", scores.softmax(-1), rows[:, :512]))
        first += q_len
    return torch.cat(outs)


def _check_write_and_gather(num_tokens: int, page: int, num_blocks: int, dtype: torch.dtype,
                            seed: int, device: str) -> None:
    """Write random tokens (scales over 2^-40 .. 2^40, a NaN, an inf, a zero group, slot
    -1) to a poisoned cache and gather it back from position 1 on: bytes equal to the
    reference write's, gathered rows bit for bit the reference gather's (bfloat16 holds
    the dequantized values exactly, so the interpreter's truncating conversion is
    exact here)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 2.0 ** torch.randint(-40, 41, (num_tokens, 4, 1), generator=gen)
    kv_c = (torch.randn(num_tokens, 4, 128, generator=gen) * magnitude).view(num_tokens, 512)
    kv_c[0, :128] = 0.0
    if num_tokens > 2:
        kv_c[1, 300] = math.nan
        kv_c[2, 5] = -math.inf
    kv_c = kv_c.to(dtype)
    k_pe = torch.randn(num_tokens, 64, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    data = torch.full((num_blocks, page, 656), 0xFF, dtype=torch.uint8)
    want = data.clone()
    ref.write_cache(want, kv_c, k_pe, slots, torch.tensor(1.0))
    data = data.to(device)
    write_cache(data, kv_c.to(device), k_pe.to(device), slots.to(device),
                torch.tensor(1.0, device=device))
    got = data.cpu()
    # A NaN group's codes are left unspecified (its scale is NaN): compare its scale.
    nan_group = torch.zeros(num_blocks * page, 656, dtype=torch.bool)
    if num_tokens > 2 and slots[1] >= 0:
        nan_group[slots[1], 256:384] = True
        assert got.view(-1, 656)[slots[1], 512:528].view(torch.float32)[2].isnan()
    assert torch.equal(got.view(-1, 656)[~nan_group], want.view(-1, 656)[~nan_group])

    # The whole cache as one request's context (unwritten slots read NaN).
    table = torch.arange(num_blocks, dtype=torch.int32).view(1, -1)
    count = num_blocks * page - 1
    args = (torch.tensor(1.0), table, torch.tensor([1], dtype=torch.int32),
            _cu([count], "cpu"), torch.zeros(count, dtype=torch.int32))
    out = torch.full((count, 576), math.nan, dtype=dtype, device=device)
    gather_cache(want.to(device), *(a.to(device) for a in args), out)
    expected = torch.empty(count, 576, dtype=dtype)
    ref.gather_cache(want, *args, expected)
    assert torch.equal(out.cpu().isnan(), expected.isnan())
    assert torch.equal(out.cpu().nan_to_num(), expected.nan_to_num())


@runnable
@pytest.mark.parametrize(("page", "dtype"), [(1, torch.float32), (5, torch.float32),
                                             (16, torch.bfloat16)])
def test_write_and_gather_small(page: int, dtype: torch.dtype) -> None:
    _check_write_and_gather(num_tokens=19, page=page, num_blocks=48 // page + 1, dtype=dtype,
                            seed=540 + page, device=DEVICE)


@runnable
@pytest.mark.parametrize("config", [TINY_DECODE, replace(TINY_DECODE, swap_ab=True), None],
                         ids=["qk", "swapped", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_small(config, dtype: torch.dtype) -> None:
    # One- and multi-token decodes over pages of 5 (tiles straddle pages), cut in splits.
    gen = torch.Generator().manual_seed(550)
    q_lens, seq_lens = [1, 2, 1], [37, 9, 1]
    data, table = _ds_cache(seq_lens, 5, gen, DEVICE)
    q = torch.randn(sum(q_lens), 3, 576, generator=gen).to(DEVICE, dtype)
    softmax_scale = 576**-0.5
    args = (q, data, torch.tensor(1.0, device=DEVICE), table,
            torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), _cu(q_lens),
            max(q_lens), max(seq_lens), 512, softmax_scale)
    kwargs = {} if config is None else dict(config=config, num_splits=3)
    out, lse = mla_decode(*args, **kwargs)
    want_out, want_lse = ref.mla_decode(*args)
    oracle = _oracle(q, data, table, seq_lens, q_lens, softmax_scale)
    assert not out.isnan().any()
    # float16: q and the softmax weights rounded to float16 (unit roundoff 5e-4).
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert relative_error(out, oracle) < tol and relative_error(want_out, oracle) < tol
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)


@runnable
def test_decode_nan_entry_reaches_its_rows() -> None:
    # A NaN latent makes its group's scale NaN: every query row that sees it is NaN.
    gen = torch.Generator().manual_seed(560)
    data, table = _ds_cache([12, 12], 4, gen, DEVICE)
    slot = int(table[1, 1]) * 4 + 2  # request 1, position 6
    data.view(-1, 656)[slot, 512:516] = torch.tensor([math.nan]).view(torch.uint8).to(DEVICE)
    q = torch.randn(2, 2, 576, generator=gen).to(DEVICE)
    out, lse = mla_decode(q, data, torch.tensor(1.0, device=DEVICE), table,
                          torch.tensor([12, 12], dtype=torch.int32, device=DEVICE),
                          _cu([1, 1]), 1, 12, 512, 0.05, config=TINY_DECODE)
    assert not out[0].isnan().any() and out[1].isnan().all() and lse[:, 1].isnan().all()


@runnable
def test_layer_small() -> None:
    # Every op of the backend in one layer call over the cache (float32).
    batch = make_paged_batch(DS_DIMS, [1, 2, 6, 5], [30, 9, 6, 40], 8,
                             kv_cache_dtype="fp8_ds_mla", seed=570, device=DEVICE)
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=16)
    assert relative_error(out, batch.oracle(decode_threshold=2)) < 2e-4
    assert batch.cache_mismatches() == 0


# --- GPU --------------------------------------------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ds_mla_write_and_gather_gpu(dtype: torch.dtype) -> None:
    # The hardware's e4m3 and bfloat16 roundings against torch's, bit for bit.
    _check_write_and_gather(num_tokens=3000, page=64, num_blocks=80, dtype=dtype, seed=580,
                            device="cuda")
    _check_write_and_gather(num_tokens=500, page=1, num_blocks=700, dtype=dtype, seed=581,
                            device="cuda")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("num_heads", "q_len", "page"),
                         [(16, 1, 64), (16, 2, 1), (128, 1, 64), (128, 2, 16)])
def test_ds_mla_decode_gpu_bf16_oracle(num_heads: int, q_len: int, page: int) -> None:
    gen = torch.Generator().manual_seed(590 + num_heads + q_len)
    seq_lens = [1, 700, 4133, 64, 2000]
    q_lens = [q_len] * len(seq_lens)
    seq_lens[0] = max(seq_lens[0], q_len)
    data, table = _ds_cache(seq_lens, page, gen, "cuda")
    q = torch.randn(sum(q_lens), num_heads, 576, generator=gen).to("cuda", torch.bfloat16)
    args = (q, data, torch.tensor(1.0, device="cuda"), table,
            torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), _cu(q_lens, "cuda"),
            q_len, max(seq_lens), 512, 576**-0.5)
    out, lse = mla_decode(*args)
    oracle = _oracle(q, data, table, seq_lens, q_lens, 576**-0.5)
    assert not out.isnan().any()
    assert relative_error(out, oracle) < 1e-2  # softmax weights rounded to bf16
    torch.testing.assert_close(lse, ref.mla_decode(*args)[1], atol=2e-3, rtol=1e-5)


@pytest.mark.cuda
@cuda
def test_ds_mla_layer_gpu_bf16_oracle() -> None:
    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128)
    batch = make_paged_batch(dims, [1, 1, 2, 300, 37], [1, 900, 70, 300, 2000], 64,
                             dtype=torch.bfloat16, kv_cache_dtype="fp8_ds_mla", seed=600,
                             device="cuda")
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=1024)
    assert relative_error(out, batch.oracle(decode_threshold=2)) < 2e-2
    assert batch.cache_mismatches() == 0


@pytest.mark.cuda
@cuda
def test_ds_mla_engine_graphs_match_eager(tmp_path) -> None:
    """The engine on CUDA with an fp8_ds_mla cache (bf16 model of DeepSeek's widths):
    decode steps replayed from CUDA graphs give the eager steps' greedy tokens, logprobs
    within 1e-3 (the same kernels; graph-safe write, gather and decode)."""
    from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint

    config = {**tiny_config(), "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    path = str(write_tiny_checkpoint(tmp_path, config=config, dtype=torch.bfloat16))
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 9 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1, ignore_eos=True)
    runs = []
    for eager in (True, False):
        llm = LLM(path, dtype=torch.bfloat16, device="cuda", block_size=64, max_num_seqs=8,
                  max_num_batched_tokens=48, enforce_eager=eager, num_kv_blocks=64,
                  kv_cache_dtype="fp8_ds_mla")
        assert llm.caches[0].data.shape[-1] == 656 and (llm.runner.graphs is None) == eager
        runs.append(llm.generate(prompts, params, use_tqdm=False))
    assert_same_completions(*runs)
