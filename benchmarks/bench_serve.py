"""Load benchmark of `pagedmla serve`: Poisson arrivals at several rates, against the same
workload through offline `LLM.generate` on the same machine.

The server runs as a child process on the loopback interface, with the engine flags
given after `--` (the offline LLM gets the same ones). Each request streams a completion
of fixed prompt and output lengths (random token ids, greedy, EOS ignored) over
`/v1/completions`; time to first token (TTFT) and inter-token latency (ITL) are taken
from the arrival of each streamed chunk. Offline, all requests are queued at once:
its throughput is what the server's is compared with, and its time to first token for
one request at a time (an idle engine, `max_tokens=1`) is what the server adds to.

    python -m benchmarks.bench_serve --rates 1 4 16 inf --requests 200 \\
        --input-len 512 --output-len 128 --out serve.json -- --model CKPT --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import math
import random
import socket
import subprocess
import sys
import time

import httpx
import torch

from pagedmla import LLM, SamplingParams
from pagedmla.engine.args import EngineArgs

TTFT_PROMPTS = 16  # offline single-request time to first token: median over these


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


async def _one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
               output_len: int, record: list[dict]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    record.append({"ttft": stamps[0] - start, "itl": gaps, "end": stamps[-1]})


async def _load(url: str, model: str, prompts: list[list[int]], output_len: int, rate: float,
                seed: int) -> dict:
    """Send the prompts at Poisson arrivals of `rate` per second (inf: all at once)."""
    rng = random.Random(seed)
    record: list[dict] = []
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(_one(client, url, model, prompt, output_len,
                                                  record)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        elapsed = max(r["end"] for r in record) - start
    ttft = [r["ttft"] * 1e3 for r in record]
    itl = [g * 1e3 for r in record for g in r["itl"]]
    return {"rate": rate, "requests": len(prompts), "seconds": elapsed,
            "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "ttft_ms_p50": _percentile(ttft, 0.5), "ttft_ms_p99": _percentile(ttft, 0.99),
            "itl_ms_p50": _percentile(itl, 0.5), "itl_ms_p99": _percentile(itl, 0.99)}


def _offline(engine_flags: list[str], prompts: list[list[int]], output_len: int) -> dict:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    llm = LLM(EngineArgs.from_cli_args(parser.parse_args(engine_flags)))
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: the same kernels as timed
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ttft = []
    for prompt in prompts[:TTFT_PROMPTS]:  # one at a time: an idle engine's first token
        begin = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        ttft.append((time.perf_counter() - begin) * 1e3)
    llm.close()
    del llm  # give the GPU's memory back for the server's cache
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"seconds": elapsed, "requests_per_s": len(prompts) / elapsed,
            "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "ttft_ms_p50": _percentile(ttft, 0.5)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1.0, 4.0, 16.0, math.inf])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=250, help="token ids drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="serve.json")
    args = parser.parse_args(argv[:split])
    engine_flags = argv[split + 1:]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, args.vocab) for _ in range(args.input_len)]
               for _ in range(args.requests)]
    offline = _offline(engine_flags, prompts, args.output_len)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pagedmla", "serve", "--port", str(port),
                               "--served-model-name", "bench", *engine_flags])
    try:
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("the server exited") from None
                time.sleep(0.5)
        asyncio.run(_load(url, "bench", prompts, args.output_len, math.inf, 0))  # warm-up
        rows = [asyncio.run(_load(url, "bench", prompts, args.output_len, rate, args.seed))
                for rate in args.rates]
    finally:
        server.terminate()
        server.wait(60)
    for row in rows:
        row["vs_offline"] = row["output_tokens_per_s"] / offline["output_tokens_per_s"]
        row["ttft_added_ms"] = row["ttft_ms_p50"] - offline["ttft_ms_p50"]
    result = {"args": vars(args), "engine_flags": engine_flags, "offline": offline,
              "online": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"offline: {offline['requests_per_s']:.2f} req/s, "
          f"{offline['output_tokens_per_s']:.0f} output tok/s, "
          f"single-request TTFT {offline['ttft_ms_p50']:.1f} ms")
    print("| rate | req/s | out tok/s | vs offline | TTFT p50 | p99 | added p50 "
          "| ITL p50 | p99 (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['rate']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
              f"{r['vs_offline']:.2f} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f} | "
              f"{r['ttft_added_ms']:.1f} | "
              f"{r['itl_ms_p50']:.2f} | {r['itl_ms_p99']:.2f} |")


if __name__ == "__main__":
    main()
