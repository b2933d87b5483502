"""The prefill kernel's bulk-copy (TMA) variant against the reference op.

PrefillConfig(tma=True) loads key and value tiles through host tensor descriptors over
k and v viewed as [tokens, heads x head stride] rows. A tile that crosses a sequence's
end then reads the next sequence's rows, whatever lies after the used rows (NaN here)
or zeros past the view; a box wider than the head dim reads the neighbouring columns.
These tests poison all of that memory with NaN and check that none of it reaches the
output, and that the descriptors were really used (layouts that rule them out fall back
to pointer loads, also checked).

Under the interpreter (no CUDA, tests/conftest.py) the descriptor loads are emulated as
masked gathers with the copy engine's bounds and alignment rules; the real copy engine,
its pipelining and bfloat16 run only in the cuda test. Tolerances as in
tests/test_triton_ops.py.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from pagedmla.ops import reference as ref
from pagedmla.testing import relative_error

pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor

from pagedmla.ops.triton import prefill
from pagedmla.ops.triton.prefill import PrefillConfig, pick_config, varlen_attention
from tests.test_triton_ops import ATOL, DEVICE, LSE_ATOL, _cu, _poison_allocator, cuda, runnable

# Tiny tiles so that the interpreter shapes cross many key tiles and sequence ends.
TINY_TMA = PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, tma=True)
GAP = 8  # NaN columns after each head's k and v columns
PAD = 40  # NaN rows after the used ones (more than a tile: tiles read them, not zeros)


@pytest.fixture
def descriptors(monkeypatch: pytest.MonkeyPatch) -> list:
    """What every `_kv_descriptors` call returned (None: pointer loads)."""
    made: list = []
    build = prefill._kv_descriptors

    def spy(*args: object) -> list[TensorDescriptor] | None:
        made.append(build(*args))
        return made[-1]

    monkeypatch.setattr(prefill, "_kv_descriptors", spy)
    return made


def _kv(
    k_lens: list[int], N: int, qk: int, dv: int, dtype: torch.dtype, k_first: bool,
    gen: torch.Generator, pad: int = PAD, gap: int = GAP, device: str = DEVICE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """k [sum(k_lens) + pad, N, qk] and v [.., N, dv]: views of one buffer whose rows
    are [k | v | gap] (k_first) or [v | k | gap] per head, the gap columns and the pad
    rows NaN."""
    used = sum(k_lens)
    buf = torch.full((used + pad, N, qk + dv + gap), math.nan)
    buf[:used, :, :qk + dv] = torch.randn(used, N, qk + dv, generator=gen)
    buf = buf.to(device, dtype)
    if k_first:
        return buf[..., :qk], buf[..., qk:qk + dv]
    return buf[..., dv:dv + qk], buf[..., :dv]


def _check(
    q_lens: list[int], k_lens: list[int], N: int, qk: int, dv: int, dtype: torch.dtype,
    causal: bool, seed: int, made: list, *, k_first: bool = True, pad: int = PAD,
    gap: int = GAP, config: PrefillConfig = TINY_TMA, expect_tma: bool = True,
    device: str = DEVICE,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(q_lens), N, qk, generator=gen).to(device, dtype)
    k, v = _kv(k_lens, N, qk, dv, dtype, k_first, gen, pad, gap, device)
    args = (q, k, v, _cu(q_lens, device), _cu(k_lens, device), max(q_lens), max(k_lens),
            qk**-0.5, causal)
    _poison_allocator(device)
    out, lse = varlen_attention(*args, config=config)
    assert made and all((d is not None) == expect_tma for d in made)
    want, want_lse = ref.varlen_attention(*args)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    if dtype == torch.bfloat16:
        assert relative_error(out, want.double()) < 1e-2
    else:
        torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=0)
    finite = want_lse.isfinite()
    torch.testing.assert_close(lse[finite], want_lse[finite], atol=LSE_ATOL[dtype], rtol=1e-5)


# (48, 32): the qk dot is 32 + 16 wide, every box exactly a head's columns.
# (24, 24): 16 + 8 and 24 -> 32-wide boxes that read GAP NaN columns (k_first: past v;
# else past k, where the kernel must zero them before the dot).
DIMS = pytest.mark.parametrize(("qk", "dv"), [(48, 32), (24, 24)])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
LAYOUTS = pytest.mark.parametrize("k_first", [True, False], ids=["kv", "vk"])


@runnable
@DTYPES
@DIMS
@LAYOUTS
def test_tma_causal(descriptors: list, dtype: torch.dtype, qk: int, dv: int,
                    k_first: bool) -> None:
    # Lengths 0 and 1, one tile, several tiles with a partial last one.
    lens = [0, 1, 5, 33, 70]
    _check(lens, lens, 3, qk, dv, dtype, True, 200 + qk, descriptors, k_first=k_first)


@runnable
@DTYPES
@pytest.mark.parametrize("config", [TINY_TMA, replace(TINY_TMA, block_m=32),
                                    replace(TINY_TMA, block_n=32)], ids=["16x16", "32x16", "16x32"])
def test_tma_causal_q_len_differs(descriptors: list, dtype: torch.dtype,
                                  config: PrefillConfig) -> None:
    # Bottom-right alignment: fewer keys than queries (first queries see no key) and
    # more (a context before the queries); the diagonal crosses tiles differently for
    # each tile shape.
    _check([6, 40, 3, 1], [2, 35, 50, 0], 2, 48, 32, dtype, True, 210, descriptors,
           config=config)


@runnable
@DTYPES
@DIMS
def test_tma_unmasked(descriptors: list, dtype: torch.dtype, qk: int, dv: int) -> None:
    # Context chunks: keys 0 (out 0, lse -inf), 1, and more than the queries; no pad
    # rows, so the last tile reads past the view (zero-filled) instead of NaN.
    _check([3, 1, 9, 40, 0], [7, 0, 1, 90, 4], 2, qk, dv, dtype, False, 220 + qk,
           descriptors, k_first=False, pad=0)


@runnable
def test_tma_deepseek_dims_small(descriptors: list) -> None:
    # 192 / 128 (DeepSeek): 128- and 64-wide k boxes, a 128-wide v box.
    _check([1, 20, 37], [1, 20, 37], 2, 192, 128, torch.float16, True, 230, descriptors,
           config=replace(TINY_TMA, block_m=32))


@runnable
def test_tma_falls_back_on_unaligned_heads(descriptors: list) -> None:
    # Head stride 48 + 24 + 3 float16s (150 bytes): no descriptor, pointer loads.
    _check([5, 33], [5, 33], 2, 48, 24, torch.float16, True, 240, descriptors,
           gap=3, expect_tma=False)


@pytest.mark.parametrize(("shape", "strides", "offset", "width"), [
    ((10, 4, 48), (4 * 80, 80, 1), 0, 3 * 80 + 48),  # packed heads with a gap
    ((10, 1, 48), (56, 8, 1), 0, 48),  # one head: its stride is never used
    ((10, 4, 48), (4 * 80, 80, 1), 8, 3 * 80 + 48),  # 16-byte base offset
    ((10, 4, 48), (3 * 80 + 48, 80, 1), 0, 3 * 80 + 48),  # rows just touch
    ((10, 4, 48), (4 * 80, 80, 1), 4, None),  # 8-byte base offset
    ((10, 4, 48), (4 * 76, 76, 1), 0, None),  # 152-byte head stride
    ((10, 4, 48), (4 * 80 + 4, 80, 1), 0, None),  # 648-byte row stride
    ((10, 4, 48), (3 * 80, 80, 1), 0, None),  # rows overlap
    ((10, 4, 48), (1, 480, 10), 0, None),  # columns not contiguous
    ((0, 4, 48), (4 * 80, 80, 1), 0, None),  # no rows
], ids=["packed", "one-head", "offset16", "touching", "offset8", "head-stride",
        "row-stride", "overlap", "strided", "empty"])
def test_kv_descriptors_layouts(shape: tuple[int, ...], strides: tuple[int, ...], offset: int,
                                width: int | None) -> None:
    # float16 views of one buffer: 16 bytes are 8 elements.
    t = torch.zeros(4096, dtype=torch.float16).as_strided(shape, strides, offset)
    descs = prefill._kv_descriptors(t, 16, (32, 16))
    if width is None:
        assert descs is None
    else:
        assert descs is not None
        assert [d.shape for d in descs] == [[shape[0], width]] * 2
        assert [d.block_shape for d in descs] == [[16, 32], [16, 16]]


def test_kv_descriptors_box_limits() -> None:
    t = torch.zeros(10, 2, 64, dtype=torch.float16)
    assert prefill._kv_descriptors(t, 512, (64,)) is None  # over 256 rows
    assert prefill._kv_descriptors(t, 16, (512,)) is None  # over 256 columns
    assert prefill._kv_descriptors(t, 16, (4,)) is None  # 8 bytes a row


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize(("qk", "dv"), [(192, 128), (256, 256), (128, 128)])
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_tma_gpu(descriptors: list, qk: int, dv: int, num_heads: int, causal: bool) -> None:
    q_lens = [0, 1, 300, 1029]
    k_lens = q_lens if causal else [5, 0, 2000, 1029]
    config = replace(pick_config(qk, dv, torch.bfloat16), tma=True)
    _check(q_lens, k_lens, num_heads, qk, dv, torch.bfloat16, causal, 250, descriptors,
           config=config)


@pytest.mark.parametrize("scale", [0.0, -0.1, math.nan])
def test_rejects_non_positive_scale(scale: float) -> None:
    # The kernel scales a row's maximum raw score: only valid for a positive scale.
    x = torch.zeros(2, 1, 16, device=DEVICE)
    cu = _cu([2], DEVICE)
    with pytest.raises(ValueError, match="softmax_scale"):
        varlen_attention(x, x, x, cu, cu, 2, 2, scale, True)
