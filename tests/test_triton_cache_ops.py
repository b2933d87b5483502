"""Writing the paged latent cache and gathering it back: bit-exact against the reference
ops, fp8 included.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.ops import reference as ref

pytest.importorskip("triton")

from pagedmla.ops.triton import gather_cache, write_cache
from tests.triton_helpers import DEVICE, FP8, _bits, _cu, _paged_cache, cuda, runnable


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float32, FP8),
     (torch.float16, FP8)],
)
def test_write_cache_bit_exact(block_size: int, dtype: torch.dtype,
                               cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(90 + block_size)
    L, R, T, num_blocks = 64, 16, 21, 24
    # Large values so that fp8 saturates at +-448 after x / 0.37.
    kv_c = (torch.randn(T, L, generator=gen) * 60).to(DEVICE, dtype)
    k_pe = torch.randn(T, 2 * R, generator=gen).to(DEVICE, dtype)[:, ::2]  # strided view
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:T]
    slots[torch.tensor([0, 5, 6])] = -1
    slots = slots.to(DEVICE)
    scale = torch.tensor(0.37, device=DEVICE)
    data = torch.full((num_blocks, block_size, L + R), math.nan).to(DEVICE, cache_dtype)
    want = data.clone()
    write_cache(data, kv_c, k_pe, slots, scale)
    ref.write_cache(want, kv_c, k_pe, slots, scale)
    assert torch.equal(_bits(data), _bits(want))


@runnable
def test_write_cache_nope() -> None:
    data = torch.full((3, 4, 32), math.nan, device=DEVICE)
    want = data.clone()
    kv_c = torch.randn(5, 32, device=DEVICE)
    k_pe = torch.empty(5, 0, device=DEVICE)
    slots = torch.tensor([3, -1, 0, 11, 7], device=DEVICE)
    scale = torch.tensor(1.0, device=DEVICE)
    write_cache(data, kv_c, k_pe, slots, scale)
    ref.write_cache(want, kv_c, k_pe, slots, scale)
    assert torch.equal(_bits(data), _bits(want))


def _gather_case(block_size: int, width: int, cache_dtype: torch.dtype, seed: int,
                 ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    contexts = [3 * block_size + 2, 1, 40]
    data, table = _paged_cache(contexts, block_size, width, cache_dtype, gen, 0.37)
    starts = [1, 0, 7]
    counts = [contexts[0] - 1, 1, 20]
    token_to_seq = torch.repeat_interleave(torch.arange(3), torch.tensor(counts))
    return (data, torch.tensor(0.37, device=DEVICE), table,
            torch.tensor(starts, dtype=torch.int32, device=DEVICE), _cu(counts),
            token_to_seq.to(DEVICE, torch.int32))


@runnable
@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize(
    ("cache_dtype", "out_dtype"),
    [(torch.float32, torch.float32), (torch.float16, torch.float16), (FP8, torch.float32),
     (FP8, torch.float16)],
)
def test_gather_cache_bit_exact(block_size: int, cache_dtype: torch.dtype,
                                out_dtype: torch.dtype) -> None:
    args = _gather_case(block_size, 80, cache_dtype, seed=100 + block_size)
    rows = args[-1].shape[0]
    out = torch.full((rows, 80), math.nan, dtype=out_dtype, device=DEVICE)
    want = torch.empty_like(out)
    gather_cache(*args, out)
    ref.gather_cache(*args, want)
    assert not out.isnan().any()
    assert torch.equal(_bits(out), _bits(want))


@runnable
@pytest.mark.parametrize("width", [48, 40, 64])
def test_gather_cache_widths(width: int) -> None:
    # 48 = 32 + 16, 40 = 32 + 8, 64 = 64 + 0 (NoPE): the power-of-two split of a row.
    args = _gather_case(16, width, torch.float32, seed=110 + width)
    out = torch.full((args[-1].shape[0], width), math.nan, device=DEVICE)
    want = torch.empty_like(out)
    gather_cache(*args, out)
    ref.gather_cache(*args, want)
    assert torch.equal(out, want)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_cache_gpu_fp8_bits(dtype: torch.dtype) -> None:
    # The hardware fp32 -> e4m3 conversion vs torch's, on every e4m3 value, every
    # midpoint between neighbours (ties to even) and values past the +-448 clamp.
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    values = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([500.0, -1e6, 449.0])])
    values = torch.cat([values, torch.randn(4096) * 100])
    L = 64
    values = torch.cat([values, values.new_zeros(-values.numel() % L)]).view(-1, L)
    values = values.to("cuda", dtype)
    rows = values.shape[0]
    for scale in (1.0, 0.37):
        s = torch.tensor(scale, device="cuda")
        data = torch.zeros(rows, 1, L, dtype=FP8, device="cuda")
        want = data.clone()
        slots = torch.arange(rows, device="cuda")
        pe = values.new_zeros(rows, 0)
        write_cache(data, values, pe, slots, s)
        ref.write_cache(want, values, pe, slots, s)
        assert torch.equal(_bits(data), _bits(want))
