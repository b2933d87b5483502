"""Which kernel runs a call (`ops/triton/selection.py`), on the CPU: the decode and prefill
tables' choices with the device's facts faked (`Platform`: a Hopper GPU with the Triton
release the Gluon kernels are written for, a Hopper GPU with another release, another
GPU, the interpreter), against expectation tables written out here; and the decode table
of docs/kernels.md against the code's.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import pagedmla.ops.triton as triton_ops
from pagedmla.ops.triton import prefill_cudnn, selection
from pagedmla.ops.triton._utils import GLUON_TRITON, Platform
from pagedmla.ops.triton.decode_triton import DECODE_CONFIGS, pick_config
from pagedmla.ops.triton.selection import decode_kernel, decode_kernels, prefill_kernel
from tests.triton_helpers import FP8, TINY_DECODE, _check_decode, _decode_case, runnable

HOPPER = Platform(cudnn=True, hopper=True, gluon=True)  # H100/H200 with Triton 3.6
HOPPER_NO_GLUON = Platform(cudnn=True, hopper=True, gluon=False)
OTHER_GPU = Platform(cudnn=True, hopper=False, gluon=True)  # e.g. an A100
INTERPRETER = Platform(cudnn=False, hopper=False, gluon=False)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": FP8,
          "fp8_ds_mla": torch.uint8}


def _width(cache: str, L: int, R: int) -> int:
    """A cache row's elements: L + R, or fp8_ds_mla's 656 bytes."""
    return 656 if cache == "fp8_ds_mla" else L + R


def _cache(dtype: torch.dtype, page: int, width: int, layout: str) -> torch.Tensor:
    """A cache [blocks, page, width] of `dtype` in one of the layouts a caller may pass:
    contiguous; every other block of a bigger one (pages not adjacent); rows padded to a
    wider buffer (16-byte aligned); rows whose stride is 8 bytes off 16-byte alignment;
    pages a stride apart that is not a whole number of rows."""
    if layout == "contiguous":
        return torch.zeros(4, page, width).to(dtype)
    if layout == "every-other-block":
        return torch.zeros(8, page, width).to(dtype)[::2]
    if layout == "padded-rows":
        return torch.zeros(4, page, width + 16).to(dtype)[..., :width]
    if layout == "odd-row-stride":
        pad = 8 // torch.empty((), dtype=dtype).element_size()
        return torch.zeros(4, page, width + pad).to(dtype)[..., :width]
    assert layout == "page-stride-off-rows"
    data = torch.zeros(4 * page * width + 4 * 16).to(dtype)
    return data.as_strided((4, page, width), (page * width + 16, width, 1))


# (platform, q dtype, cache dtype, query rows per request, page size, cache layout,
#  L, R) -> the stage-1 kernel that runs.
DECODE_CHOICES = [
    # A Hopper GPU with Triton 3.6: a 16-bit cache of q's dtype.
    (HOPPER, "bf16", "bf16", 1, 64, "contiguous", 512, 64, "decode_hopper"),
    (HOPPER, "bf16", "bf16", 16, 64, "contiguous", 512, 64, "decode_hopper"),
    (HOPPER, "fp16", "fp16", 16, 128, "contiguous", 512, 64, "decode_hopper"),
    (HOPPER, "bf16", "bf16", 16, 8, "contiguous", 512, 64, "decode_hopper"),
    (HOPPER, "bf16", "bf16", 16, 24, "contiguous", 512, 64, "decode_hopper"),
    (HOPPER, "bf16", "bf16", 16, 4, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 16, 12, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 16, 1, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 17, 64, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "bf16", 32, 16, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "fp16", "fp16", 128, 8, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "bf16", 128, 4, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 128, 1, "contiguous", 512, 64, "decode_triton"),
    # fp8 cache.
    (HOPPER, "bf16", "fp8", 1, 64, "contiguous", 512, 64, "decode_hopper_fp8"),
    (HOPPER, "fp16", "fp8", 16, 128, "contiguous", 512, 64, "decode_hopper_fp8"),
    (HOPPER, "bf16", "fp8", 32, 64, "contiguous", 512, 64, "decode_hopper_fp8"),
    (HOPPER, "bf16", "fp8", 32, 8, "contiguous", 512, 64, "decode_hopper_fp8"),
    (HOPPER, "bf16", "fp8", 33, 64, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "fp8", 128, 16, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "fp8", 16, 4, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 17, 4, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "fp8", 32, 1, "contiguous", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "fp8", 128, 1, "contiguous", 512, 64, "decode_hopper_heads"),
    # What no Gluon kernel takes: other dtypes, widths.
    (HOPPER, "fp16", "bf16", 16, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp16", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "fp32", "fp32", 16, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "fp32", "fp8", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 16, 64, "contiguous", 256, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 128, 64, "contiguous", 512, 0, "decode_triton"),
    # Cache layouts.
    (HOPPER, "bf16", "bf16", 16, 64, "every-other-block", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "bf16", 128, 16, "every-other-block", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 16, 64, "every-other-block", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 32, 64, "every-other-block", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "fp8", 128, 16, "every-other-block", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "bf16", 16, 64, "padded-rows", 512, 64, "decode_hopper"),
    (HOPPER, "bf16", "fp8", 128, 16, "padded-rows", 512, 64, "decode_hopper_heads"),
    (HOPPER, "bf16", "bf16", 16, 64, "odd-row-stride", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 128, 16, "odd-row-stride", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8", 128, 16, "page-stride-off-rows", 512, 64, "decode_triton"),
    # Where the Gluon kernels cannot run, the portable kernel takes everything.
    (HOPPER_NO_GLUON, "bf16", "bf16", 16, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER_NO_GLUON, "bf16", "fp8", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (OTHER_GPU, "bf16", "fp8", 16, 64, "contiguous", 512, 64, "decode_triton"),
    (OTHER_GPU, "bf16", "bf16", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (INTERPRETER, "fp16", "fp16", 16, 64, "contiguous", 512, 64, "decode_triton"),
    # fp8_ds_mla: the portable kernel everywhere (the Gluon kernels read rows of L + R
    # values, 16-bit or per-tensor fp8).
    (HOPPER, "bf16", "fp8_ds_mla", 1, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8_ds_mla", 32, 8, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "bf16", "fp8_ds_mla", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (HOPPER, "fp32", "fp8_ds_mla", 16, 1, "contiguous", 512, 64, "decode_triton"),
    (OTHER_GPU, "bf16", "fp8_ds_mla", 128, 64, "contiguous", 512, 64, "decode_triton"),
    (INTERPRETER, "fp32", "fp8_ds_mla", 4, 16, "contiguous", 512, 64, "decode_triton"),
]


@pytest.mark.parametrize(
    ("platform", "q_dtype", "cache", "rows", "page", "layout", "L", "R", "want"),
    DECODE_CHOICES)
def test_decode_table_choices(platform: Platform, q_dtype: str, cache: str, rows: int,
                              page: int, layout: str, L: int, R: int, want: str) -> None:
    q = torch.zeros(1, rows, L + R, dtype=DTYPES[q_dtype])
    data = _cache(DTYPES[cache], page, _width(cache, L, R), layout)
    assert decode_kernel(q, data, rows, L, platform=platform).name == want


# (kernel, rows per program, positions per tile, persistent, a split's cost past one
#  wave in tiles, a last partial wave's cost there, lets the combine launch early).
DECODE_SPECS = [
    ("decode_hopper_fp8", 16, 64, False, 4, 0.9, True),
    ("decode_hopper", 16, 64, True, 0, 0.6, True),
    ("decode_hopper_heads", 64, 64, False, 0, 0.9, True),
]


def test_decode_table_order_and_specs() -> None:
    # The Gluon entries in the order they are tried, then the portable kernel.
    table = decode_kernels(HOPPER, DECODE_CONFIGS["rows16"], 16)
    assert [entry.name for entry in table] == [
        "decode_hopper_fp8", "decode_hopper", "decode_hopper_heads", "decode_triton"]
    for entry, (name, block_h, block_n, persistent, past, tail, pdl) in zip(table,
                                                                            DECODE_SPECS):
        assert entry.gluon and entry.name == name
        assert (entry.block_h, entry.block_n, entry.persistent, entry.past_wave_tiles,
                entry.tail_wave, entry.pdl) == (block_h, block_n, persistent, past, tail, pdl)
    for platform in (HOPPER_NO_GLUON, OTHER_GPU, INTERPRETER):
        assert [e.name for e in decode_kernels(platform, TINY_DECODE, 16)] == ["decode_triton"]


# (query rows per request, q dtype, fp8 cache) -> the regime's config, and the portable
# kernel's rows per program and tile for it.
REGIMES = [
    (1, torch.bfloat16, False, "rows16", 16, 64),
    (16, torch.float16, False, "rows16", 16, 64),
    (17, torch.bfloat16, False, "rows32", 32, 64),
    (32, torch.bfloat16, False, "rows32", 32, 64),
    (33, torch.bfloat16, False, "rows64", 64, 64),
    (128, torch.bfloat16, False, "rows64", 64, 64),
    (5, torch.bfloat16, True, "rows16-fp8", 16, 64),
    (24, torch.float16, True, "rows32-fp8", 32, 64),
    (128, torch.bfloat16, True, "rows64-fp8", 64, 64),
    (128, torch.float32, False, "fp32", 16, 16),
    (3, torch.float32, True, "fp32", 16, 16),
]


@pytest.mark.parametrize(("rows", "dtype", "fp8", "regime", "block_h", "block_n"), REGIMES)
def test_decode_regimes(rows: int, dtype: torch.dtype, fp8: bool, regime: str,
                        block_h: int, block_n: int) -> None:
    config = pick_config(rows, dtype, fp8)
    assert config == DECODE_CONFIGS[regime]
    q = torch.zeros(1, rows, 80, dtype=dtype)
    data = torch.zeros(2, 16, 80).to(FP8 if fp8 else dtype)
    portable = decode_kernel(q, data, rows, 64, platform=HOPPER)
    assert portable.name == "decode_triton"
    assert (portable.block_h, portable.block_n, portable.persistent, portable.pdl) == (
        block_h, block_n, True, False)
    assert (portable.past_wave_tiles, portable.tail_wave) == (0, 0.6)


def test_decode_table_without_gluon_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Triton whose Gluon cannot be imported leaves the portable kernel alone, even on
    # a platform that would run the Gluon kernels.
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    data = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    # (A module set to None in sys.modules fails to import, as one that needs a Gluon
    # this Triton lacks.)
    decode_kernels(HOPPER, TINY_DECODE, 16)  # the modules imported once
    monkeypatch.delattr(triton_ops, "decode_hopper")
    monkeypatch.setitem(sys.modules, "pagedmla.ops.triton.decode_hopper", None)
    selection._gluon_decode_kernels.cache_clear()
    try:
        assert decode_kernel(q, data, 16, 512, platform=HOPPER).name == "decode_triton"
    finally:
        monkeypatch.undo()
        selection._gluon_decode_kernels.cache_clear()
    assert decode_kernel(q, data, 16, 512, platform=HOPPER).name == "decode_hopper"


@runnable
def test_decode_config_runs_the_portable_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # `config=` runs the portable kernel with those launch parameters, also where the
    # platform would run a Gluon kernel (16 query rows, fp16, DeepSeek widths): here on
    # the interpreter, with Hopper's facts faked.
    monkeypatch.setattr(selection, "device_platform", lambda device: HOPPER)
    args = _decode_case([1, 1], [40, 70], 16, 512, 64, 16, torch.float16, torch.float16,
                        seed=80)
    assert decode_kernel(args[0], args[1], 16, 512).name == "decode_hopper"
    _check_decode(args, torch.float16, config=TINY_DECODE, num_splits=2)


def _prefill_call(dtype: str, q_lens: list[int], k_lens: list[int], qk: int, dv: int,
                  layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v for sequences of these lengths, N = 2; k and v views of one buffer
    ("kv"), that buffer's rows padded by 4 elements ("odd-stride": head stride not a
    multiple of 16 bytes), or heads outermost in memory ("heads-outer")."""
    q = torch.zeros(sum(q_lens), 2, qk, dtype=DTYPES[dtype])
    pad = 4 if layout == "odd-stride" else 0
    kv = torch.zeros(sum(k_lens), 2, qk + dv + pad, dtype=DTYPES[dtype])
    if layout == "heads-outer":
        kv = torch.zeros(2, sum(k_lens), qk + dv, dtype=DTYPES[dtype]).transpose(0, 1)
    return q, kv[..., :qk], kv[..., qk:qk + dv]


# (platform, dtype, q_lens, k_lens, causal, qk and v head dims, the layout of q, k and v
# (`_prefill_call`), softmax scale) -> the prefill kernel that runs, and the one our
# kernels' part of the table picks (`varlen_attention`, or a call cuDNN refuses): cudnn,
# hopper (prefill_hopper) or triton (prefill_triton).
PREFILL_CHOICES = [
    # Equal lengths: cuDNN, whatever the head dims; our kernels' part picks as for any call.
    (HOPPER, "bf16", [64, 64], [64, 64], True, 192, 128, "kv", 0.1, "cudnn", "hopper"),
    (HOPPER, "fp16", [300], [300], True, 192, 128, "kv", 0.1, "cudnn", "hopper"),
    (HOPPER, "bf16", [40, 40], [100, 100], False, 192, 128, "kv", 0.1, "cudnn", "hopper"),
    (HOPPER, "bf16", [64, 64], [64, 64], True, 48, 24, "kv", 0.1, "cudnn", "triton"),
    # Causal but not square, or ragged: the Gluon kernel for the head dims its copies cover.
    (HOPPER, "bf16", [40, 40], [90, 90], True, 192, 128, "kv", 0.1, "hopper", "hopper"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 192, 128, "kv", 0.1, "hopper", "hopper"),
    (HOPPER, "fp16", [5, 77], [5, 77], True, 128, 128, "kv", 0.1, "hopper", "hopper"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 256, 256, "kv", 0.1, "hopper", "hopper"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 64, 64, "kv", 0.1, "hopper", "hopper"),
    # Head dims, layouts, dtypes and scales the Gluon kernel does not take.
    (HOPPER, "bf16", [5, 77], [5, 77], True, 48, 24, "kv", 0.1, "triton", "triton"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 192, 96, "kv", 0.1, "triton", "triton"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 192, 128, "odd-stride", 0.1, "triton", "triton"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 192, 128, "heads-outer", 0.1, "triton", "triton"),
    (HOPPER, "fp32", [64, 64], [64, 64], True, 192, 128, "kv", 0.1, "triton", "triton"),
    # A scale that is not positive: neither cuDNN nor the Gluon kernel.
    (HOPPER, "bf16", [64, 64], [64, 64], True, 192, 128, "kv", -0.1, "triton", "triton"),
    (HOPPER, "bf16", [5, 77], [5, 77], True, 192, 128, "kv", 0.0, "triton", "triton"),
    # Without the Gluon kernels: cuDNN for equal lengths, else the Triton kernel.
    (HOPPER_NO_GLUON, "bf16", [64, 64], [64, 64], True, 192, 128, "kv", 0.1, "cudnn", "triton"),
    (HOPPER_NO_GLUON, "bf16", [5, 77], [5, 77], True, 192, 128, "kv", 0.1, "triton", "triton"),
    (OTHER_GPU, "bf16", [64, 64], [64, 64], True, 192, 128, "kv", 0.1, "cudnn", "triton"),
    (OTHER_GPU, "bf16", [5, 77], [5, 77], True, 192, 128, "kv", 0.1, "triton", "triton"),
    # Nor cuDNN under the interpreter.
    (INTERPRETER, "fp16", [64, 64], [64, 64], True, 192, 128, "kv", 0.1, "triton", "triton"),
]


@pytest.mark.parametrize(
    ("platform", "dtype", "q_lens", "k_lens", "causal", "qk", "dv", "layout", "scale",
     "want", "ours"), PREFILL_CHOICES)
def test_prefill_table_choices(platform: Platform, dtype: str, q_lens: list[int],
                               k_lens: list[int], causal: bool, qk: int, dv: int,
                               layout: str, scale: float, want: str, ours: str,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_cudnn, "_REFUSED", set())
    q, k, v = _prefill_call(dtype, q_lens, k_lens, qk, dv, layout)
    call = (q, k, v, len(q_lens), max(q_lens), max(k_lens), scale, causal)
    names = {"cudnn": "cudnn", "hopper": "prefill_hopper", "triton": "prefill_triton"}
    assert prefill_kernel(*call, platform=platform).name == names[want]
    assert prefill_kernel(*call, cudnn=False, platform=platform).name == names[ours]


def test_prefill_table_after_a_cudnn_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    # A kind of input cuDNN refused once goes to the next entry, later calls included.
    monkeypatch.setattr(prefill_cudnn, "_REFUSED", set())
    q, k, v = _prefill_call("bf16", [64, 64], [64, 64], 192, 128, "kv")
    call = (q, k, v, 2, 64, 64, 0.1, True)
    assert prefill_kernel(*call, platform=HOPPER).name == "cudnn"
    prefill_cudnn.refuse(q, k, v)
    assert prefill_kernel(*call, platform=HOPPER).name == "prefill_hopper"
    assert prefill_kernel(*call, platform=OTHER_GPU).name == "prefill_triton"


# --- docs/kernels.md's decode table against the code -----------------------------------

DOC = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"
DOC_HEADER = ["GPU", "cache dtype", "query rows per request", "page size", "kernel", "why"]
# The calls the doc's table is checked on: every platform, a 16-bit cache of q's dtype or
# fp8, query rows and page sizes either side of each boundary the table draws.
DOC_PLATFORMS = [HOPPER, HOPPER_NO_GLUON, OTHER_GPU, INTERPRETER]
DOC_CACHES = [("bf16", "bf16"), ("fp16", "fp16"), ("bf16", "fp8"), ("fp16", "fp8"),
              ("bf16", "fp8_ds_mla"), ("fp32", "fp8_ds_mla")]
DOC_ROWS = [1, 2, 16, 17, 24, 32, 33, 64, 128]
DOC_PAGES = [1, 2, 4, 8, 12, 16, 20, 24, 64, 128]


def _doc_decode_rows() -> list[list[str]]:
    """The rows of the table in docs/kernels.md's decode section, as stripped cells."""
    section = DOC.read_text().split("\n## Decode\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]
    assert rows[0] == DOC_HEADER and set(rows[1]) == {"---"}
    return rows[2:]


def _doc_matches(row: list[str], platform: Platform, q_dtype: str, cache: str, rows: int,
                 page: int) -> bool:
    """Whether a row of the doc's table covers the call (its cells read as the doc
    states them)."""
    gpu, cache_cell, rows_cell, page_cell = row[:4]
    major, minor = GLUON_TRITON
    if gpu == f"Hopper, Triton {major}.{minor}":
        gpu_ok = platform == HOPPER
    elif gpu == "any":
        gpu_ok = True
    else:
        assert gpu == "any other", gpu
        gpu_ok = platform != HOPPER
    # A cell lists cache dtypes ("bf16" and "fp16" stand for a cache of the query's dtype).
    cache_ok = cache_cell == "any" or (cache in cache_cell.split(", ") and (
        cache in ("fp8", "fp8_ds_mla") or cache == q_dtype))
    if rows_cell == "any":
        rows_ok = True
    elif rows_cell.endswith("+"):
        rows_ok = rows >= int(rows_cell[:-1])
    else:
        low, high = map(int, rows_cell.split("-"))
        rows_ok = low <= rows <= high
    page_ok = {"multiple of 8": page % 8 == 0, "other": page % 8 != 0, "any": True}[page_cell]
    return gpu_ok and cache_ok and rows_ok and page_ok


def test_doc_decode_table_is_the_code_table() -> None:
    # Each call of the grid is covered by exactly one row of the doc's table, and that
    # row names the kernel the code's table picks for it.
    table = _doc_decode_rows()
    assert len(table) >= 8
    for platform in DOC_PLATFORMS:
        for q_dtype, cache in DOC_CACHES:
            for rows in DOC_ROWS:
                for page in DOC_PAGES:
                    call = (platform, q_dtype, cache, rows, page)
                    matches = [row for row in table if _doc_matches(row, *call)]
                    assert len(matches) == 1, (call, matches)
                    want = matches[0][4].strip("`")
                    q = torch.zeros(1, rows, 576, dtype=DTYPES[q_dtype])
                    data = _cache(DTYPES[cache], page, _width(cache, 512, 64), "contiguous")
                    got = decode_kernel(q, data, rows, 512, platform=platform).name
                    assert got == want, (call, got, want)
