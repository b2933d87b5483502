"""Triton backend kernels on one GPU: correctness sweep, then speed against ceilings.

    pagedmla bench --kernels --out results/                               # check + full run
    python3 benchmarks/bench_kernels.py --out bench_kernels.json         # the same
    python3 benchmarks/bench_kernels.py --quick --out bench_kernels.json # check + fewer shapes
    python3 benchmarks/bench_kernels.py --check-only                     # correctness only
    python3 benchmarks/bench_kernels.py --sweep-configs [decode|prefill] # time config variants
    python3 benchmarks/bench_kernels.py --plots-from bench_kernels.json --plots results/

Every run first checks each kernel against the PyTorch reference on fresh random inputs
(NaN-poisoned outputs and unused cache slots, a CUDA graph captured with short contexts
and replayed with long ones) and stops on the first failure. Then it measures, in the
same process: the card's HBM read bandwidth (the faster of a large torch.sum and a plain
streaming-read Triton kernel, `stream_read`) and copy bandwidth, the bf16 matmul rate
(8192^3, random data), and our kernels against baselines (a plain PyTorch gather + bmm
decode, `torch_decode`, and on three shapes the float32 reference op; torch.compile'd
merge; PyTorch SDPA for dense causal prefill). Times are medians of
triton.testing.do_bench, which wipes a 256 MB buffer (several times the 60 MB L2) before
every call; decode rows time CUDA-graph replays, prefill rows (ours and SDPA's)
`bench_covered`, which keeps the host's launch work off the clock, with the eager timing
and the host's time per call beside them. Byte and FLOP counts are the fewest each
kernel must move / compute; they are written next to each result.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton
import triton.language as tl
import triton.testing

from pagedmla.ops import reference as ref
from pagedmla.ops import triton as triton_ops
from pagedmla.ops.triton import (
    gather_cache,
    merge_attn_states,
    mla_decode,
    prefill_attention,
    varlen_attention,
    write_cache,
)
from pagedmla.ops.triton.decode import DECODE_CONFIGS, hopper_kernel, pick_config
from pagedmla.ops.triton.prefill import hopper_kernel as prefill_hopper_kernel
from pagedmla.ops.triton.prefill import pick_config as prefill_pick_config

L, R = 512, 64
FP8 = torch.float8_e4m3fn
DEV = "cuda"


def bench(fn: Callable[[], object], rep_ms: int = 100) -> float:
    """Median time of fn in microseconds (L2 wiped before every call)."""
    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3


# GPU cycles per microsecond that `bench_covered`'s head start assumes (the H200's top
# SM clock is 1980 MHz; at a lower clock the head start only lasts longer).
_SPIN_CYCLES_PER_US = 2000


def bench_covered(fn: Callable[[], object], rep_ms: int = 100, max_calls: int = 200,
                  clean_l2: bool = False) -> float:
    """Median GPU time of fn in microseconds, the L2 wiped before every call as `bench`
    does, with the host's work for the calls kept off the clock.

    The wipe writes 256 MB, as `bench`'s does, so L2 holds only dirty lines, whose
    write-back then shares HBM with the timed call (~9-10 µs of a decode of 600 MB on an
    H200, docs/PERFORMANCE_HISTORY.md, session 24). clean_l2: the wipe reads the 256 MB
    instead, so the call starts with a cold L2 that holds no dirty lines: closer to what
    a decode layer meets in a model, after projections that write little.

    `bench` starts each call's clock when the wipe before it ends; a call whose Python
    and launch work outlast the wipe (~60 µs) is timed from then, idle GPU included (the
    Gluon prefill path's host side took 120-260 µs per call on the H200 machine,
    docs/PERFORMANCE_HISTORY.md, session 23). Here a spin kernel that outlasts the
    host's work for all the timed calls is queued first, so every call is already queued
    when the GPU reaches it (fn must not wait for the device, or the head start is
    lost). For eager calls whose host work is part of what is measured, use `bench`."""
    wipe = torch.zeros(256 << 20, dtype=torch.int8, device=DEV)
    flush = stream_read(wipe) if clean_l2 else wipe.zero_

    def timed() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        flush()
        start.record()
        fn()
        end.record()
        return start, end

    for _ in range(3):  # warm-up (and compilation)
        timed()
    start, end = timed()
    torch.cuda.synchronize()
    calls = min(max_calls, max(10, int(rep_ms / max(start.elapsed_time(end), 1e-3))))
    host = host_us(timed, calls=5)
    torch.cuda._sleep(int(calls * host * 1.5 * _SPIN_CYCLES_PER_US))
    events = [timed() for _ in range(calls)]
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3


def host_us(fn: Callable[[], object], calls: int = 40) -> float:
    """Median host time of one call of fn in microseconds (its Python and launch work)."""
    times = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        times.append((time.perf_counter() - begin) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


class SmClock:
    """The GPU's SM clock as `nvidia-smi` samples it every 50 ms while a `with` block runs;
    `mhz` afterwards: the median sample (None where nvidia-smi is missing or gave none).

    Why it is recorded: under sustained decode an H200 reaches its 700 W power cap and
    lowers the SM clock (reason "SW power cap"), seen from ~1950 down to ~1400 MHz. A
    kernel bound by its chains of dependent instructions (the fp8 decode) slows with the
    clock, one bound by HBM (bf16 decode) does not, so their ratio moves between runs
    (docs/PERFORMANCE_HISTORY.md, session 20)."""

    def __init__(self) -> None:
        # nvidia-smi numbers GPUs its own way (CUDA_VISIBLE_DEVICES does not apply to
        # it): name the current one by its UUID.
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        self._gpu = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        self._proc: subprocess.Popen | None = None
        self.mhz: float | None = None

    def __enter__(self) -> SmClock:
        with contextlib.suppress(OSError):  # no nvidia-smi: mhz stays None
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", self._gpu, "--query-gpu=clocks.sm",
                 "--format=csv,noheader,nounits", "-lms", "50"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self.mhz = median_sample(self._proc.communicate()[0])


def median_sample(text: str) -> float | None:
    """The median of the numbers in `text`, one per line (nvidia-smi's csv without header
    or units); lines that are not numbers ("[N/A]") are skipped; None without any."""
    values = []
    for line in text.splitlines():
        try:
            values.append(float(line))
        except ValueError:
            continue
    return statistics.median(values) if values else None


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph: replaying it times the GPU work alone, as the engine's
    decode steps run it, without Python's launch overhead (tens of microseconds per
    call, as long as the whole kernel on small shapes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


# --- ceilings ---------------------------------------------------------------------------------


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Sum of one contiguous run of BLOCK * ITERS elements (the last one masked)."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, 0))


def stream_read(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A plain streaming read of the contiguous tensor x: returns a function computing
    per-program partial sums of x (float32). On an H200 it reads 4 GiB at 4.6 TB/s,
    where torch.sum reaches 4.2 (and 151 MiB at 3.3 against torch.sum's 2.5, timed after
    the 256 MB wipe), so the ceilings use the faster of the two."""
    block, iters = 4096, 2  # the best of a small sweep, 4 GiB down to 75 MiB
    n = x.numel()
    out = torch.empty(triton.cdiv(n, block * iters), dtype=torch.float32, device=x.device)

    def run() -> torch.Tensor:
        _stream_read_kernel[(out.numel(),)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)
        return out
    return run


def read_times(x: torch.Tensor) -> tuple[float, float]:
    """Microseconds of a read of x by torch.sum and by `stream_read`, graph replays."""
    return (bench(graphed(lambda: x.sum(dtype=torch.float32))),
            bench(graphed(stream_read(x))))


def ceilings() -> dict[str, float]:
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=DEV).normal_()  # 4 GiB
    dst = torch.empty_like(src)
    sum_us, stream_us = read_times(src)
    copy_us = bench(lambda: dst.copy_(src))
    src = dst = None
    torch.cuda.empty_cache()
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    mm_us = bench(lambda: a @ b)
    return {
        "hbm_read_tbps": (1 << 31) * 2 / min(sum_us, stream_us) / 1e6,
        "hbm_read_torch_sum_tbps": (1 << 31) * 2 / sum_us / 1e6,
        "hbm_copy_tbps": (1 << 31) * 2 * 2 / copy_us / 1e6,  # bytes read + written
        "bf16_matmul_tflops": 2 * n**3 / mm_us / 1e6,
    }


# --- decode inputs ------------------------------------------------------------------------------


def decode_inputs(batch: int, heads: int, context: int, q_len: int = 1, block_size: int = 64,
                  cache: torch.dtype = torch.bfloat16, seed: int = 0,
                  lengths: list[int] | None = None):
    """A paged cache with every request at `context` positions (new tokens included), or
    at lengths[b] <= context for request b, its pages scattered by a random permutation;
    args for mla_decode."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lengths = lengths or [context] * batch
    per_req = -(-context // block_size)
    used = sum(-(-n // block_size) for n in lengths)
    data = torch.empty(used + 1, block_size, L + R, device=DEV, dtype=torch.bfloat16)
    data.normal_(generator=gen)
    data = data.to(cache)
    order = (torch.randperm(used, device=DEV, generator=gen) + 1).int()
    table = torch.zeros(batch, per_req, dtype=torch.int32, device=DEV)
    taken = 0
    for b, n in enumerate(lengths):
        blocks = -(-n // block_size)
        table[b, :blocks] = order[taken:taken + blocks]
        taken += blocks
    q = torch.randn(batch * q_len, heads, L + R, device=DEV, dtype=torch.bfloat16,
                    generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEV)
    scale = torch.tensor(0.5 if cache == FP8 else 1.0, device=DEV)
    return (q, data, scale, table, seq_lens, qsl, q_len, context, L, (L + R) ** -0.5)


def decode_cost(batch: int, heads: int, context: int, q_len: int, elt: int,
                rows: int | None = None) -> tuple[int, int]:
    """(bytes, FLOPs): cache rows (batch x context, or `rows` in all) read once + q read
    + out written; QK^T over L + R and PV over L for every head and query token."""
    rows = batch * context if rows is None else rows
    tokens = batch * q_len
    nbytes = rows * (L + R) * elt + tokens * heads * (L + R) * 2 + tokens * heads * L * 2
    flops = 2 * heads * q_len * rows * (L + R) + 2 * heads * q_len * rows * L
    return nbytes, flops


def torch_decode(q: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                 kv_lora_rank: int, softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode baseline: plain PyTorch as a user would write it (gather + bmm).

    mla_decode's arguments, for a batch whose B requests each have one query token and
    exactly max_seq_len positions, a whole number of pages, on a 16-bit cache (the
    caller's promise: checking seq_lens would read it back). Each request's pages are
    gathered into one [B, S, L + R] tensor; then S = q K^T in q's dtype (cuBLAS,
    float32 accumulation), a float32 softmax, and O = P V. Returns out [B, N, L] and
    lse [N, B].
    """
    num_reqs, num_heads = seq_lens.shape[0], q.shape[1]
    page = data.shape[1]
    if q.shape[0] != num_reqs or max_query_len != 1:
        raise ValueError(f"q: one token per request expected, got {q.shape[0]} tokens "
                         f"for {num_reqs} requests (max_query_len {max_query_len})")
    if max_seq_len % page:
        raise ValueError(f"max_seq_len: a whole number of {page}-position pages "
                         f"expected, got {max_seq_len}")
    if data.element_size() != 2:
        raise TypeError(f"data: a 16-bit cache expected, got {data.dtype}")
    kv = data[block_table[:, :max_seq_len // page]].view(num_reqs, max_seq_len, -1)
    scores = torch.bmm(q.view(num_reqs, num_heads, -1), kv.transpose(1, 2))
    scores = scores.float().mul_(softmax_scale)  # [B, N, S]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores.sub_(lse.unsqueeze(-1))).to(q.dtype)
    out = torch.bmm(probs, kv[..., :kv_lora_rank])
    return out, lse.transpose(0, 1).contiguous()


# --- correctness sweep --------------------------------------------------------------------------


def _poison() -> None:
    for size in (1 << 12, 1 << 18, 1 << 24, 1 << 27):
        torch.full((size,), math.nan, device=DEV)


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    out, want = out.double(), want.double()
    if not torch.isfinite(out).all():
        return math.inf
    return (torch.linalg.vector_norm(out - want) / torch.linalg.vector_norm(want)).item()


def _expect(name: str, value: float, bound: float, log: list[str]) -> None:
    log.append(f"{name}: {value:.3g} (bound {bound:g})")
    if not value < bound:
        raise AssertionError(f"{name}: {value:.3g} >= {bound:g}")


def _scatter_cache(seq_lens: list[int], block_size: int, cache: torch.dtype, gen):
    """NaN-filled cache, block 0 reserved, permuted pages, padding entries far out."""
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


def _cu_lens(lens: list[int]) -> torch.Tensor:
    """Cumulative lengths [0, l0, l0 + l1, ...] as an int32 CUDA tensor."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)


def check_all() -> list[str]:
    """Every kernel vs the reference; raises on the first failure. Returns a log."""
    log: list[str] = []
    gen = torch.Generator(device=DEV).manual_seed(1234)
    bf16 = torch.bfloat16
    # Decode: pages 1/16/64, heads 1..128, lengths 1, 2, page + 1, odd; q_len 1..16; fp8.
    for block_size in (1, 16, 64):
        for heads in (1, 16, 64, 128):
            for cache in (bf16, FP8):
                for q_lens in ([1] * 5, [1, 4, 16, 2, 3]):
                    seq_lens = [max(q, s) for q, s in
                                zip(q_lens, [1, 2, block_size + 1, 777, 3001])]
                    data, table = _scatter_cache(seq_lens, block_size, cache, gen)
                    q = torch.randn(sum(q_lens), heads, L + R, device=DEV, generator=gen)
                    qsl = _cu_lens(q_lens)
                    args = (q.to(bf16), data, torch.tensor(0.37, device=DEV), table,
                            torch.tensor(seq_lens, dtype=torch.int32, device=DEV), qsl,
                            max(q_lens), max(seq_lens), L, (L + R) ** -0.5)
                    _poison()
                    out, lse = mla_decode(*args)
                    want, want_lse = ref.mla_decode(*args)
                    name = f"decode page={block_size} N={heads} {cache} q_lens={q_lens}"
                    _expect(f"{name} out", _rel(out, want), 1e-2, log)
                    _expect(f"{name} lse", (lse - want_lse).abs().max().item(), 2e-3, log)
    # Long context, B = 1: many splits and the combine.
    for heads, context in ((16, 131072), (128, 65536)):
        args = decode_inputs(1, heads, context, seed=7)
        out, lse = mla_decode(*args)
        want, want_lse = ref.mla_decode(*args)
        _expect(f"decode B=1 N={heads} ctx={context} out", _rel(out, want), 1e-2, log)
        _expect(f"decode B=1 N={heads} ctx={context} lse",
                (lse - want_lse).abs().max().item(), 2e-3, log)
    # The decode baseline attends as the reference does, or its time would mean nothing.
    for batch, heads, context, page in ((4, 16, 2048, 64), (2, 128, 4096, 16)):
        args = decode_inputs(batch, heads, context, block_size=page, seed=8)
        out, lse = torch_decode(*args)
        want, want_lse = ref.mla_decode(*args)
        name = f"baseline torch_decode B={batch} N={heads} ctx={context} page={page}"
        _expect(f"{name} out", _rel(out, want), 1e-2, log)
        _expect(f"{name} lse", (lse - want_lse).abs().max().item(), 2e-3, log)
    log.extend(check_graph_replay())

    # Merge: empties (+-inf), NaN behind them, strided lse views, in place.
    T, N, D = 4096, 128, 128
    po = torch.randn(T, N, D, device=DEV, dtype=bf16)
    so = torch.randn(T, N, D, device=DEV, dtype=bf16)
    pl = torch.randn(N, 2 * T, device=DEV)[:, ::2] * 3
    sl = torch.randn(N, T, device=DEV) * 3
    pl[:, :7] = -math.inf
    po[:7] = math.nan
    sl[:, 3:11] = math.inf
    so[3:11] = math.nan
    want, want_lse = torch.empty_like(po), torch.empty(N, T, device=DEV)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    merge_attn_states(po, pl, so, sl, po, pl)  # in place over the prefix
    _expect("merge out", _rel(po, want), 1e-3, log)  # bf16 rounding: ~1e-5
    both = want_lse.isfinite()
    _expect("merge lse", (pl[both] - want_lse[both]).abs().max().item(), 1e-5, log)
    _expect("merge empties", float((pl.isneginf() != want_lse.isneginf()).sum()), 0.5, log)

    # Cache write (bit-exact, fp8 quantization) and gather (dequantization).
    for cache in (bf16, FP8):
        for block_size in (1, 16, 64):
            tokens, blocks = 3000, 3000 // block_size + 8
            data = torch.full((blocks, block_size, L + R), math.nan, device=DEV).to(cache)
            want = data.clone()
            kv_c = torch.randn(tokens, L, device=DEV, dtype=bf16) * 100
            k_pe = torch.randn(tokens, R, device=DEV, dtype=bf16)
            slots = torch.randperm(blocks * block_size, device=DEV)[:tokens]
            slots[::17] = -1
            s = torch.tensor(0.37, device=DEV)
            write_cache(data, kv_c, k_pe, slots, s)
            ref.write_cache(want, kv_c, k_pe, slots, s)
            bits = data.view(torch.uint8) != want.view(torch.uint8)
            _expect(f"write_cache {cache} page={block_size} differing bytes",
                    float(bits.sum()), 0.5, log)
            seq_lens = [block_size * 3 + 5, 1, 1000]
            data, table = _scatter_cache(seq_lens, block_size, cache, gen)
            starts = torch.tensor([2, 0, 100], dtype=torch.int32, device=DEV)
            counts = [seq_lens[0] - 2, 1, 900]
            cu = torch.tensor([0, counts[0], counts[0] + 1, sum(counts)], dtype=torch.int32,
                              device=DEV)
            t2s = torch.repeat_interleave(torch.arange(3, device=DEV),
                                          torch.tensor(counts, device=DEV)).int()
            out = torch.full((sum(counts), L + R), math.nan, device=DEV, dtype=bf16)
            want = torch.empty_like(out)
            gather_cache(data, s, table, starts, cu, t2s, out)
            ref.gather_cache(data, s, table, starts, cu, t2s, want)
            _expect(f"gather_cache {cache} page={block_size} differing",
                    float((out.view(torch.int16) != want.view(torch.int16)).sum()), 0.5, log)

    # Varlen prefill: lengths 0, 1, odd; 192/128, 256/256, 128/128; causal and not.
    for qk, dv in ((192, 128), (256, 256), (128, 128)):
        for heads in (16, 128):
            for causal in (True, False):
                q_lens = [0, 1, 300, 1029]
                k_lens = q_lens if causal else [5, 0, 2000, 1029]
                q = torch.randn(sum(q_lens), heads, qk, device=DEV, dtype=bf16)
                kv = torch.randn(sum(k_lens), heads, qk + dv, device=DEV, dtype=bf16)
                cq = _cu_lens(q_lens)
                ck = _cu_lens(k_lens)
                args = (q, kv[..., :qk], kv[..., qk:], cq, ck, max(q_lens), max(k_lens),
                        qk**-0.5, causal)
                _poison()
                out, lse = varlen_attention(*args)
                want, want_lse = ref.varlen_attention(*args)
                name = f"varlen {qk}/{dv} N={heads} causal={causal}"
                _expect(f"{name} out", _rel(out, want), 1e-2, log)
                fin = want_lse.isfinite()
                _expect(f"{name} lse", (lse[fin] - want_lse[fin]).abs().max().item(), 2e-3, log)
                _expect(f"{name} empties", float((lse.isneginf() != ~fin).sum()), 0.5, log)
    # The backend's prefill op on equal-length batches (cuDNN): causal square, unmasked.
    for lens_q, lens_k, causal in (([512, 512], [512, 512], True), ([64, 64], [300, 300], False)):
        q = torch.randn(sum(lens_q), 16, 192, device=DEV, dtype=bf16)
        kv = torch.randn(sum(lens_k), 16, 320, device=DEV, dtype=bf16)
        cq = torch.tensor([0, lens_q[0], sum(lens_q)], dtype=torch.int32, device=DEV)
        ck = torch.tensor([0, lens_k[0], sum(lens_k)], dtype=torch.int32, device=DEV)
        args = (q, kv[..., :192], kv[..., 192:], cq, ck, lens_q[0], lens_k[0], 0.07, causal)
        _poison()
        out, lse = prefill_attention(*args)
        want, want_lse = ref.varlen_attention(*args)
        name = f"prefill_attention dense {lens_q}x{lens_k} causal={causal}"
        _expect(f"{name} out", _rel(out, want), 1e-2, log)
        _expect(f"{name} lse", (lse - want_lse).abs().max().item(), 2e-3, log)
    return log


def check_graph_replay() -> list[str]:
    """Capture decode in a CUDA graph with short contexts, replay with 100k-token ones
    and with one 100k-token request among short ones: the split plan is made on the
    device from each replay's lengths. 16 heads (the 16-row kernel on Hopper) and 128
    (the 64-row one), bf16 and fp8."""
    log: list[str] = []
    batch, long_ctx = 4, 100_000
    for heads, cache in ((16, torch.bfloat16), (128, torch.bfloat16), (128, FP8)):
        args = list(decode_inputs(batch, heads, long_ctx, cache=cache, seed=3))
        seq_lens = args[4]
        seq_lens.fill_(37)
        mla_decode(*args)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = mla_decode(*args)
        name = f"graph replay N={heads} {'fp8' if cache == FP8 else 'bf16'}"
        for lengths in ([37] * batch, [5000] * batch, [long_ctx] * batch,
                        [long_ctx] + [37] * (batch - 1)):
            seq_lens.copy_(torch.tensor(lengths))
            graph.replay()
            want, want_lse = ref.mla_decode(*args)
            _expect(f"{name} ctx={lengths} out", _rel(out, want), 1e-2, log)
            _expect(f"{name} ctx={lengths} lse", (lse - want_lse).abs().max().item(), 2e-3,
                    log)
        del args, graph, out, lse
        torch.cuda.empty_cache()
    return log


# --- benchmarks ----------------------------------------------------------------------------


def bench_decode(quick: bool, ceil: dict[str, float]) -> list[dict]:
    """Decode shapes on 64-token pages (one bulk copy per tile), plus 16-token pages
    (four copies per tile on Hopper) for comparison."""
    shapes = [  # (batch, heads, context, q_len, regime, page size)
        (64, 16, 2048, 1, "memory", 64), (64, 16, 8192, 1, "memory", 64),
        (128, 16, 8192, 1, "memory", 64), (256, 16, 4096, 1, "memory", 64),
        (64, 16, 32768, 1, "memory", 64), (256, 16, 32768, 1, "memory", 64),
        (1, 16, 131072, 1, "memory", 64),
        (1, 128, 65536, 1, "compute", 64), (1, 128, 131072, 1, "compute", 64),
        (64, 128, 4096, 1, "compute", 64), (128, 128, 8192, 1, "compute", 64),
        (64, 16, 8192, 4, "memory", 64), (128, 16, 8192, 1, "memory", 16),
        (128, 32, 8192, 1, "mixed", 64), (128, 64, 8192, 1, "compute", 64),
        (64, 128, 4096, 1, "compute", 16),
    ]
    if quick:
        shapes = [shapes[i] for i in (0, 2, 5, 6, 7, 9, 10, 12)]
    shapes = [(*shape, None) for shape in shapes]
    # Ragged batches, one long request among short ones (as serving batches are): the
    # split plan follows the lengths.
    shapes += [(64, 16, 131072, 1, "memory", 64, [131072] + [2048] * 63),
               (32, 128, 65536, 1, "compute", 64, [65536] + [4096] * 31)]
    # Past one wave of programs (132 SMs on an H200), and a wave that a CUDA graph pads
    # past it with empty rows (seq_len 0), as an engine's decode step does.
    if not quick:
        shapes += [(140, 16, 2048, 1, "memory", 64, None),
                   (144, 16, 1088, 1, "memory", 64, [1088] * 132 + [0] * 12)]
    # The oracle (`reference.mla_decode`, float32, eager) is timed too on three shapes.
    reference_for = {(64, 16, 2048), (1, 128, 65536), (64, 128, 4096)}
    rows = []
    for batch, heads, context, q_len, regime, page, lengths in shapes:
        for cache in (torch.bfloat16, FP8):
            args = decode_inputs(batch, heads, context, q_len, block_size=page, cache=cache,
                                 lengths=lengths)
            # As each layer of a forward pays it: the split plan is made once per forward
            # (`plans`), here before the capture; with_plan_us includes making it.
            plans: dict = {}
            replay = graphed(lambda args=args, plans=plans: mla_decode(*args, plans=plans))
            with SmClock() as clock:
                us = bench(replay)
            clean_us = bench_covered(replay, clean_l2=True)
            with_plan_us = bench(graphed(lambda args=args: mla_decode(*args)))
            eager_us = bench(lambda args=args: mla_decode(*args))
            # Where the Gluon kernel runs, time the Triton kernel of the same config too.
            cfg = pick_config(heads * q_len, torch.bfloat16, cache == FP8)
            plain_us = None
            if cfg.hopper and hopper_kernel(args[0], args[1], heads * q_len, L) is not None:
                plain = replace(cfg, hopper=False)
                plain_us = bench(graphed(lambda args=args, plain=plain, plans=plans:
                                         mla_decode(*args, config=plain, plans=plans)))
            # The Triton kernel at a fixed 4 pieces per request, as widely used Triton MLA
            # decode kernels split: what the split plan is worth.
            four: dict = {}
            fixed4_us = bench(graphed(lambda args=args, cfg=cfg, four=four: mla_decode(
                *args, config=replace(cfg, hopper=False), num_splits=4, plans=four)))
            nbytes, flops = decode_cost(batch, heads, context, q_len, args[1].element_size(),
                                        sum(lengths) if lengths else None)
            # A plain read of as many bytes, timed the same way: what a short grid's fixed
            # costs (launch, ramp-up, the L2 write-back the flush leaves) do to any read.
            src = torch.empty(nbytes // 2, device=DEV, dtype=torch.bfloat16).normal_()
            same_read_us = min(read_times(src))
            del src
            base_us = ref_us = None
            if cache == torch.bfloat16 and q_len == 1 and lengths is None:
                base_us = bench(graphed(lambda args=args: torch_decode(*args)))
                if page == 64 and (batch, heads, context) in reference_for:
                    ref_us = bench(lambda args=args: ref.mla_decode(*args), rep_ms=200)
            name = "bf16" if cache == torch.bfloat16 else "fp8"
            row = {
                "kernel": "mla_decode", "cache": name, "regime": regime, "B": batch,
                "N": heads, "context": context, "q_len": q_len, "page": page, "us": us,
                "with_plan_us": with_plan_us, "eager_us": eager_us, "bytes": nbytes,
                "flops": flops, "tbps": nbytes / us / 1e6, "tflops": flops / us / 1e6,
                "clean_l2_us": clean_us,
                "baseline": "PyTorch gather + bmm (torch_decode)" if base_us else None,
                "baseline_us": base_us, "reference_us": ref_us,
                "stage1": "gluon" if plain_us else "triton",
                "triton_stage1_us": plain_us, "triton_4_splits_us": fixed4_us,
                "same_size_read_us": same_read_us,
                "sm_mhz": clock.mhz,
            }
            row["pct_ceiling"] = 100 * row["tbps"] / ceil["hbm_read_tbps"]
            row["pct_ceiling_clean_l2"] = 100 * nbytes / clean_us / 1e6 / ceil["hbm_read_tbps"]
            if cache == FP8:  # rows[-1]: the shape's bf16 row, measured just before
                row["fp8_speedup_vs_bf16"] = rows[-1]["us"] / us
                row["fp8_speedup_vs_bf16_clean_l2"] = rows[-1]["clean_l2_us"] / clean_us
            if lengths:
                row["lengths"] = " + ".join(f"{len(list(run))} x {n}"
                                            for n, run in itertools.groupby(lengths))
            rows.append(row)
            del args
            torch.cuda.empty_cache()
    return rows


def bench_merge(quick: bool, ceil: dict[str, float]) -> list[dict]:
    T, N, D = 16384, 128, 128
    po = torch.randn(T, N, D, device=DEV, dtype=torch.bfloat16)
    so = torch.randn(T, N, D, device=DEV, dtype=torch.bfloat16)
    pl = torch.randn(N, T, device=DEV)
    sl = torch.randn(N, T, device=DEV)
    out = torch.empty_like(po)
    out_lse = torch.empty_like(pl)
    nbytes = 3 * T * N * D * 2 + 3 * N * T * 4

    def eager(po, pl, so, sl, out, out_lse):
        ref.merge_attn_states(po, pl, so, sl, out, out_lse)

    compiled = torch.compile(eager)
    compiled(po, pl, so, sl, out, out_lse)
    us = bench(lambda: merge_attn_states(po, pl, so, sl, out, out_lse))
    base_us = bench(lambda: compiled(po, pl, so, sl, out, out_lse))
    return [{
        "kernel": "merge_attn_states", "T": T, "N": N, "D": D, "us": us, "bytes": nbytes,
        "tbps": nbytes / us / 1e6, "pct_ceiling": 100 * nbytes / us / 1e6 / ceil[
            "hbm_copy_tbps"], "baseline": "torch.compile(reference)", "baseline_us": base_us,
    }]


def _sdpa_baseline(q, k, v, causal: bool) -> tuple[float | None, str]:
    """Fastest of PyTorch's cuDNN and flash SDPA on [1, N, S, D]; v padded to the qk
    width when a backend needs equal widths (then the padded columns are extra work
    the baseline does, noted in the label)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.unsqueeze(0).transpose(1, 2) for x in (q, k, v))
    best, label = None, "unavailable"
    for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"),
                          (SDPBackend.FLASH_ATTENTION, "flash")):
        for pad in (False, True):
            vv = vt
            if pad:
                if vt.shape[-1] == qt.shape[-1]:
                    continue
                vv = torch.nn.functional.pad(vt, (0, qt.shape[-1] - vt.shape[-1]))
            try:
                with sdpa_kernel([backend]):
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vv,
                                                                     is_causal=causal)
                    torch.cuda.synchronize()
                    us = bench_covered(
                        lambda vv=vv: torch.nn.functional.scaled_dot_product_attention(
                            qt, kt, vv, is_causal=causal), rep_ms=200)
            except RuntimeError:
                continue
            if best is None or us < best:
                best, label = us, f"SDPA {name}" + (" (v padded to qk width)" if pad else "")
            break
    return best, label


def _attention_flops(q_lens: list[int], k_lens: list[int], heads: int, width: int,
                     causal: bool) -> int:
    """2 x heads x (qk + v) FLOPs per visible (query, key) pair; causal bottom-right."""
    pairs = 0
    for q_len, k_len in zip(q_lens, k_lens):
        if causal:  # query i sees min(k_len, k_len - q_len + i + 1) keys (at least 0)
            shift = k_len - q_len
            pairs += sum(max(0, min(k_len, shift + i + 1)) for i in range(q_len))
        else:
            pairs += q_len * k_len
    return 2 * heads * pairs * width


def bench_prefill(quick: bool) -> list[dict]:
    """Varlen attention (the Gluon kernel on Hopper, the Triton kernel for comparison)
    and the backend's prefill op (cuDNN for equal-length batches) against cuDNN / flash
    SDPA on the same dense shape; ragged batches, which SDPA cannot take in one call,
    against the Triton kernel only."""
    qk, dv = 192, 128
    cases = [  # (label, heads, q_lens, k_lens, causal)
        *((f"S={s} causal", n, [s], [s], True)
          for n, s in ((16, 4096), (16, 16384), (128, 4096), (128, 8192), (128, 16384))),
        ("context q=2048 k=8192", 128, [2048], [8192], False),
    ]
    ragged = [200 + (i * 1237) % 2800 for i in range(12)]  # 200..3000 tokens, fixed
    cases += [(f"12 ragged seqs, {sum(ragged)} tokens, causal", n, ragged, ragged, True)
              for n in (16, 128)]
    if quick:
        cases = [cases[i] for i in (1, 3, 6)]
    rows = []
    for label, heads, q_lens, k_lens, causal in cases:
        q = torch.randn(sum(q_lens), heads, qk, device=DEV, dtype=torch.bfloat16)
        kv = torch.randn(sum(k_lens), heads, qk + dv, device=DEV, dtype=torch.bfloat16)
        k, v = kv[..., :qk], kv[..., qk:]
        args = (q, k, v, _cu_lens(q_lens), _cu_lens(k_lens), max(q_lens), max(k_lens),
                qk**-0.5, causal)
        flops = _attention_flops(q_lens, k_lens, heads, qk + dv, causal)
        base_us, base = None, None
        if len(q_lens) == 1:
            base_us, base = _sdpa_baseline(q, k.contiguous(), v.contiguous(), causal)
        plain = prefill_pick_config(qk, dv, q.dtype)
        triton_us = bench_covered(
            lambda args=args, plain=plain: varlen_attention(*args, config=plain), rep_ms=200)
        gluon = prefill_hopper_kernel(q, k, v, qk**-0.5) is not None
        for kernel, fn in (("varlen_attention", varlen_attention),
                           ("prefill_attention", prefill_attention)):
            call = functools.partial(fn, *args)
            us = bench_covered(call, rep_ms=200)
            rows.append({
                "kernel": kernel, "shape": label, "N": heads, "tokens": sum(q_lens),
                "qk": qk, "v": dv, "causal": causal, "us": us, "flops": flops,
                "tflops": flops / us / 1e6, "baseline": base, "baseline_us": base_us,
                "stage": ("gluon" if gluon else "triton") if kernel == "varlen_attention"
                else "backend op", "triton_kernel_us": triton_us,
                # The same call timed as `bench` times it (host work beyond the wipe
                # counts), and its host work alone.
                "eager_us": bench(call, rep_ms=200), "host_us": host_us(call),
            })
        del q, kv, k, v
    return rows


def _last_compiled(jit_fn) -> str:
    """Registers, spills and shared memory of the kernel `jit_fn` compiled last, and
    whether its PTX uses wgmma (best effort: Triton internals differ across versions)."""
    try:
        kernel = list(next(iter(jit_fn.device_caches.values()))[0].values())[-1]
        ptx = kernel.asm.get("ptx", "")
        wgmma, tma = "wgmma" in ptx, "cp.async.bulk.tensor" in ptx
        return (f"regs={kernel.n_regs} spills={kernel.n_spills} "
                f"smem={kernel.metadata.shared} wgmma={wgmma} tma={tma}")
    except Exception as error:  # diagnostics only
        return f"stats unavailable ({type(error).__name__})"


def sweep_decode_configs() -> list[dict]:
    """Time stage-1 variants per regime on representative shapes; prints the best."""
    from pagedmla.ops.triton.decode import _decode_partial_kernel

    rows = []
    # regime: (shapes, variants as (block_n, warps, stages, swap_ab, paged, block_h,
    # prefetch)); the first variant is the one the others must agree with.
    cases = {
        "rows16": ([(128, 16, 8192), (64, 16, 2048), (1, 16, 131072)],
                   [(64, 4, 2, True, True, 16, 0), (64, 4, 2, True, True, 16, 1),
                    (64, 4, 2, True, True, 16, 2), (64, 4, 2, True, True, 16, 3)]),
        "rows16-fp8": ([(128, 16, 8192)],
                       [(64, 8, 2, False, True, 16, 0), (64, 8, 2, False, True, 16, 2)]),
        "rows64": ([(64, 128, 4096)],
                   [(64, 8, 2, False, True, 64, 0), (64, 8, 2, False, True, 64, 2)]),
    }
    for key, (shapes, variants) in cases.items():
        base = DECODE_CONFIGS[key]
        for cache in ((FP8,) if key.endswith("fp8") else (torch.bfloat16,)):
            for batch, heads, context in shapes:
                args = decode_inputs(batch, heads, context, cache=cache)
                nbytes, flops = decode_cost(batch, heads, context, 1, args[1].element_size())
                found = []
                first = None
                for block_n, warps, stages, swap, paged, block_h, prefetch in variants:
                    cfg = replace(base, block_n=block_n, num_warps=warps, num_stages=stages,
                                  swap_ab=swap, paged=paged, block_h=block_h,
                                  prefetch=prefetch)
                    try:
                        # Every variant must agree with the first (a cheap sanity check).
                        got = mla_decode(*args, config=cfg)[0]
                        first = got if first is None else first
                        if _rel(got, first) > 1e-2:
                            print(f"  {key} {cfg}: WRONG (rel {_rel(got, first):.3g})")
                            continue
                        us = bench(graphed(lambda cfg=cfg, args=args:
                                           mla_decode(*args, config=cfg)), rep_ms=50)
                    except Exception as error:  # out of resources etc.
                        print(f"  {key} h={block_h} n={block_n} w={warps} s={stages} "
                              f"swap={swap} paged={paged}: "
                              f"{type(error).__name__}", flush=True)
                        continue
                    row = {"regime": key, "cache": str(cache), "B": batch, "N": heads,
                           "context": context, "block_n": block_n, "warps": warps,
                           "stages": stages, "swap_ab": swap, "paged": paged,
                           "block_h": block_h, "prefetch": prefetch, "us": us,
                           "tbps": nbytes / us / 1e6,
                           "tflops": flops / us / 1e6,
                           "stats": _last_compiled(_decode_partial_kernel)}
                    found.append(row)
                    print(f"  {key} {cache} B={batch} N={heads} ctx={context} h={block_h} "
                          f"n={block_n} pf={prefetch} "
                          f"w={warps} s={stages} swap={swap} paged={paged}: {us:.1f} us "
                          f"{row['tbps']:.2f} TB/s "
                          f"{row['tflops']:.0f} TFLOP/s {row['stats']}", flush=True)
                rows += found
                del args
    return rows


def sweep_prefill_configs() -> list[dict]:
    """Time prefill configs (block_m, block_n, warps, stages) per head-dim pair on
    8k causal tokens, against cuDNN SDPA on the same dense shape."""
    from pagedmla.ops.triton.prefill import PrefillConfig, _varlen_attention_kernel

    cases = {(192, 128): [(128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2),
                          (64, 64, 4, 2)],
             (256, 256): [(128, 64, 8, 2)],
             (128, 128): [(128, 128, 8, 3), (128, 64, 8, 3)]}
    rows = []
    for (qk, dv), variants in cases.items():
        for heads in ((16, 128) if qk == 192 else (16,)):
            seq = 8192
            q = torch.randn(seq, heads, qk, device=DEV, dtype=torch.bfloat16)
            kv = torch.randn(seq, heads, qk + dv, device=DEV, dtype=torch.bfloat16)
            k, v = kv[..., :qk], kv[..., qk:]
            cu = torch.tensor([0, seq], dtype=torch.int32, device=DEV)
            flops = 2 * heads * (seq * (seq + 1) // 2) * (qk + dv)
            base_us, label = _sdpa_baseline(q, k.contiguous(), v.contiguous(), True)
            print(f"  prefill {qk}/{dv} N={heads}: {label} {base_us:.0f} us", flush=True)
            for bm, bn, w, st in variants:
                cfg = PrefillConfig(bm, bn, w, st)
                try:
                    us = bench(lambda cfg=cfg, q=q, k=k, v=v, cu=cu, seq=seq: varlen_attention(
                        q, k, v, cu, cu, seq, seq, 0.07, True, config=cfg), rep_ms=100)
                except Exception as error:
                    print(f"  prefill {qk}/{dv} {cfg}: {type(error).__name__}", flush=True)
                    continue
                row = {"N": heads, "S": seq, "qk": qk, "v": dv, "config": asdict(cfg),
                       "us": us, "tflops": flops / us / 1e6, "baseline_us": base_us,
                       "stats": _last_compiled(_varlen_attention_kernel)}
                rows.append(row)
                print(f"  prefill {qk}/{dv} N={heads} {bm}/{bn}/{w}/{st}: "
                      f"{us:.0f} us {row['tflops']:.0f} TFLOP/s {base_us / us:.2f}x "
                      f"{row['stats']}", flush=True)
            del q, kv, k, v
    return rows


# --- report ----------------------------------------------------------------------------------


def markdown(ceil: dict[str, float], rows: list[dict]) -> str:
    lines = [
        f"ceilings: HBM read {ceil['hbm_read_tbps']:.2f} TB/s (torch.sum "
        f"{ceil.get('hbm_read_torch_sum_tbps', math.nan):.2f}), copy "
        f"{ceil['hbm_copy_tbps']:.2f} TB/s, bf16 matmul {ceil['bf16_matmul_tflops']:.0f} "
        "TFLOP/s",
        "",
        "% ceiling: decode vs the HBM read rate, merge vs the copy rate (it reads and writes)",
        "decode µs: one CUDA-graph replay (GPU time, as in the engine's decode steps); "
        "eager µs adds Python's launch overhead; [Gluon; ...]: stage 1 ran a Hopper "
        "kernel (decode_hopper up to 16 query rows, decode_hopper_fp8 for an fp8 cache, "
        "decode_hopper_heads above), and the "
        "Triton kernel's time is shown for comparison",
        "",
        "read µs: torch.sum over as many bytes as the decode moves, timed the same way",
        "",
        "clean-L2 µs (% ceiling): the decode's replay after a wipe that reads 256 MB "
        "instead of writing it, so that no dirty lines are left to write back during "
        "the call (`bench_covered(clean_l2=True)`)",
        "",
        "prefill µs (and its baseline's): GPU time, with the host's work for the call "
        "kept off the clock (`bench_covered`); eager µs: the call timed as the decode's "
        "eager column is, where host work beyond the L2 wipe counts",
        "",
        "SM MHz: the median SM clock while the µs column was measured (nvidia-smi); the "
        "card lowers it at its power cap",
        "",
        "| kernel | shape | µs | eager µs | TB/s | % ceiling | read µs | clean-L2 µs "
        "| TFLOP/s | baseline | baseline µs | speedup | SM MHz |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        if r["kernel"] == "mla_decode":
            ctx = f"ctx={r['lengths']}" if "lengths" in r else f"ctx={r['context']}"
            shape = (f"{r['cache']} B={r['B']} N={r['N']} {ctx} "
                     f"q_len={r['q_len']} page={r.get('page', 64)}")
            if "fp8_speedup_vs_bf16" in r:
                shape += f" (x{r['fp8_speedup_vs_bf16']:.2f} vs bf16)"
            if r.get("triton_stage1_us"):
                shape += f" [Gluon; Triton kernel: {r['triton_stage1_us']:.1f} µs]"
            if r.get("triton_4_splits_us"):
                shape += f" [Triton kernel, 4 pieces: {r['triton_4_splits_us']:.1f} µs]"
        elif r["kernel"] == "merge_attn_states":
            shape = f"T={r['T']} N={r['N']} D={r['D']} bf16"
        else:
            shape = (f"N={r['N']} {r['shape']} qk={r['qk']} v={r['v']} [{r['stage']}; "
                     f"Triton kernel: {r['triton_kernel_us']:.1f} µs; host "
                     f"{r['host_us']:.0f} µs per call]")
        read = f"{r['same_size_read_us']:.1f}" if "same_size_read_us" in r else ""
        clean = (f"{r['clean_l2_us']:.1f} ({r['pct_ceiling_clean_l2']:.0f}%)"
                 if "clean_l2_us" in r else "")
        tbps = f"{r['tbps']:.2f}" if "tbps" in r else ""
        pct = f"{r['pct_ceiling']:.0f}" if "pct_ceiling" in r else ""
        tflops = f"{r['tflops']:.0f}" if "tflops" in r else ""
        base = r.get("baseline") or ""
        base_us = f"{r['baseline_us']:.1f}" if r.get("baseline_us") else ""
        speed = f"{r['baseline_us'] / r['us']:.2f}x" if r.get("baseline_us") else ""
        eager = f"{r['eager_us']:.1f}" if "eager_us" in r else ""
        mhz = f"{r['sm_mhz']:.0f}" if r.get("sm_mhz") else ""
        lines.append(f"| {r['kernel']} | {shape} | {r['us']:.1f} | {eager} | {tbps} | {pct} "
                     f"| {read} | {clean} | {tflops} "
                     f"| {base} | {base_us} | {speed} | {mhz} |")
    return "\n".join(lines)


def write_plots(report: dict, directory: str) -> list[str]:
    """PNG plots of a report: decode bandwidth against the HBM ceiling, and TFLOP/s of
    decode and prefill against the bf16 matmul ceiling, into `directory` (made if
    missing). Needs matplotlib."""
    import matplotlib

    Path(directory).mkdir(parents=True, exist_ok=True)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceil = report["ceilings"]
    rows = report["results"]
    decode = [r for r in rows if r["kernel"] == "mla_decode"]
    label = [f"{r['cache']} B={r['B']} N={r['N']}\nctx={r.get('lengths', r['context'])} "
             f"q={r['q_len']} "
             f"p={r.get('page', 64)}" for r in decode]
    paths = []
    for metric, ceiling, name, unit in (
        ("tbps", ceil["hbm_read_tbps"], "decode_bandwidth.png", "TB/s"),
        ("tflops", ceil["bf16_matmul_tflops"], "decode_tflops.png", "TFLOP/s"),
    ):
        fig, ax = plt.subplots(figsize=(12, 4.5))
        ax.bar(range(len(decode)), [r[metric] for r in decode],
               color=["tab:blue" if r["cache"] == "bf16" else "tab:orange" for r in decode])
        ax.axhline(ceiling, color="black", linestyle="--", label=f"measured ceiling {ceiling:.0f}"
                   if unit == "TFLOP/s" else f"measured HBM read {ceiling:.2f} {unit}")
        ax.set_xticks(range(len(decode)), label, rotation=60, fontsize=7)
        ax.set_ylabel(unit)
        ax.set_title(f"mla_decode on {report['gpu']} (blue bf16 cache, orange fp8)")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{directory}/{name}")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    prefill = [r for r in rows if r["kernel"] == "varlen_attention" and r.get("baseline_us")]
    if prefill:
        fig, ax = plt.subplots(figsize=(8, 4))
        x = range(len(prefill))
        ax.bar([i - 0.27 for i in x], [r["tflops"] for r in prefill], width=0.27,
               label=f"our kernel ({prefill[0].get('stage', 'triton')})")
        ax.bar(list(x), [r["flops"] / r["triton_kernel_us"] / 1e6 for r in prefill],
               width=0.27, label="our Triton kernel")
        ax.bar([i + 0.27 for i in x], [r["flops"] / r["baseline_us"] / 1e6 for r in prefill],
               width=0.27, label="PyTorch SDPA (cuDNN)")
        ax.axhline(ceil["bf16_matmul_tflops"], color="black", linestyle="--",
                   label="bf16 matmul ceiling")
        ax.set_xticks(list(x), [f"N={r['N']}\n{r['shape']}" for r in prefill], fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title("prefill attention, qk 192 / v 128")
        ax.legend()
        fig.tight_layout()
        paths.append(f"{directory}/prefill_tflops.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def kernel_sources_digest() -> str:
    """sha256 over the Triton backend's source files, in name order."""
    digest = hashlib.sha256()
    for path in sorted(Path(triton_ops.__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--plots", default=None, help="write PNG plots into this directory")
    parser.add_argument("--plots-from", default=None,
                        help="only draw the plots of an earlier JSON report")
    parser.add_argument("--quick", action="store_true", help="fewer benchmark shapes")
    parser.add_argument("--skip-check", action="store_true", help="no correctness sweep")
    parser.add_argument("--check-only", action="store_true", help="correctness sweep only")
    parser.add_argument("--sweep-configs", nargs="?", const="all", default=None,
                        choices=["decode", "prefill", "all"],
                        help="time config variants (decode, prefill or all) instead of "
                        "the benchmarks")
    args = parser.parse_args(argv)
    if args.plots_from:
        with open(args.plots_from) as f:
            print("\n".join(write_plots(json.load(f), args.plots or ".")))
        return 0
    if not torch.cuda.is_available():
        print("the kernel benchmarks need a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    start = time.time()
    report: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__,
        "command": " ".join(sys.argv),
    }
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True,
                                          check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        report["commit"] = "unknown"
    # The git metadata of a copied tree can lag its files: the kernels' own content
    # identifies what was measured (compare with `kernel_sources_digest()` of a commit).
    report["kernel_sources_sha256"] = kernel_sources_digest()
    if not args.skip_check:
        log = check_all()
        print("\n".join(log), flush=True)
        print(f"correctness sweep passed: {len(log)} checks, {time.time() - start:.0f} s",
              flush=True)
        report["checks"] = len(log)
        if args.check_only:
            return 0
    if args.sweep_configs:
        report["sweep"] = []
        if args.sweep_configs in ("decode", "all"):
            report["sweep"] += sweep_decode_configs()
        if args.sweep_configs in ("prefill", "all"):
            report["sweep"] += sweep_prefill_configs()
    else:
        ceil = ceilings()
        report["ceilings"] = ceil
        print(f"ceilings {ceil}", flush=True)
        rows = bench_decode(args.quick, ceil)
        rows += bench_merge(args.quick, ceil)
        rows += bench_prefill(args.quick)
        report["results"] = rows
        report["configs"] = {k: asdict(v) for k, v in DECODE_CONFIGS.items()}
        report["decode_regimes"] = {n: pick_config(n, torch.bfloat16).block_h
                                    for n in (16, 32, 128)}
    report["seconds"] = time.time() - start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if "results" in report:
        if args.plots:
            write_plots(report, args.plots)
        print()
        print(markdown(report["ceilings"], report["results"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
