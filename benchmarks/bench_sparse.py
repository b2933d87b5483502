"""Sparse MLA attention (`ops/triton/sparse_decode.py`) on one GPU: decode's TFLOP/s and
its rate over the gathered rows against plain gathers of the same rows; prefill's
TFLOP/s against our dense prefill's, both counted over the attended pairs; each
measured in the same run as what it is judged against.

    python -m benchmarks.bench_sparse --out sparse.json
    python -m benchmarks.bench_sparse --quick --out sparse.json        # B = 64 only
    python -m benchmarks.bench_sparse --prefill --out sparse_prefill.json
    python -m benchmarks.bench_sparse --prefill --quick                # S = 4096 only
    python -m benchmarks.bench_sparse --sweep --out sparse_sweep.json  # launch parameters
    python -m benchmarks.bench_sparse --list                           # the shapes (no GPU)

Shapes: N = 128 heads and N = 16 (128 over 8 ranks), L = 512, R = 64, top-k 2048 of a
32k context, B = 64 and 128 requests of one and two query tokens each, 64-token pages
scattered by a random permutation; caches fp8_ds_mla (656-byte rows) and bf16 (1152-byte
rows, L + R values). Each query's indices are the top-k of random scores over its causal
context, in the order torch.topk gives them (by score, so positions are in random
order), as an indexer hands them over.

Times are medians of CUDA-graph replays (`harness.bench`: CUDA events around each call,
a 256 MB L2 wipe before it). Per row:
* us, tflops: the kernel; FLOPs counted as 2 T N topk (L + R + L) (QK^T over L + R and
  P V over L for every selected row, head and query token);
* gathered_bytes: the selected rows (T topk rows of row_bytes); tbps: them per second;
* the same rows gathered by plain kernels: `gather_read` (a Triton kernel that reads
  each row once and sums it: the bytes alone, nothing written) and torch.index_select
  into a buffer (reads and writes them); pct_of_gather: the kernel's rate over the
  faster of the two (100 = as fast as a plain gather of its rows).

Prefill (--prefill): one request's chunk of S = 4096 and 16384 new tokens over C
earlier positions, C = 0 (a fresh prompt) and C = 32768 - S (the request at 32k
positions); N = 128 and 16, both caches, top-k 2048. Query i (at position C + i) sees
the C + i + 1 positions up to its own; its indices are the top-k of random scores over
them, and where it sees fewer than top-k it holds all of them, then -1, as the indexer
returns them (`prefill_indices`). Per row:
* pairs: the (query, position) pairs attended, the sum over queries of min(top-k,
  visible); us, tflops: the kernel, 2 pairs N (L + R + L) FLOPs;
* dense_us, dense_tflops: the backend's dense prefill op (`prefill_attention`, which
  the engine's dense prefill runs: cuDNN where it takes the call, else our kernels) on
  the dense equivalent: MHA of the same S tokens, causal over themselves (C = 0), N
  heads of QK width P + R = 192 and V = 128, S (S + 1) / 2 pairs at 2 pairs N
  (192 + 128) FLOPs; dense_kernel_us, dense_kernel_tflops: our kernels alone
  (`varlen_attention`: the Gluon kernel on Hopper, else the Triton one);
* ratio = tflops / dense_tflops (the issue's target: >= 0.8, `target_met`), and
  ratio_vs_kernel = tflops / dense_kernel_tflops.
Prefill times, sparse and dense alike, are `harness.bench_covered`'s: the L2 wipe before
each call, the host's launch work off the clock.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import sys
import time
from dataclasses import asdict, replace

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.bench_kernels import report_header
from benchmarks.harness import DEV, SmClock, bench, bench_covered, graphed
from benchmarks.kernel_choice import prefill_runs_gluon
from benchmarks.workloads import L, R, attention_flops, cu_lens, decode_inputs
from pagedmla.cache import DS_MLA_BYTES
from pagedmla.ops.triton import prefill_attention, varlen_attention, write_cache
from pagedmla.ops.triton.decode_triton import DecodeConfig
from pagedmla.ops.triton.sparse_decode import sparse_attention, sparse_config

CONTEXT, TOPK, PAGE = 32768, 2048, 64
HEADS = (128, 16)
BATCHES = (64, 128)
Q_LENS = (1, 2)
CACHES = ("fp8_ds_mla", "bf16")
PREFILL_TOKENS = (4096, 16384)
DENSE_QK, DENSE_V = 192, 128  # the dense MHA prefill's head widths: P + R, and V
INDEX_ROWS = 2048  # queries whose random scores `prefill_indices` holds at once
TARGET_RATIO = 0.8  # the bar: sparse prefill >= 0.8x the dense prefill's TFLOP/s


def shapes(quick: bool) -> list[tuple[int, int, int, str]]:
    """(B, q_len, N, cache) of every row, grouped so that one cache serves each (B, q_len)."""
    batches = BATCHES[:1] if quick else BATCHES
    return list(itertools.product(batches, Q_LENS, HEADS, CACHES))


def prefill_shapes(quick: bool) -> list[tuple[int, int, int, str]]:
    """(S, C, N, cache) of every prefill row, grouped so that one cache serves each
    (S, C): C = 0 and C = CONTEXT - S."""
    tokens = PREFILL_TOKENS[:1] if quick else PREFILL_TOKENS
    return [(s, c, n, cache) for s in tokens for c in (0, CONTEXT - s)
            for n, cache in itertools.product(HEADS, CACHES)]


def flops(pairs: int, heads: int) -> int:
    """QK^T over L + R and P V over L, for every attended (query token, selected row)
    pair and head."""
    return 2 * pairs * heads * (L + R + L)


def prefill_pairs(tokens: int, context: int, topk: int) -> int:
    """The (query, position) pairs a prefill of `tokens` queries after `context` positions
    attends: query i sees context + i + 1 positions, of which it attends at most topk."""
    return sum(min(topk, context + i + 1) for i in range(tokens))


# --- the workload -----------------------------------------------------------------------------


def ds_mla_cache(data: torch.Tensor) -> torch.Tensor:
    """The bf16 cache data [blocks, page, L + R] written as fp8_ds_mla entries."""
    rows = data.view(-1, L + R)
    out = torch.empty(*data.shape[:2], DS_MLA_BYTES, dtype=torch.uint8, device=DEV)
    slots = torch.arange(rows.shape[0], device=DEV)
    write_cache(out, rows[:, :L], rows[:, L:], slots, torch.ones((), device=DEV))
    return out


def topk_indices(batch: int, q_len: int, gen: torch.Generator) -> torch.Tensor:
    """[B q_len, TOPK] int32: per query (request at CONTEXT positions, token i of q_len at
    position CONTEXT - q_len + i) the top-k of random scores over the positions it sees."""
    tokens = batch * q_len
    position = CONTEXT - q_len + torch.arange(tokens, device=DEV) % q_len
    scores = torch.rand(tokens, CONTEXT, device=DEV, generator=gen)
    scores.masked_fill_(torch.arange(CONTEXT, device=DEV) > position[:, None], -1.0)
    return scores.topk(TOPK, dim=1).indices.int()


def prefill_indices(tokens: int, context: int, gen: torch.Generator,
                    rows: int = INDEX_ROWS) -> torch.Tensor:
    """[tokens, TOPK] int32: query i of a prefill after `context` positions (at position
    context + i) holds the top-k of random scores over the positions it sees, in
    torch.topk's order, and -1 after them where it sees fewer than TOPK (as an indexer
    returns them). The scores of `rows` queries at a time are held."""
    seen = context + tokens
    positions = torch.arange(seen, device=DEV)
    out = torch.full((tokens, TOPK), -1, dtype=torch.int32, device=DEV)
    for r0 in range(0, tokens, rows):
        limit = context + torch.arange(r0, min(tokens, r0 + rows), device=DEV)[:, None]
        scores = torch.rand(limit.shape[0], seen, device=DEV, generator=gen)
        # Scores are in [0, 1): the positions a query sees come first, those it does not
        # (scored -1) fill its row's tail and become -1.
        scores.masked_fill_(positions > limit, -1.0)
        top = scores.topk(min(TOPK, seen), dim=1).indices
        out[r0:r0 + limit.shape[0], :top.shape[1]] = torch.where(top <= limit, top, -1).int()
    return out


def selected_slots(indices: torch.Tensor, table: torch.Tensor, q_len: int) -> torch.Tensor:
    """The cache slot of every selected position [T topk] (int64), through the block table."""
    request = torch.arange(indices.shape[0], device=DEV) // q_len
    pages = table[request[:, None], indices // PAGE].long()
    return (pages * PAGE + indices % PAGE).view(-1)


# --- plain gathers of the same rows -----------------------------------------------------------


@triton.jit
def _gather_read_kernel(words_ptr, slots_ptr, out_ptr, row_words, ROWS: tl.constexpr,
                        W1: tl.constexpr, W2: tl.constexpr, BLOCK_W2: tl.constexpr):
    """The sum of ROWS gathered rows of W1 + W2 int32 words (W1 a power of two): every
    byte of each row read once, one int32 written per program."""
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid * ROWS + tl.arange(0, ROWS))
    base = words_ptr + slot * row_words
    acc = tl.sum(tl.load(base[:, None] + tl.arange(0, W1)[None, :]))
    if W2 > 0:
        cols = tl.arange(0, BLOCK_W2)
        acc += tl.sum(tl.load(base[:, None] + W1 + cols[None, :],
                              mask=(cols < W2)[None, :], other=0))
    tl.store(out_ptr + pid, acc)


def gather_read(data: torch.Tensor, slots: torch.Tensor, rows: int = 16):
    """A function that reads the cache rows at `slots` (a multiple of `rows`) once,
    as words, and writes one word per `rows` of them."""
    words = data.view(torch.int32).view(-1, data.shape[-1] * data.element_size() // 4)
    width = words.shape[1]
    w1 = 1 << (width.bit_length() - 1)
    w2 = width - w1
    out = torch.empty(slots.numel() // rows, dtype=torch.int32, device=DEV)

    def run() -> torch.Tensor:
        _gather_read_kernel[(out.numel(),)](
            words, slots, out, width, ROWS=rows, W1=w1, W2=w2,
            BLOCK_W2=triton.next_power_of_2(w2) if w2 else 1, num_warps=4)
        return out
    return run


# --- measurements -----------------------------------------------------------------------------


def measure(args: tuple, q_len: int, heads: int, cache: str, gather_us: dict) -> dict:
    """One row: the kernel at its default launch parameters, against the plain gathers
    of its rows (`gather_us` holds them by (B, q_len, cache): the rows do not depend on
    N, so each is measured once)."""
    q, data, scale, table, seq_lens, qsl, indices = args
    key = (q.shape[0] // q_len, q_len, cache)
    tokens = q.shape[0]
    row_bytes = data.shape[-1] * data.element_size()
    gathered = tokens * TOPK * row_bytes
    replay = graphed(lambda: sparse_attention(q, data, scale, table, seq_lens, qsl, indices,
                                              L, (L + R) ** -0.5))
    with SmClock() as clock:
        us = bench(replay)
    if key not in gather_us:
        slots = selected_slots(indices, table, q_len)
        flat = data.view(-1, data.shape[-1])
        buffer = torch.empty(slots.numel(), flat.shape[1], dtype=flat.dtype, device=DEV)
        gather_us[key] = {
            "gather_read_us": bench(graphed(gather_read(data, slots))),
            "index_select_us": bench(graphed(
                lambda: torch.index_select(flat, 0, slots, out=buffer))),
        }
        del buffer
    plain = gather_us[key]
    fastest = min(plain.values())
    work = flops(tokens * TOPK, heads)
    return {
        "kernel": "sparse_attention", "cache": cache, "B": tokens // q_len, "q_len": q_len,
        "N": heads, "T": tokens, "context": CONTEXT, "topk": TOPK, "page": PAGE,
        "config": asdict(sparse_config(heads, q.dtype, data)),
        "us": us, "flops": work, "tflops": work / us / 1e6,
        "row_bytes": row_bytes, "gathered_bytes": gathered, "tbps": gathered / us / 1e6,
        **plain,
        "gather_read_tbps": gathered / plain["gather_read_us"] / 1e6,
        "index_select_tbps": gathered / plain["index_select_us"] / 1e6,
        "pct_of_gather": 100 * fastest / us,
        "sm_mhz": clock.mhz,
    }


def sparse_inputs(batch: int, q_len: int, seq_len: int, indices: torch.Tensor,
                  group: list[tuple[int, str]], gen: torch.Generator):
    """(N, cache, the kernel's arguments) for each (N, cache) of `group`: B requests of
    q_len query tokens at seq_len positions, one cache (and its fp8_ds_mla copy, written
    from the bf16 one) and `indices` for all."""
    _, data, _, table, seq_lens, qsl, *_ = decode_inputs(batch, 1, seq_len, q_len,
                                                         block_size=PAGE)
    caches = {"bf16": data, "fp8_ds_mla": ds_mla_cache(data)}
    scale = torch.ones((), device=DEV)
    for heads, cache in group:
        q = torch.randn(batch * q_len, heads, L + R, device=DEV, generator=gen,
                        dtype=torch.bfloat16)
        yield heads, cache, (q, caches[cache], scale, table, seq_lens, qsl, indices)
    del caches, data
    torch.cuda.empty_cache()


def workloads(todo: list[tuple[int, int, int, str]]):
    """(B, q_len, N, cache, the kernel's arguments) for every shape of `todo` (as
    `shapes` orders them), each (B, q_len)'s cache and indices made once."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    for (batch, q_len), group in itertools.groupby(todo, key=lambda s: s[:2]):
        indices = topk_indices(batch, q_len, gen)
        for heads, cache, args in sparse_inputs(batch, q_len, CONTEXT, indices,
                                                [s[2:] for s in group], gen):
            yield batch, q_len, heads, cache, args


def prefill_workloads(todo: list[tuple[int, int, int, str]]):
    """(S, C, N, cache, the kernel's arguments) for every shape of `todo` (as
    `prefill_shapes` orders them): one request of S query tokens at C + S positions,
    each (S, C)'s cache and indices made once."""
    gen = torch.Generator(device=DEV).manual_seed(0)
    for (tokens, context), group in itertools.groupby(todo, key=lambda s: s[:2]):
        indices = prefill_indices(tokens, context, gen)
        for heads, cache, args in sparse_inputs(1, tokens, context + tokens, indices,
                                                [s[2:] for s in group], gen):
            yield tokens, context, heads, cache, args


def dense_prefill(tokens: int, heads: int) -> dict:
    """The dense equivalent of a prefill of `tokens` new tokens: MHA of N = heads over
    themselves, causal, QK width DENSE_QK and V width DENSE_V (bf16), timed on the
    backend's op (`prefill_attention`: dense_*) and on our kernels alone
    (`varlen_attention`: dense_kernel_*), both as bench_kernels times prefill."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(tokens, heads, DENSE_QK, device=DEV, generator=gen, dtype=torch.bfloat16)
    kv = torch.randn(tokens, heads, DENSE_QK + DENSE_V, device=DEV, generator=gen,
                     dtype=torch.bfloat16)
    lens = cu_lens([tokens])
    args = (q, kv[..., :DENSE_QK], kv[..., DENSE_QK:], lens, lens, tokens, tokens,
            DENSE_QK**-0.5, True)
    work = attention_flops([tokens], [tokens], heads, DENSE_QK + DENSE_V, True)
    row: dict = {"dense_pairs": tokens * (tokens + 1) // 2, "dense_flops": work,
                 "dense_kernel_stage": "gluon" if prefill_runs_gluon(*args) else "triton"}
    for name, op in (("dense", prefill_attention), ("dense_kernel", varlen_attention)):
        us = bench_covered(functools.partial(op, *args), rep_ms=200)
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = work / us / 1e6
    del q, kv, args
    torch.cuda.empty_cache()
    return row


def measure_prefill(args: tuple, tokens: int, context: int, heads: int, cache: str,
                    dense: dict) -> dict:
    """One prefill row: the kernel at its default launch parameters, against the dense
    prefill of as many tokens at as many heads (`dense` holds it by (S, N); measured on
    first use)."""
    q, data = args[:2]
    call = functools.partial(sparse_attention, *args, L, (L + R) ** -0.5)
    with SmClock() as clock:
        us = bench_covered(call, rep_ms=200)
    if (tokens, heads) not in dense:
        dense[tokens, heads] = dense_prefill(tokens, heads)
    pairs = prefill_pairs(tokens, context, TOPK)
    work = flops(pairs, heads)
    tflops = work / us / 1e6
    base = dense[tokens, heads]
    ratio = tflops / base["dense_tflops"]
    return {
        "kernel": "sparse_attention", "mode": "prefill", "cache": cache, "S": tokens,
        "C": context, "seq_len": context + tokens, "N": heads, "topk": TOPK, "page": PAGE,
        "config": asdict(sparse_config(heads, q.dtype, data)),
        "pairs": pairs, "us": us, "flops": work, "tflops": tflops, **base,
        "ratio": ratio, "ratio_vs_kernel": tflops / base["dense_kernel_tflops"],
        "target_met": ratio >= TARGET_RATIO, "sm_mhz": clock.mhz,
    }


def candidate_configs(heads: int, base: DecodeConfig) -> list[DecodeConfig]:
    """Launch parameters to sweep: 16 heads per program for N <= 16, else 32 or 64
    (fewer would read each row again for every 16 heads), tiles of 32 or 64 positions,
    4 or 8 warps, 1 or 2 stages, both product forms (the transposed one with at most 32
    heads per program): 16 candidates at N = 16, 24 at N = 128."""
    choices = (16,) if heads <= 16 else (32, 64)
    out = []
    for block_h, block_n, warps, stages, swap in itertools.product(
            choices, (32, 64), (4, 8), (1, 2), (False, True)):
        if not (swap and block_h > 32):
            out.append(replace(base, block_h=block_h, block_n=block_n, num_warps=warps,
                               num_stages=stages, swap_ab=swap))
    return out


def sweep(quick: bool, heads_only: list[int] | None, caches_only: list[str] | None) -> list:
    """Time `candidate_configs` at one query token per request (B = 64 only with quick);
    print the default's time and the best per shape."""
    todo = [(batch, q_len, heads, cache) for batch, q_len, heads, cache in shapes(quick)
            if q_len == 1 and heads in (heads_only or HEADS) and cache in (caches_only or CACHES)]
    rows = []
    for batch, q_len, heads, cache, args in workloads(todo):
        q, data = args[:2]
        default = sparse_config(heads, q.dtype, data)
        timed = []
        for config in candidate_configs(heads, default):
            call = functools.partial(sparse_attention, *args, L, (L + R) ** -0.5,
                                     config=config)
            try:
                us = bench(graphed(call), rep_ms=30)
            except (OutOfResources, CompilationError):
                continue  # does not fit in shared memory, or does not build
            timed.append((us, config))
            rows.append({"cache": cache, "B": batch, "q_len": q_len, "N": heads,
                         "config": asdict(config), "default": config == default, "us": us,
                         "tflops": flops(batch * q_len * TOPK, heads) / us / 1e6})
        default_us = {c: us for us, c in timed}.get(default, math.nan)
        best_us, best = min(timed, key=lambda item: item[0])
        print(f"{cache} B={batch} N={heads}: default {default_us:.1f} µs; best {best_us:.1f} "
              f"µs with {asdict(best)}", flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| cache | B | q_len | N | µs | TFLOP/s | TB/s of rows | gather read µs | "
             "index_select µs | % of gather |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['B']} | {r['q_len']} | {r['N']} | {r['us']:.1f} "
                     f"| {r['tflops']:.0f} | {r['tbps']:.2f} | {r['gather_read_us']:.1f} "
                     f"| {r['index_select_us']:.1f} | {r['pct_of_gather']:.0f} |")
    return "\n".join(lines)


def prefill_markdown(rows: list[dict]) -> str:
    lines = ["| cache | S | C | N | pairs (M) | µs | TFLOP/s | dense µs | dense TFLOP/s | "
             f"ratio | our kernels' TFLOP/s | ratio to them | >= {TARGET_RATIO} |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['S']} | {r['C']} | {r['N']} | "
                     f"{r['pairs'] / 1e6:.1f} | {r['us']:.0f} | {r['tflops']:.0f} | "
                     f"{r['dense_us']:.0f} | {r['dense_tflops']:.0f} | {r['ratio']:.2f} | "
                     f"{r['dense_kernel_tflops']:.0f} | {r['ratio_vs_kernel']:.2f} | "
                     f"{'yes' if r['target_met'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write results as JSON here")
    parser.add_argument("--quick", action="store_true",
                        help="B = 64 only (decode), S = 4096 only (prefill)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prefill", action="store_true",
                      help="time sparse prefill against dense prefill instead")
    mode.add_argument("--sweep", action="store_true",
                      help="time launch parameters (one query token per request) instead")
    parser.add_argument("--heads", nargs="+", type=int, choices=HEADS, help="sweep only these N")
    parser.add_argument("--cache", nargs="+", choices=CACHES, help="sweep only these caches")
    parser.add_argument("--list", action="store_true",
                        help="print the decode and prefill shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for batch, q_len, heads, cache in shapes(args.quick):
            print(f"decode B={batch} q_len={q_len} N={heads} cache={cache} context={CONTEXT} "
                  f"topk={TOPK} GFLOP={flops(batch * q_len * TOPK, heads) / 1e9:.1f}")
        for tokens, context, heads, cache in prefill_shapes(args.quick):
            pairs = prefill_pairs(tokens, context, TOPK)
            dense = attention_flops([tokens], [tokens], heads, DENSE_QK + DENSE_V, True)
            print(f"prefill S={tokens} C={context} N={heads} cache={cache} topk={TOPK} "
                  f"pairs={pairs} GFLOP={flops(pairs, heads) / 1e9:.1f} "
                  f"dense_GFLOP={dense / 1e9:.1f}")
        return 0
    if not torch.cuda.is_available():
        print("the sparse benchmark needs a CUDA GPU", file=sys.stderr)
        return 1
    start = time.time()
    report = report_header()
    if args.sweep:
        report["sweep"] = sweep(args.quick, args.heads, args.cache)
    elif args.prefill:
        rows, dense = [], {}
        for tokens, context, heads, cache, inputs in prefill_workloads(
                prefill_shapes(args.quick)):
            rows.append(measure_prefill(inputs, tokens, context, heads, cache, dense))
            print(rows[-1], flush=True)
        report["results"] = rows
        print("\n" + prefill_markdown(rows))
    else:
        rows, gather_us = [], {}
        for _, q_len, heads, cache, inputs in workloads(shapes(args.quick)):
            rows.append(measure(inputs, q_len, heads, cache, gather_us))
            print(rows[-1], flush=True)
        report["results"] = rows
        print("\n" + markdown(rows))
    report["seconds"] = time.time() - start
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
