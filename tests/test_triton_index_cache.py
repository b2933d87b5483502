"""The Triton indexer key cache write (ops/triton/index_cache.py) against the reference
write (`reference_indexer.write_indexer_cache`, itself checked against an independent
encoder in tests/test_indexer.py): the same bytes, float and fp8 layouts.

The expected bytes always come from the reference on the CPU, the specification (on
CUDA, torch divides by a Python scalar as a multiply by its reciprocal). Every cache
starts poisoned with a sentinel byte: bytes of slots not written must keep it. On the
GPU an e4m3 NaN code's sign bit is not compared (a CPU NaN keeps its operand's sign,
CUDA's arithmetic returns a positive NaN).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from pagedmla.metadata import SparseMetadata
from pagedmla.models.dsa_config import IndexerConfig
from pagedmla.models.indexer import Indexer
from pagedmla.ops import REFERENCE
from pagedmla.ops import reference_indexer as spec
from pagedmla.ops.triton import TRITON_BACKEND, write_indexer_cache
from tests.triton_helpers import DEVICE, cuda, runnable

# The interpreter's numpy warns where a rotation meets inf - inf (a NaN, as specified).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
SENTINEL = 0xA5
E4M3_NAN = 0x7F  # e4m3fn's NaN codes: 0x7F and 0xFF


def _case(num_tokens: int, dim: int, page: int, seed: int, dtype: torch.dtype = torch.float32,
          special: bool = True) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(keys [T, D] with row stride D + 8, slots [T] with -1 entries, num_blocks): rows
    scaled by powers of two over 2^-30 .. 2^20; `special` plants a NaN row, an inf, a
    row of -inf (inf - inf in the rotation: NaN), an all-zero row (the 1e-4 amax
    floor) and a row rotating to 448 x 2^3 (D = 16: exactly on a scale boundary)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_tokens, dim + 8, generator=gen)[:, :dim]
    keys *= 2.0 ** torch.randint(-30, 20, (num_tokens, 1), generator=gen)
    if special:
        keys[1, dim // 3] = math.nan
        keys[2, dim - 1] = math.inf
        keys[3] = -math.inf
        keys[4] = 0.0
        keys[5] = 0.0
        keys[5, 0] = 448.0 * 8 * math.sqrt(dim)
    num_blocks = -(-(num_tokens + 8) // page) + 1
    slots = torch.randperm(num_blocks * page, generator=gen)[:num_tokens]
    slots[torch.tensor([0, 6, num_tokens - 1])] = -1
    return keys.to(dtype), slots, num_blocks


def _written(data: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """bool [num_blocks, bytes per block]: the bytes the write of `slots` owns."""
    num_blocks, page, width = data.shape
    size = data.element_size()
    mask = torch.zeros(num_blocks, page * width * size, dtype=torch.bool)
    fp8 = spec.is_fp8_cache(data)
    dim = spec.cache_head_dim(data)
    for slot in slots[slots >= 0].tolist():
        block, offset = divmod(slot, page)
        if fp8:
            mask[block, offset * dim: (offset + 1) * dim] = True
            mask[block, page * dim + 4 * offset: page * dim + 4 * (offset + 1)] = True
        else:
            mask[block, offset * width * size: (offset + 1) * width * size] = True
    return mask


def _raw(data: torch.Tensor) -> torch.Tensor:
    return data.cpu().contiguous().view(torch.uint8).view(data.shape[0], -1)


def _assert_same_bytes(data: torch.Tensor, want: torch.Tensor) -> None:
    """data (the kernel's cache) and want (the reference's, on the CPU) hold the same
    bytes (on the GPU, but for the sign of e4m3 NaN codes: module docstring)."""
    got, want = _raw(data), _raw(want)
    if spec.is_fp8_cache(data) and data.is_cuda:
        codes = slice(0, data.shape[1] * spec.cache_head_dim(data))
        for raw in (got, want):
            raw[:, codes][raw[:, codes] == 0xFF] = E4M3_NAN
    differ = (got != want).nonzero()
    assert differ.numel() == 0, f"{differ.shape[0]} bytes differ, first at {differ[:4].tolist()}"


def _check_write(data: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor) -> None:
    """Write keys at slots with the Triton kernel into data (poisoned) and compare every
    byte with the reference's write on the CPU; the bytes of no written slot keep the
    sentinel."""
    want = data.cpu().clone()  # (.cpu() of a CPU tensor is the tensor itself)
    spec.write_indexer_cache(want, keys.cpu(), slots.cpu())
    write_indexer_cache(data, keys.to(data.device), slots.to(data.device))
    assert _raw(data)[~_written(data, slots.cpu())].eq(SENTINEL).all()
    _assert_same_bytes(data, want)


def _poisoned(num_blocks: int, page: int, dim: int, dtype: torch.dtype, fp8: bool,
              device: str = DEVICE) -> torch.Tensor:
    data = spec.allocate_indexer_cache(num_blocks, page, dim, dtype, fp8, device)
    data.view(torch.uint8).fill_(SENTINEL)
    return data


@runnable
@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8"])
@pytest.mark.parametrize("dim, page", [(16, 1), (16, 16), (128, 1), (128, 16)])
def test_write_matches_reference_bytes(fp8: bool, dim: int, page: int) -> None:
    keys, slots, num_blocks = _case(70, dim, page, seed=dim + page)
    _check_write(_poisoned(num_blocks, page, dim, torch.float32, fp8), keys, slots)


@runnable
def test_float32_keys_into_bfloat16_cache() -> None:
    # Rounded to nearest even, as torch's conversion (the interpreter truncates).
    keys, slots, num_blocks = _case(40, 32, 16, seed=3, special=False)
    keys[2, 1] = math.inf
    keys[3, 0] = 1.0 + 2.0**-8  # a tie: rounds to even (1.0)
    _check_write(_poisoned(num_blocks, 16, 32, torch.bfloat16, False), keys, slots)


@runnable
def test_fp8_scales_floor_cap_and_nan() -> None:
    # Against the rule itself: the smallest power of two >= max(amax, 1e-4) / 448, at
    # most 2^127, NaN for a NaN key.
    dim = 16
    keys = torch.zeros(4, dim)
    keys[1, 5] = math.inf
    keys[2, 7] = math.nan
    keys[3, 0] = 4.0 * 448 * 2 ** -20  # rotates to +-448 x 2^-20 everywhere
    data = _poisoned(2, 4, dim, torch.float32, True)
    write_indexer_cache(data, keys.to(DEVICE), torch.tensor([0, 1, 2, 3], device=DEVICE))
    codes, scales = spec.fp8_cache_views(data.cpu())
    floor = 2.0 ** math.ceil(math.log2(1e-4 / 448))  # 2^-22
    assert scales[0, 0] == floor and codes[0, 0].float().eq(0).all()
    assert scales[0, 1] == 2.0**127 and codes[0, 1].float().abs().eq(448).all()
    assert math.isnan(scales[0, 2]) and codes[0, 2].float().isnan().all()
    assert scales[0, 3] == 2.0**-20 and codes[0, 3].float().abs().eq(448).all()


@runnable
def test_rejects_a_key_width_other_than_the_cache() -> None:
    data = _poisoned(2, 4, 16, torch.float32, True)
    with pytest.raises(ValueError, match="D = 16"):
        write_indexer_cache(data, torch.zeros(3, 32, device=DEVICE),
                            torch.zeros(3, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("dim", [1, 2, 16, 128])
def test_hadamard_transform_is_the_normalised_sylvester_product(dim: int) -> None:
    # The fixed-order butterfly the reference and the kernel share, against the matrix
    # (entry (i, j) = (-1)^popcount(i & j) / sqrt(D)) in float64.
    i = torch.arange(dim)
    parity = torch.tensor([bin(v).count("1") % 2 for v in (i[:, None] & i[None, :]).flatten()])
    matrix = (1.0 - 2.0 * parity.double()).view(dim, dim) / math.sqrt(dim)
    x = torch.randn(5, dim, generator=torch.Generator().manual_seed(dim))
    got = spec.hadamard_transform(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ matrix, rtol=0, atol=2e-6)


def test_backends_name_their_write() -> None:
    assert REFERENCE.write_indexer_cache is spec.write_indexer_cache
    assert TRITON_BACKEND.write_indexer_cache is write_indexer_cache


def _indexer(device: str, backend: str) -> Indexer:
    config = IndexerConfig(hidden_size=32, q_lora_rank=16, num_heads=4, head_dim=16,
                           rope_dim=8, topk=4, rope_interleaved=False, layer_types=())
    indexer = Indexer(config, torch.float32, device, backend=backend)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return indexer


def _dense_step(num_tokens: int, device: str) -> tuple[torch.Tensor, ...]:
    """(hidden, q latent, cos, sin, slots) of one step and its SparseMetadata (dense:
    the indexer only writes its keys)."""
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, q_latent = torch.randn(num_tokens, 32, generator=gen), torch.randn(num_tokens, 16)
    angles = torch.rand(num_tokens, 4, generator=gen)
    slots = torch.arange(num_tokens)
    slots[1] = -1
    tensors = [t.to(device) for t in (hidden, q_latent, angles.cos(), angles.sin(), slots)]
    sparse = SparseMetadata(
        torch.zeros(1, 4, dtype=torch.int32, device=device),
        torch.tensor([num_tokens], dtype=torch.int32, device=device),
        torch.tensor([0, num_tokens], dtype=torch.int32, device=device), num_tokens, 4,
        dense=True)
    return (*tensors, sparse)


def test_indexer_writes_its_keys_through_its_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    # The model's key write is its backend's op (the Triton kernel on CUDA), not the
    # reference's boolean-mask indexing (a device -> host sync per layer and step).
    calls = []

    def spy(data: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        calls.append(slot_mapping)
        spec.write_indexer_cache(data, k, slot_mapping)

    backend = replace(REFERENCE, write_indexer_cache=spy)
    monkeypatch.setattr("pagedmla.models.indexer.get_backend", lambda name, device: backend)
    *inputs, slots, sparse = _dense_step(6, "cpu")
    keys = _poisoned(2, 4, 16, torch.float32, True, "cpu")
    assert _indexer("cpu", "triton")(*inputs, keys, slots, sparse) is None
    assert len(calls) == 1 and calls[0] is slots


# --- GPU ---------------------------------------------------------------------------


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_model_widths(fp8: bool, dtype: torch.dtype) -> None:
    # D = 128, page 64, a 3000-token prefill's keys in the model dtype (the float cache
    # in that dtype too).
    keys, slots, num_blocks = _case(3000, 128, 64, seed=5, dtype=dtype)
    _check_write(_poisoned(num_blocks, 64, 128, dtype, fp8, "cuda"), keys, slots)


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8"])
def test_gpu_write_replays_in_a_cuda_graph(fp8: bool) -> None:
    # Captured once, replayed with other keys and other slots (two more -1): the same
    # bytes as the reference's write of the new inputs.
    keys, slots, num_blocks = _case(64, 128, 16, seed=6, dtype=torch.bfloat16)
    data = _poisoned(num_blocks, 16, 128, torch.bfloat16, fp8, "cuda")
    static_keys, static_slots = keys.cuda(), slots.cuda()
    write_indexer_cache(data, static_keys, static_slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_indexer_cache(data, static_keys, static_slots)
    for seed in (7, 8):
        new_keys, new_slots, _ = _case(64, 128, 16, seed=seed, dtype=torch.bfloat16)
        new_slots[torch.tensor([2, 9])] = -1
        data.view(torch.uint8).fill_(SENTINEL)
        static_keys.copy_(new_keys)
        static_slots.copy_(new_slots)
        want = data.cpu()
        spec.write_indexer_cache(want, new_keys, new_slots)
        graph.replay()
        _assert_same_bytes(data, want)


@pytest.mark.cuda
@cuda
def test_gpu_indexer_key_write_does_not_sync() -> None:
    *inputs, slots, sparse = _dense_step(8, "cuda")
    keys = _poisoned(2, 4, 16, torch.float32, True, "cuda")
    indexer = _indexer("cuda", "triton")
    indexer(*inputs, keys, slots, sparse)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        indexer(*inputs, keys, slots, sparse)
    finally:
        torch.cuda.set_sync_debug_mode("default")
