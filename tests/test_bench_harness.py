"""The benchmark harness (benchmarks/): its read-ceiling kernel, its decode baseline, its
timers, its SM-clock parsing, and the row matching of `compare_results`.

The timers need a GPU; the read kernel runs in Triton's interpreter on the CPU
(tests/conftest.py sets TRITON_INTERPRET=1 there); the rest runs anywhere.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from pagedmla.ops import reference as ref
from pagedmla.ops.triton._utils import INTERPRETED
from pagedmla.testing import relative_error

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"

runnable = pytest.mark.skipif(
    not (HAS_CUDA or INTERPRETED),
    reason="needs CUDA or TRITON_INTERPRET=1 set before triton is imported "
    "(tests/conftest.py sets it when CUDA is missing)",
)
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8191, 3 * 8192 + 5])
def test_stream_read_sums_every_element(dtype: torch.dtype, n: int) -> None:
    # The benchmark's read-ceiling kernel (harness.stream_read): one partial sum per
    # run of 8192 elements, the masked tail included, adding up to the tensor's sum.
    from benchmarks.harness import stream_read

    x = torch.randn(n, device=DEVICE).to(dtype)
    parts = stream_read(x)()
    assert parts.shape == (math.ceil(n / 8192),)
    assert math.isclose(parts.double().sum().item(), x.double().sum().item(), abs_tol=1e-3)


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_baseline_attends_as_the_reference(block_size: int) -> None:
    # The benchmark's decode baseline (baselines.torch_decode, gather + bf16 bmm) must
    # compute what mla_decode computes, or the speed-ups against it would mean nothing.
    # (The paged case of the kernel tests: NaN in unused slots, pages permuted.)
    from benchmarks.baselines import torch_decode
    from tests.triton_helpers import _decode_case

    seq_lens = [4 * block_size] * 3
    args = _decode_case([1, 1, 1], seq_lens, 16, 512, 64, block_size, torch.bfloat16,
                        torch.bfloat16, seed=41, device="cpu")
    out, lse = torch_decode(*args)
    want, want_lse = ref.mla_decode(*args)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert relative_error(out, want.double()) < 1e-2
    torch.testing.assert_close(lse, want_lse, atol=2e-3, rtol=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        torch_decode(*args[:7], 4 * block_size - 1, *args[8:])


@runnable
@pytest.mark.parametrize("cache", ["fp8_ds_mla", "bf16"])
def test_sparse_bench_gathers_the_selected_rows(cache: str, monkeypatch) -> None:
    # benchmarks/bench_sparse.py, at a small context: its indices are distinct positions
    # each query sees, its slots those positions' through the block table, its plain
    # gather (`gather_read`) reads exactly those rows (word sums), and its fp8_ds_mla
    # cache holds the bf16 rows as entries.
    from benchmarks import bench_sparse as bs
    from pagedmla.testing import ds_mla_entries

    monkeypatch.setattr(bs, "DEV", DEVICE)
    monkeypatch.setattr(bs, "CONTEXT", 300)
    monkeypatch.setattr(bs, "TOPK", 40)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q_len, blocks = 2, 3 * 300 // bs.PAGE + 4
    indices = bs.topk_indices(3, q_len, gen)
    assert indices.shape == (6, 40) and indices.dtype == torch.int32
    limit = torch.tensor([298, 299] * 3, device=DEVICE).view(-1, 1)
    assert ((indices >= 0) & (indices <= limit)).all()
    assert all(len(set(row.tolist())) == 40 for row in indices)

    table = torch.randperm(blocks, device=DEVICE)[:15].int().view(3, 5)
    slots = bs.selected_slots(indices, table, q_len)
    request = torch.arange(6, device=DEVICE).repeat_interleave(40) // q_len
    flat_pos = indices.reshape(-1).long()
    want = table[request, flat_pos // bs.PAGE].long() * bs.PAGE + flat_pos % bs.PAGE
    assert torch.equal(slots, want)

    data = torch.randn(blocks, bs.PAGE, 576, device=DEVICE).to(torch.bfloat16)
    if cache == "fp8_ds_mla":
        rows = data.view(-1, 576).cpu()
        data = bs.ds_mla_cache(data)
        assert torch.equal(data.view(-1, 656).cpu(), ds_mla_entries(rows[:, :512], rows[:, 512:]))
    words = data.view(torch.int32).view(-1, data.shape[-1] * data.element_size() // 4)
    sums = bs.gather_read(data, slots)()
    gathered = words[slots].long().sum(dim=1)
    want_sums = gathered.view(-1, 16).sum(dim=1)
    assert torch.equal(sums.long() & 0xFFFFFFFF, want_sums & 0xFFFFFFFF)


@pytest.mark.parametrize("context", [0, 20])
def test_sparse_bench_prefill_indices_are_the_visible_positions(context: int,
                                                                monkeypatch) -> None:
    # benchmarks/bench_sparse.py --prefill: query i of a prefill after `context`
    # positions holds min(topk, context + i + 1) distinct positions it sees (all of them
    # where it sees fewer than topk), then -1; the pairs it counts are those entries.
    from benchmarks import bench_sparse as bs

    monkeypatch.setattr(bs, "DEV", DEVICE)
    monkeypatch.setattr(bs, "TOPK", 40)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    indices = bs.prefill_indices(50, context, gen, rows=16)  # four chunks of queries
    assert indices.shape == (50, 40) and indices.dtype == torch.int32
    for i, row in enumerate(indices.tolist()):
        seen = context + i + 1
        held = min(40, seen)
        assert row[held:] == [-1] * (40 - held)
        assert len(set(row[:held])) == held and all(0 <= p < seen for p in row[:held])
        if seen <= 40:
            assert set(row[:held]) == set(range(seen))
    # C = 0: queries 0..38 see 1..39 positions (780 pairs), 11 see at least 40;
    # C = 20: queries 0..18 see 21..39 (570 pairs), 31 see at least 40.
    want = 780 + 11 * 40 if context == 0 else 570 + 31 * 40
    assert bs.prefill_pairs(50, context, 40) == want == int((indices >= 0).sum())

    # Fewer positions in all than topk: every row holds all it sees.
    short = bs.prefill_indices(10, 0, gen)
    assert [set(row) - {-1} for row in short.tolist()] == [set(range(i + 1))
                                                          for i in range(10)]
    assert bs.prefill_pairs(10, 0, 40) == 55 == int((short >= 0).sum())


def test_sparse_bench_lists_the_prefill_shapes(capsys) -> None:
    # `--list` needs no GPU and prints both modes' shapes: with --quick, decode at B = 64
    # and prefill at S = 4096 (C = 0 and the request at 32k positions), N = 128 and 16,
    # both caches.
    from benchmarks import bench_sparse as bs

    assert bs.main(["--list", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    prefill = [line for line in lines if line.startswith("prefill ")]
    assert len(lines) == 16 and len(prefill) == 8
    assert {line.split()[2] for line in prefill} == {"C=0", "C=28672"}
    # C = 0, S = 4096: 2047 queries see 1..2047 positions, 2049 see at least 2048.
    assert f"pairs={2047 * 2048 // 2 + 2049 * 2048} " in prefill[0]


@pytest.mark.cuda
@cuda
def test_bench_covered_keeps_host_work_off_the_clock() -> None:
    # A call whose host side takes 2 ms ahead of a ~30 µs kernel: timed as `bench`
    # times it, the GPU's wait for the host counts; `bench_covered` gives the kernel's
    # time (also after a read-only wipe), and `host_us` the host's.
    from benchmarks.harness import bench, bench_covered, host_us

    x = torch.randn(1 << 24, device=DEVICE)

    def call() -> None:
        time.sleep(2e-3)
        x.mul_(1.0)

    kernel_us = bench_covered(lambda: x.mul_(1.0), rep_ms=20)
    assert kernel_us < 500
    # After a wipe that reads instead of writing, no write-back shares the call's HBM.
    assert bench_covered(lambda: x.mul_(1.0), rep_ms=20, clean_l2=True) < kernel_us + 50
    assert bench_covered(call, rep_ms=20, max_calls=20) < kernel_us + 100
    assert bench(call, rep_ms=40) > 1500
    assert 1900 < host_us(call, calls=10) < 20000


def test_sm_clock_median_skips_what_is_not_a_number() -> None:
    # harness.SmClock's samples: nvidia-smi prints one clock per line, "[N/A]" where
    # it has none; the median is over the numbers, None without any.
    from benchmarks.harness import median_sample

    assert median_sample("1980\n1410\n[N/A]\n1755\n") == 1755.0
    assert median_sample("1500\n1400\n") == 1450.0
    assert median_sample("") is None
    assert median_sample("[N/A]\n") is None


def _decode_row(us: float, **shape: object) -> dict:
    row = {"kernel": "mla_decode", "cache": "bf16", "regime": "memory", "B": 64, "N": 16,
           "context": 2048, "q_len": 1, "page": 64, "us": us, "baseline_us": None}
    row.update(shape)
    return row


def _report(rows: list[dict], **fields: object) -> dict:
    report = {"gpu": "test", "commit": "x", "ceilings": {}, "results": rows,
              "configs": {"rows16": {"block_h": 16}}, "decode_regimes": {"16": 16}}
    report.update(fields)
    return report


def _prefill_row(kernel: str, us: float) -> dict:
    return {"kernel": kernel, "shape": "S=4096 causal", "N": 16, "tokens": 4096, "qk": 192,
            "v": 128, "causal": True, "us": us}


def test_compare_results_matches_rows_by_shape() -> None:
    # Rows pair up by their shape keys, whatever their order; a cache dtype, a page size
    # or a ragged batch's lengths make different rows; the prefill kernels of one shape
    # are two rows.
    from benchmarks.compare_results import compare, match_rows

    old = [_decode_row(100.0), _decode_row(60.0, cache="fp8"),
           _decode_row(200.0, page=16),
           _decode_row(90.0, context=131072, lengths="1 x 131072 + 63 x 2048"),
           {"kernel": "merge_attn_states", "T": 16384, "N": 128, "D": 128, "us": 400.0},
           _prefill_row("varlen_attention", 180.0), _prefill_row("prefill_attention", 190.0)]
    # Reversed, each time within 3%: every row matched, none outside.
    new = [dict(r, us=r["us"] * 1.02) for r in reversed(old)]
    pairs, only_old, only_new = match_rows(old, new)
    assert [a["us"] * 1.02 for a, _ in pairs] == [b["us"] for _, b in pairs]
    assert len(pairs) == len(old) and not only_old and not only_new
    result = compare(_report(old), _report(new), tolerance=0.03)
    assert not result.failed and result.outside == 0 and len(result.rows) == len(old)

    # One row 5% slower and one 5% faster: both outside 3%, inside 6%.
    new[0] = dict(new[0], us=old[-1]["us"] * 1.05)  # prefill_attention
    new[-1] = dict(new[-1], us=old[0]["us"] * 0.95)  # the bf16 decode row
    result = compare(_report(old), _report(new), tolerance=0.03)
    assert result.failed and result.outside == 2
    assert {label for label, *_, out in result.rows if out} == {
        "mla_decode cache=bf16 B=64 N=16 context=2048 q_len=1 page=64",
        "prefill_attention shape=S=4096 causal N=16 qk=192 v=128 causal=True"}
    assert not compare(_report(old), _report(new), tolerance=0.06).failed


def test_compare_results_fails_on_unmatched_rows_and_schema_changes() -> None:
    from benchmarks.compare_results import compare, match_rows

    old = [_decode_row(100.0), _decode_row(50.0, N=128)]
    new = [_decode_row(100.0), _decode_row(50.0, N=64)]
    result = compare(_report(old), _report(new))
    assert result.failed and len(result.rows) == 1
    assert result.only_old == ["mla_decode cache=bf16 B=64 N=128 context=2048 q_len=1 page=64"]
    assert result.only_new == ["mla_decode cache=bf16 B=64 N=64 context=2048 q_len=1 page=64"]
    # A row that gained a field, a report field lost, other kernel configs.
    new = [dict(_decode_row(100.0), sm_mhz=1980.0), _decode_row(50.0, N=128)]
    result = compare(_report(old), {k: v for k, v in _report(new).items() if k != "commit"})
    assert result.failed and result.outside == 0 and len(result.schema) == 2
    assert compare(_report(old), _report(old, configs={})).schema == ["configs differ"]
    # A row without the compared time is matched but not compared.
    assert len(compare(_report(old), _report(old), metric="baseline_us").rows) == 0
    with pytest.raises(ValueError, match="two rows"):
        match_rows([_decode_row(1.0), _decode_row(2.0)], [])
