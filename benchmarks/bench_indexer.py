"""One layer's lightning indexer on one GPU (DeepSeek-V3.2's: 64 heads of 128, fp8 key
cache, page 64, top-k 2048) against the issue's targets.

    python -m benchmarks.bench_indexer --out indexer.json
    python -m benchmarks.bench_indexer --cases decode --topk 2048
    python -m benchmarks.bench_indexer --sweep --cases prefill_4k --out sweep.json

`--sweep` times the logits kernel's launch configs (`candidate_configs`) per case
instead: the search behind `ops.triton.indexer.pick_config`.

Cases: decode of B = 64 requests of one token over 64k positions each, and fresh
prompts of 4k and 16k tokens. Each is timed in parts and whole (`ops/triton/indexer.py`):

* prepare: the queries rotated and rounded to e4m3, their scales folded into the
  weights (the reference's torch ops);
* logits: the paged logits kernel alone (prepared inputs, one chunk of rows: the
  first, the heaviest of a prompt's chunks is its last);
* topk: `torch.topk` over those logits;
* total: `indexer_topk` as the model calls it (every chunk); decode as a CUDA-graph
  replay (as the engine runs decode steps), prefill eagerly with the host's launch work
  kept off the clock (`harness.bench_covered`).

Times are medians of CUDA-event timings after an L2 wipe (`harness`). The targets
(DeepGEMM's logits kernel with torch.topk on an H200, as another engine measured it):
decode <= 0.32 ms, prefill 4k <= 0.70 ms, 16k <= 6.5 ms, judged on `total_ms`. Rates
beside them: the logits kernel's scoring FLOPs (2 H D per visible pair of its chunk)
and, for decode, the key bytes it must read against the card's HBM read rate.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from benchmarks.harness import DEV, bench, bench_covered, ceilings, graphed
from pagedmla.ops.reference_indexer import (
    LOGITS_BUDGET,
    SCALE_BYTES,
    allocate_indexer_cache,
    fp8_cache_views,
    prepare_queries,
    read_indexer_keys,
)
from pagedmla.ops.triton.indexer import (
    LogitsConfig,
    _launch,
    _prepared,
    _row_chunk,
    indexer_topk,
    pick_config,
)


@dataclass(frozen=True)
class Case:
    """Requests of q_lens new tokens over seq_lens positions (new ones included)."""

    seq_lens: list[int]
    q_lens: list[int]
    target_ms: float


CASES = {
    "decode": Case([65536] * 64, [1] * 64, 0.32),
    "prefill_4k": Case([4096], [4096], 0.70),
    "prefill_16k": Case([16384], [16384], 6.5),
}


def inputs(case: Case, heads: int, dim: int, page: int, seed: int = 0) -> tuple:
    """indexer_topk's first six arguments on the GPU: an fp8 cache of random e4m3 keys
    (codes ~ N(0, 64^2) clamped to +-448, scales 2^-6), its pages a random permutation
    (page 0 unused); q bf16 ~ N(0, 1), weights ~ N(0, 1) H^-0.5 D^-0.5."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    pages = [-(-s // page) for s in case.seq_lens]
    data = allocate_indexer_cache(1 + sum(pages), page, dim, torch.bfloat16, True, DEV)
    codes, scales = fp8_cache_views(data)
    for block in range(0, data.shape[0], 4096):  # bounded temporaries
        part = codes[block:block + 4096]
        noise = torch.randn(part.shape, device=DEV, generator=gen) * 64
        part.copy_(noise.clamp(-448, 448).to(part.dtype))
    scales.fill_(2.0**-6)
    order = (torch.randperm(sum(pages), device=DEV, generator=gen) + 1).int()
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32, device=DEV)
    taken = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[taken:taken + n]
        taken += n
    T = sum(case.q_lens)
    q = torch.randn(T, heads, dim, device=DEV, generator=gen).bfloat16()
    weights = torch.randn(T, heads, device=DEV, generator=gen) * (heads * dim) ** -0.5
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, *torch.tensor(case.q_lens).cumsum(0).tolist()],
                       dtype=torch.int32, device=DEV)
    return q, weights, data, table, seq_lens, qsl


def check(args: tuple, logits: torch.Tensor, token: int) -> float:
    """Relative error of the logits of `token` (of the first request; logits' first row)
    against torch (float64, the keys dequantized), over the positions it sees."""
    q, weights, data, table, seq_lens, qsl = args
    seen = int(seq_lens[0]) - int(qsl[1]) + token + 1
    page = data.shape[1]
    pos = torch.arange(seen, device=DEV)
    keys = read_indexer_keys(data, table[0, pos // page].long() * page + pos % page)
    queries = prepare_queries(q[token:token + 1], True)[0].double()
    want = ((queries @ keys.double().T).relu() * weights[token].double().unsqueeze(1)).sum(0)
    return float((logits[0, :seen] - want).norm() / want.norm())


def visible_counts(case: Case) -> torch.Tensor:
    """Positions each token sees (bottom-right causal), int64 [T]."""
    return torch.cat([torch.arange(s - q + 1, s + 1) for s, q in zip(case.seq_lens,
                                                                      case.q_lens)])


def last_chunk(case: Case, args_ns: argparse.Namespace
               ) -> tuple[tuple, int, Callable[[LogitsConfig], torch.Tensor]]:
    """The case's inputs, the first row r0 of its last chunk of query rows (the widest
    causal triangle of a prompt's chunks; decode: its one chunk) and a launch of the
    logits kernel over that chunk with a given config (queries prepared once)."""
    args = inputs(case, args_ns.heads, args_ns.dim, args_ns.page)
    q, weights, data, table, seq_lens, qsl = args
    T, P = q.shape[0], table.shape[1] * data.shape[1]
    r0 = T - min(T, _row_chunk(P, args_ns.budget))
    prepared = _prepared(q[r0:], weights[r0:], data)
    logits = torch.empty(T - r0, P, device=DEV)

    def launch(config: LogitsConfig) -> torch.Tensor:
        _launch(*prepared, data, table, seq_lens, qsl, logits, r0, config)
        return logits
    return args, r0, launch


def measure(name: str, args_ns: argparse.Namespace, ceil: dict[str, float]) -> dict:
    """One case's parts and total, with rates and the verdict."""
    case = CASES[name]
    heads, dim, topk = args_ns.heads, args_ns.dim, args_ns.topk
    args, r0, launch = last_chunk(case, args_ns)
    q, weights, data, table = args[:4]
    T, P = q.shape[0], table.shape[1] * data.shape[1]
    decode = len(case.seq_lens) == T
    config = pick_config(T, len(case.seq_lens), heads)
    logits = launch(config)
    rel = check(args, logits, r0)
    if rel > 4e-3:  # fp8 tensor-core products accumulate with ~14-bit precision
        raise SystemExit(f"{name}: relative error {rel:.2e} of the logits against torch")
    picks = min(topk, P)
    row = {"case": name, "tokens": T, "requests": len(case.seq_lens), "positions": P,
           "chunk_rows": T - r0, "config": asdict(config), "rel_err": rel,
           "target_ms": case.target_ms}
    row["prepare_ms"] = bench_covered(lambda: _prepared(q[r0:], weights[r0:], data)) / 1e3
    row["logits_ms"] = bench_covered(lambda: launch(config)) / 1e3
    row["topk_ms"] = bench_covered(lambda: logits.topk(picks, dim=1, sorted=False)) / 1e3

    def whole() -> torch.Tensor:
        return indexer_topk(*args, max(case.seq_lens), topk, budget=args_ns.budget)

    if decode:  # CUDA-graph replay, as the engine runs decode steps
        row["total_ms"] = bench(graphed(whole)) / 1e3
        row["eager_ms"] = bench(whole) / 1e3
    else:
        row["total_ms"] = bench_covered(whole) / 1e3
    pairs = int(visible_counts(case)[r0:].sum())  # the timed chunk's
    row["logits_tflops"] = 2 * heads * dim * pairs / (row["logits_ms"] * 1e9)
    if decode:  # every key read once, from HBM
        key_bytes = sum(case.seq_lens) * (dim + SCALE_BYTES)
        row["key_read_fraction"] = key_bytes / (row["logits_ms"] * 1e9) / ceil["hbm_read_tbps"]
    row["verdict"] = verdict(row)
    return row


def candidate_configs(decode: bool, heads: int) -> list[LogitsConfig]:
    """The sweep's launch configs: around `pick_config`'s (tokens per program, tile
    width, warps, stages, both product formulations)."""
    base = pick_config(64 if decode else 4096, 64 if decode else 1, heads)
    block_ms = [base.block_m] if decode else sorted({1, base.block_m, 2 * base.block_m})
    return [LogitsConfig(m, n, base.max_tiles, warps, stages, swap)
            for m, n, warps, stages, swap in itertools.product(
                block_ms, (64, 128), (4, 8), (2, 3), (True, False))]


def sweep(args_ns: argparse.Namespace) -> None:
    """Time the logits kernel alone (the chunk `measure` times) with each candidate
    config per case; print the default's time and the best; write every timing."""
    rows = []
    for name in args_ns.cases:
        case = CASES[name]
        decode = sum(case.q_lens) == len(case.q_lens)
        launch = last_chunk(case, args_ns)[2]
        timed = {}
        for config in candidate_configs(decode, args_ns.heads):
            try:
                timed[config] = bench_covered(functools.partial(launch, config), rep_ms=30) / 1e3
            except (OutOfResources, CompilationError):
                continue  # does not fit in shared memory, or does not build
            rows.append({"case": name, "config": asdict(config), "logits_ms": timed[config]})
        default = pick_config(sum(case.q_lens), len(case.q_lens), args_ns.heads)
        best = min(timed, key=timed.__getitem__)
        print(f"{name}: default {default} {timed.get(default, math.nan):.4f} ms; best "
              f"{best} {timed[best]:.4f} ms", flush=True)
        del launch
        torch.cuda.empty_cache()
    with open(args_ns.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "args": vars(args_ns), "sweep": rows},
                  f, indent=1)


def verdict(row: dict) -> str:
    """The case's target met ("pass") or not ("miss"), judged on total_ms."""
    return "pass" if row["total_ms"] <= CASES[row["case"]].target_ms else "miss"


def table(rows: list[dict]) -> str:
    """The markdown table printed last."""
    lines = ["| case | tokens | chunk rows | prepare ms | logits ms | topk ms | total ms "
             "| target ms | key read % HBM | logits TFLOP/s | verdict |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        read = f"{100 * r['key_read_fraction']:.0f}" if "key_read_fraction" in r else "-"
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['chunk_rows']} | {r['prepare_ms']:.3f} "
            f"| {r['logits_ms']:.3f} | {r['topk_ms']:.3f} | {r['total_ms']:.3f} "
            f"| {r['target_ms']} | {read} "
            f"| {r['logits_tflops']:.0f} | {r['verdict']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="indexer.json")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=LOGITS_BUDGET,
                        help="float32 logits per chunk of query rows")
    parser.add_argument("--sweep", action="store_true",
                        help="time the logits kernel's launch configs instead")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.sweep:
        sweep(args)
        return
    ceil = ceilings()
    rows = []
    for name in args.cases:
        rows.append(measure(name, args, ceil))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "args": vars(args), "ceilings": ceil,
                   "results": rows}, f, indent=1)
    print("\n" + table(rows))


if __name__ == "__main__":
    main()
