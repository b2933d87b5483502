"""The Gluon decode kernels for Hopper: which calls each takes (on the CPU, from the
shapes alone), and on a Hopper GPU their outputs against the reference and the
portable Triton kernel.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.ops import reference as ref
from pagedmla.testing import relative_error

pytest.importorskip("triton")

import triton

from pagedmla.ops.triton import _utils, mla_decode
from pagedmla.ops.triton import split_plan as split_plan_module
from pagedmla.ops.triton._utils import (
    Platform,
    device_platform,
    gluon_builds,
    multiprocessor_count,
)
from pagedmla.ops.triton.selection import decode_kernel
from tests.triton_helpers import (
    FP8,
    LSE_ATOL,
    _assert_even_plan,
    _assert_persistent_plan,
    _check_decode,
    _check_hopper_decode,
    _decode_case,
    _persistent_case,
    _poison_allocator,
    hopper,
)


@pytest.mark.parametrize("num_rows", [16, 128])
def test_hopper_kernels_only_take_cuda_tensors(num_rows: int) -> None:
    # The Gluon modules import with the installed Triton (CI: the CPU build), and the
    # dispatcher never hands them CPU tensors (the interpreter cannot run Gluon), even
    # where the shapes suit them.
    from pagedmla.ops.triton import decode_hopper, decode_hopper_heads

    q = torch.zeros(1, num_rows, 576, dtype=torch.bfloat16)
    data = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    module = decode_hopper if num_rows <= 16 else decode_hopper_heads
    assert module.supported(q, data, num_rows, 512)
    assert decode_kernel(q, data, num_rows, 512).name == "decode_triton"


@pytest.mark.parametrize(
    ("q_dtype", "cache", "page", "num_rows", "L", "takes"),
    [
        (torch.bfloat16, torch.bfloat16, 64, 16, 512, "16"),
        (torch.float16, FP8, 128, 1, 512, "16"),
        (torch.bfloat16, FP8, 32, 16, 512, "16"),  # a tile from two copies of 32 rows
        (torch.bfloat16, torch.bfloat16, 16, 16, 512, "16"),
        (torch.bfloat16, torch.bfloat16, 24, 16, 512, "16"),  # copies of 8 rows
        (torch.bfloat16, torch.bfloat16, 4, 16, 512, None),  # copies under 8 rows
        (torch.bfloat16, torch.bfloat16, 64, 17, 512, "64"),
        (torch.bfloat16, FP8, 64, 32, 512, "16"),  # fp8: two head groups of 16 rows
        (torch.bfloat16, FP8, 64, 33, 512, "64"),
        (torch.bfloat16, FP8, 4, 32, 512, "64"),  # pages the copies cannot fill
        (torch.bfloat16, torch.bfloat16, 64, 32, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 128, 128, 512, "64"),
        (torch.bfloat16, FP8, 32, 128, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 32, 128, 512, "64"),
        (torch.bfloat16, torch.bfloat16, 1, 128, 512, None),
        (torch.bfloat16, FP8, 16, 128, 512, "64"),  # fp8 rows: any page size
        (torch.bfloat16, FP8, 1, 128, 512, "64"),
        (torch.float16, torch.bfloat16, 64, 128, 512, None),  # cache dtype != q dtype
        (torch.float32, torch.float32, 64, 128, 512, None),
        (torch.bfloat16, torch.bfloat16, 64, 128, 256, None),  # not DeepSeek widths
    ],
)
def test_hopper_kernel_choice(q_dtype: torch.dtype, cache: torch.dtype, page: int,
                              num_rows: int, L: int, takes: str | None) -> None:
    # Which Gluon kernel (if any) takes a call on a Hopper GPU, from the shapes alone:
    # the 16-row kernel up to 16 query rows (fp8: up to 32, in two head groups), the
    # 64-row one above; 16-bit q; a cache of q's dtype or fp8; pages the copies can
    # fill tiles from (a multiple of 8 rows), except fp8 in the 64-row kernel, whose
    # widener loads rows of any page.
    # The decode table (`selection`) takes its first entry that supports the call: the
    # e4m3-product kernel for an fp8 cache up to 32 rows.
    q = torch.zeros(1, num_rows, L + 64, dtype=q_dtype)
    data = torch.zeros(3, page, L + 64).to(cache)
    chosen = decode_kernel(q, data, num_rows, L, platform=Platform(True, True, True)).name
    rows16 = "decode_hopper_fp8" if cache == FP8 else "decode_hopper"
    assert chosen == {None: "decode_triton", "16": rows16, "64": "decode_hopper_heads"}[takes]


@pytest.mark.parametrize(
    ("cache", "layout", "takes"),
    [
        (torch.bfloat16, "every-other-block", False),  # the copies need adjacent pages
        (FP8, "every-other-block", True),  # the widener: pages through their stride
        (FP8, "padded-rows", True),  # rows 16-byte aligned
        (FP8, "odd-row-stride", False),  # rows not 16-byte aligned
        (FP8, "page-stride-off-rows", False),  # pages not a whole number of rows apart
    ],
)
def test_hopper_kernel_choice_layouts(cache: torch.dtype, layout: str, takes: bool) -> None:
    # Cache views the 64-row kernel takes or refuses (128 query rows, page 16).
    from pagedmla.ops.triton import decode_hopper_heads

    q = torch.zeros(1, 128, 576, dtype=torch.bfloat16)
    if layout == "every-other-block":
        data = torch.zeros(8, 16, 576).to(cache)[::2]
    elif layout == "padded-rows":
        data = torch.zeros(4, 16, 592).to(cache)[..., :576]
    elif layout == "odd-row-stride":
        data = torch.zeros(4, 16, 584).to(cache)[..., :576]
    else:
        data = torch.zeros(4 * 16 * 576 + 4 * 16).to(cache)
        data = data.as_strided((4, 16, 576), (16 * 576 + 16, 576, 1))
    assert decode_hopper_heads.supported(q, data, 128, 512) == takes


@pytest.mark.parametrize(("page", "rows"), [(1, 0), (4, 0), (8, 8), (12, 0), (16, 16),
                                            (24, 8), (48, 16), (64, 32), (96, 32),
                                            (128, 32)])
def test_fp8_prefetch_rows(page: int, rows: int) -> None:
    # The fp8 widener's L2 requests: the largest power of two up to 32 dividing the page
    # (a request stays inside its page), none under 8 rows.
    from pagedmla.ops.triton.decode_hopper_heads import _prefetch_rows

    assert _prefetch_rows(page) == rows


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("block_size", [8, 16, 48, 64, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 6, 16), ([2, 1, 2, 1, 2, 2], 8), ([4, 1, 3, 4, 2, 4], 4),
                          ([1] * 6, 1)], ids=["q1-N16", "q2-N8", "q4-N4", "q1-N1"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_kernel(cache: str, block_size: int, q_lens: list[int],
                                  num_heads: int, num_splits: int | None) -> None:
    # The warp-specialized kernel (<= 16 query rows, 64-row tiles; pages of fewer than
    # 64 rows fill a tile with several copies: 8 rows per copy at page 8, 16 at 48):
    # lengths of one tile exactly, one past it, partial last tiles (NaN slots after
    # them), multi-token rows; direct output, forced splits and the planner's. It must
    # match the reference and the Triton kernel of the same config.
    seq_lens = [max(q_lens), 65, 64, 1000, 4097, 333]
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        cache_dtype, seed=800 + block_size + num_heads)
    kernel = "decode_hopper_fp8" if cache == "fp8" else "decode_hopper"
    _check_hopper_decode(args, num_heads * max(q_lens), cache == "fp8", num_splits, kernel)


def test_gluon_kernels_only_with_their_triton_release(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    # Gluon's API changes with each Triton release and the Gluon kernels are written for
    # one (_utils.GLUON_TRITON): built for sm_90a, they fail with 3.5, 3.7, 3.8 and 3.9
    # (benchmarks/compile_sm90.py). On a Hopper GPU with another release the Triton
    # kernels run, after one warning, instead of a compile error at the first call.
    major, minor = _utils.GLUON_TRITON
    assert gluon_builds(f"{major}.{minor}.0") and gluon_builds(f"{major}.{minor}.1+git5d9c6c3")
    for other in ("3.5.1", "3.7.0", "3.8.0", "3.9.0", "3.10.0", "4.6.0"):
        assert not gluon_builds(other)
    hopper_gpu = torch.device("cuda", 0)
    monkeypatch.setattr(_utils, "INTERPRETED", False)
    monkeypatch.setattr(_utils, "is_hopper", lambda device: True)
    device_platform.cache_clear()
    _utils._warn_no_gluon.cache_clear()
    try:
        monkeypatch.setattr(triton, "__version__", "3.9.0")
        with pytest.warns(RuntimeWarning, match=r"Triton 3\.9\.0 is installed"):
            assert not device_platform(hopper_gpu).runs_gluon
        monkeypatch.setattr(triton, "__version__", f"{major}.{minor}.0")
        device_platform.cache_clear()  # (the answer is kept per device)
        assert device_platform(hopper_gpu).runs_gluon
    finally:
        device_platform.cache_clear()


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 6, 32), ([2, 1, 2, 1, 2, 2], 16), ([4, 1, 3, 4, 2, 4], 8),
                          ([3, 1, 2, 3, 3, 1], 10)],
                         ids=["q1-N32", "q2-N16", "q4-N8", "q3-N10"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_fp8_two_head_groups(block_size: int, q_lens: list[int],
                                               num_heads: int,
                                               num_splits: int | None) -> None:
    # 17-32 query rows with an fp8 cache: the e4m3-product kernel in two head groups of
    # 16 rows (the second one partial at 30 rows), which read the same tiles; as the
    # 16-row test above, against the reference and the Triton kernel.
    from pagedmla.ops.triton import decode_hopper_fp8

    seq_lens = [max(q_lens), 65, 64, 1000, 4097, 333]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        FP8, seed=870 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    assert 16 < num_rows <= decode_hopper_fp8.MAX_ROWS
    _check_hopper_decode(args, num_rows, True, num_splits, "decode_hopper_fp8")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize(("q_len", "num_heads"), [(1, 16), (2, 8), (1, 1)])
def test_decode_gpu_hopper_persistent(dtype: torch.dtype, block_size: int, q_len: int,
                                      num_heads: int) -> None:
    # The 16-row kernel on a batch past one wave: programs run several splits each, the
    # ring going on from one split to the next, q reloaded per split.
    args = _persistent_case(num_heads, q_len, 512, block_size, dtype, 40, 4097,
                            seed=950 + block_size)
    plans: dict = {}
    _check_decode(args, torch.bfloat16, plans=plans)
    (plan,) = plans.values()
    _assert_persistent_plan(plan)
    _check_hopper_decode(args, num_heads * q_len, False, None, "decode_hopper")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize(("kernel", "num_heads", "q_len", "cache"),
                         [("decode_hopper_fp8", 16, 1, "fp8"), ("decode_hopper_fp8", 16, 2, "fp8"),
                          ("decode_hopper_heads", 128, 1, "bf16"),
                          ("decode_hopper_heads", 64, 2, "fp16"),
                          ("decode_hopper_heads", 128, 1, "fp8")])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_gpu_hopper_even_plan(kernel: str, num_heads: int, q_len: int, cache: str,
                                     block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernels that run one split per program, on a batch past one wave (ragged
    # lengths, empty requests, graph padding rows) with the even plan made the cheapest:
    # splits of unequal size, their rows longest first and their partials at their
    # indices, not their rows'. The 64-row kernel's wave is half as many requests (two
    # head groups at N = 128; q_len 2 x N 64).
    monkeypatch.setattr(split_plan_module, "STREAM_TILES", -10**6)
    sms = multiprocessor_count(torch.device("cuda"))
    extra = 40 if num_heads * q_len <= 32 else 40 - sms // 2
    dtype = torch.float16 if cache == "fp16" else torch.bfloat16
    args = _persistent_case(num_heads, q_len, 512, block_size, dtype, extra, 4097,
                            seed=980 + block_size + num_heads + q_len)
    if cache == "fp8":
        args = (args[0], (args[1].float() / 2).to(FP8), torch.tensor(2.0, device="cuda"),
                *args[3:])
    num_rows = num_heads * q_len
    plans: dict = {}
    _check_decode(args, torch.bfloat16, plans=plans)
    (plan,) = plans.values()
    _assert_even_plan(plan)
    _check_hopper_decode(args, num_rows, cache == "fp8", None, kernel)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 5, 128), ([1] * 5, 64), ([2, 1, 2, 2, 1], 64),
                          ([1] * 5, 40), ([3, 1, 2, 3, 3], 16), ([2, 1, 2, 2, 1], 16)],
                         ids=["q1-N128", "q1-N64", "q2-N64", "q1-N40", "q3-N16", "q2-N16"])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_decode_gpu_hopper_heads_kernel(dtype: torch.dtype, block_size: int,
                                        q_lens: list[int], num_heads: int,
                                        num_splits: int | None) -> None:
    # The 64-row kernel (more than 16 query rows): two head groups (N = 128), one
    # (N = 64), rows past N * q_len in the last group (N = 40, q_len 3 x N 16, and 32
    # rows of the rows32 config), rows of several tokens with their own causal limits;
    # lengths of one tile, one past it, and partial tiles followed by NaN slots.
    seq_lens = [max(q_lens), 65, 64, 1000, 4097]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, dtype, dtype,
                        seed=900 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    _check_hopper_decode(args, num_rows, False, num_splits, "decode_hopper_heads")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("block_size", [1, 16, 32, 48, 128])
@pytest.mark.parametrize(("q_lens", "num_heads"),
                         [([1] * 5, 128), ([2, 1, 2, 2, 1], 64), ([1] * 5, 40),
                          ([3, 1, 2, 3, 3], 16), ([2, 1, 2, 2, 1], 20)],
                         ids=["q1-N128", "q2-N64", "q1-N40", "q3-N16", "q2-N20"])
@pytest.mark.parametrize("num_splits", [1, None])
def test_decode_gpu_hopper_heads_kernel_fp8(block_size: int, q_lens: list[int],
                                            num_heads: int, num_splits: int | None) -> None:
    # The 64-row kernel with an fp8 cache: rows loaded through the block table and
    # widened by the producer warpgroup (rows past the slice end zeroed there, NaN
    # slots after them), any page size: 1 and 16 (several pages per tile, L2 requests
    # of 16 rows or none), 32 and 48 (tiles across pages), 128.
    seq_lens = [max(q_lens), 33, 64, 1000, 4097]
    args = _decode_case(q_lens, seq_lens, num_heads, 512, 64, block_size, torch.bfloat16,
                        FP8, seed=950 + block_size + num_heads)
    num_rows = num_heads * max(q_lens)
    _check_hopper_decode(args, num_rows, True, num_splits, "decode_hopper_heads")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_decode_gpu_hopper_fp8_widening_is_exact(dtype: torch.dtype, num_heads: int) -> None:
    # One visible position: its softmax weight is exactly 1, so the output row is the
    # cached latent row itself. Fill it with every finite e4m3 value (subnormals, both
    # signs, +-448) and expect each exactly (e4m3 values are exact in bf16 and fp16;
    # compared as values: -0 comes back as +0 from the accumulator). 16 heads: the
    # 16-row kernel; 128: the 64-row one.
    L, R, page = 512, 64, 64
    codes = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = codes[codes.float().isfinite()]
    row = finite.repeat(3)[: L + R]
    data = torch.full((2, page, L + R), math.nan, device="cuda").to(FP8)
    data[1, 0] = row.cuda()
    q = torch.randn(1, num_heads, L + R, device="cuda").to(dtype)
    args = (q, data, torch.tensor(1.0, device="cuda"),
            torch.tensor([[1]], dtype=torch.int32, device="cuda"),
            torch.tensor([1], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"), 1, 1, L, (L + R) ** -0.5)
    kernel = "decode_hopper_fp8" if num_heads == 16 else "decode_hopper_heads"
    assert decode_kernel(q, data, num_heads, L).name == kernel
    out = mla_decode(*args)[0]
    want = row[:L].float().cuda().expand(num_heads, L)
    assert torch.equal(out[0].float(), want)


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_gpu_hopper_fp8_products_keep_q(dtype: torch.dtype) -> None:
    # The fp8 16-row kernel multiplies e4m3 codes, q included, as two e4m3 terms per
    # entry scaled per row (within 2^-8 of each entry). Rows whose magnitudes differ by
    # up to 2^24 (bf16) / 2^12 (fp16, whose range is smaller), entries within a row
    # spread over 2^-12..1 of its largest, one row with scores in the hundreds (a
    # near-one-hot softmax): the outputs must stay within the 16-bit kernels' tolerance
    # of the float64 reference, and lse within 2^-8 of it relative to its size (the
    # scores' own error; an e4m3 cache entry is itself only within 2^-4 of the value
    # it stores).
    args = list(_decode_case([1, 1, 1], [700, 4097, 64], 16, 512, 64, 64, dtype, FP8,
                             seed=951))
    gen = torch.Generator().manual_seed(952)
    span = 24 if dtype == torch.bfloat16 else 12
    row_exp = torch.linspace(-span / 2, span / 2, 16).round()
    spread = torch.exp2(-12 * torch.rand(args[0].shape, generator=gen))
    q = args[0].float().cpu() * spread * torch.exp2(row_exp)[None, :, None]
    q[:, 3] *= 4096 / q[:, 3].abs().amax()  # large scores: a near-one-hot softmax
    args[0] = q.to(args[0].device, dtype)
    assert decode_kernel(args[0], args[1], 16, 512).name == "decode_hopper_fp8"
    want_out, want_lse = ref.mla_decode(*args)
    assert want_lse[3].abs().min() > 100
    for num_splits in (1, None):
        _poison_allocator("cuda")
        out, lse = mla_decode(*args, num_splits=num_splits)
        assert relative_error(out, want_out.double()) < 1e-2
        torch.testing.assert_close(lse, want_lse, atol=LSE_ATOL[torch.bfloat16], rtol=2**-8)


@pytest.mark.cuda
@hopper
def test_decode_gpu_hopper_heads_fp8_scattered_pages() -> None:
    # The fp8 64-row kernel on every other block of a bigger cache (NaN in the blocks
    # between): pages not adjacent in rows, which the 16-bit path's bulk copies cannot
    # take; the fp8 widener addresses each page through its stride.
    args = list(_decode_case([1] * 4, [1, 65, 1000, 4097], 128, 512, 64, 16, torch.bfloat16,
                             FP8, seed=995))
    data = args[1]
    spread = torch.full((2 * data.shape[0], *data.shape[1:]), math.nan, device="cuda")
    spread = spread.to(FP8)
    spread[::2] = data
    args[1] = spread[::2]
    _check_hopper_decode(tuple(args), 128, True, None, "decode_hopper_heads")


@pytest.mark.cuda
@hopper
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("num_heads", [16, 128])
def test_decode_gpu_hopper_padded_rows(cache: str, num_heads: int) -> None:
    # The Gluon kernels on a cache whose rows are padded to 640 columns, NaN in the
    # padding: the bulk copies (16-bit) and the fp8 widener's row loads follow the row
    # stride. 16 heads: the 16-row kernel; 128: the 64-row one.
    cache_dtype = FP8 if cache == "fp8" else torch.bfloat16
    args = list(_decode_case([1] * 4, [1, 65, 1000, 4097], num_heads, 512, 64, 64,
                             torch.bfloat16, cache_dtype, seed=990 + num_heads))
    data = args[1]
    wide = torch.full((*data.shape[:2], 640), math.nan, device="cuda").to(cache_dtype)
    wide[..., :data.shape[2]] = data
    args[1] = wide[..., :data.shape[2]]
    rows16 = "decode_hopper_fp8" if cache == "fp8" else "decode_hopper"
    kernel = rows16 if num_heads == 16 else "decode_hopper_heads"
    _check_hopper_decode(tuple(args), num_heads, cache == "fp8", None, kernel)
