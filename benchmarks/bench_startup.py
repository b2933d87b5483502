"""Start-up and first-call cost on a GPU: what `LLM(...)` takes, and whether the first
`generate` of each workload after it costs more than the same call later.

Writes `benchmarks.bench_engine`'s random-weight DeepSeek checkpoint (V2-Lite attention,
`--layers`, `--hidden`, `--moe`), builds an `LLM` on it per cache dtype, then runs each
workload `--runs` times, every run with fresh random prompts:

- batch: 64 prompts of 256 tokens, 128 generated each (prefill, then decode);
- decode: 64 prompts of 16 tokens, 128 generated (decode steps dominate);
- chunked: 4 prompts of 7680 tokens, 16 generated (prefill chunks with context);
- prefix: one prompt of a fixed 1024-token prefix and a random 64-token suffix, then 32
  more with that prefix (prefix-cache hits), 32 generated;
- sampled: 32 prompts of 64 tokens, 64 generated with temperature, top-k, top-p,
  penalties and logprobs.

First: the first run's seconds; steady: the median of the others; ratio: first / steady.
Compiles: Triton/Gluon kernel compilations (Triton's `jit_cache_hook`, so loads from the
on-disk cache count too) during `LLM(...)` and during each run; the kernels compiled
during a run are listed in the JSON. `--fail-on-compile` exits 1 if any run compiled.

    python -m benchmarks.bench_startup --compile-cache-dir /tmp/kernels --out startup.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.bench_engine import bench_config
from pagedmla import LLM, SamplingParams
from pagedmla.engine.startup import CompileLog
from pagedmla.models.tiny import write_tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def workloads(vocab: int) -> dict[str, Callable[[LLM, random.Random], None]]:
    """Each workload: one run, on the LLM, with prompts from the run's generator."""
    prefix = _prompts(random.Random(-1), 1, 1024, vocab)[0]

    def run(llm: LLM, prompts: list[list[int]], **params: Any) -> None:
        llm.generate(prompts, SamplingParams(**params), use_tqdm=False)

    def prefixed(llm: LLM, rng: random.Random) -> None:
        run(llm, [prefix + p for p in _prompts(rng, 1, 64, vocab)], max_tokens=1, **GREEDY)
        run(llm, [prefix + p for p in _prompts(rng, 32, 64, vocab)], max_tokens=32, **GREEDY)

    return {
        "batch": lambda llm, rng: run(llm, _prompts(rng, 64, 256, vocab), max_tokens=128,
                                      **GREEDY),
        "decode": lambda llm, rng: run(llm, _prompts(rng, 64, 16, vocab), max_tokens=128,
                                       **GREEDY),
        "chunked": lambda llm, rng: run(llm, _prompts(rng, 4, 7680, vocab), max_tokens=16,
                                        **GREEDY),
        "prefix": prefixed,
        "sampled": lambda llm, rng: run(
            llm, _prompts(rng, 32, 64, vocab), max_tokens=64, temperature=0.8, top_k=50,
            top_p=0.9, presence_penalty=0.5, repetition_penalty=1.1, logprobs=5,
            seed=rng.randrange(2**31), ignore_eos=True),
    }


def measure(checkpoint: str, cache: str, runs: int, names: list[str], log: CompileLog,
            vocab: int, warmup: bool, compile_cache_dir: str | None) -> dict:
    log.take()
    start = time.perf_counter()
    llm = LLM(checkpoint, kv_cache_dtype=cache, warmup=warmup,
              compile_cache_dir=compile_cache_dir)
    result: dict[str, Any] = {"start_s": time.perf_counter() - start,
                              "start_compiles": sum(log.take().values()),
                              "phases": llm.startup.phases, "workloads": {}}
    print(f"{cache}: {llm.startup}", flush=True)
    table = workloads(vocab)
    for name in names:
        seconds, compiled = [], []
        for r in range(runs):
            begin = time.perf_counter()
            table[name](llm, random.Random(r))
            seconds.append(time.perf_counter() - begin)
            compiled.append(dict(log.take()))
            print(f"{cache} {name} run {r}: {seconds[-1]:.3f} s, compiled {compiled[-1]}",
                  flush=True)
        steady = statistics.median(seconds[1:])
        result["workloads"][name] = {
            "first_s": seconds[0], "steady_s": steady, "ratio": seconds[0] / steady,
            "seconds": seconds, "compiled": compiled}
    llm.close()
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe", action="store_true", help="V2-Lite's routed experts")
    parser.add_argument("--caches", nargs="+", default=["auto", "fp8"])
    parser.add_argument("--workloads", nargs="+",
                        default=["batch", "decode", "chunked", "prefix", "sampled"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-warmup", action="store_true", help="LLM(warmup=False)")
    parser.add_argument("--compile-cache-dir", help="LLM(compile_cache_dir=...): an empty "
                        "directory measures a cold start, a filled one a warm start")
    parser.add_argument("--fail-on-compile", action="store_true")
    parser.add_argument("--out", default="startup.json")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error("--runs must be at least 2: the first run, then the later ones")
    config = bench_config(args.layers, args.hidden, args.moe)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results: dict[str, Any] = {"args": vars(args), "device": device}
    with tempfile.TemporaryDirectory() as directory, CompileLog() as log:
        write_tiny_checkpoint(directory, config=config)
        for cache in args.caches:
            results[cache] = measure(directory, cache, args.runs, args.workloads, log,
                                     config["vocab_size"], not args.no_warmup,
                                     args.compile_cache_dir)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("| cache | workload | first s | steady s | ratio | compiles (first / later) |")
    print("|---|---|---:|---:|---:|---|")
    late = 0
    for cache in args.caches:
        r = results[cache]
        print(f"| {cache} | LLM(...) | {r['start_s']:.2f} | | | {r['start_compiles']} |")
        for name, w in r["workloads"].items():
            counts = [sum(c.values()) for c in w["compiled"]]
            late += sum(counts)
            print(f"| {cache} | {name} | {w['first_s']:.3f} | {w['steady_s']:.3f} | "
                  f"{w['ratio']:.2f} | {counts[0]} / {sum(counts[1:])} |")
    return 1 if args.fail_on_compile and late else 0


if __name__ == "__main__":
    sys.exit(main())
