"""The split-KV plan against forced split counts, on decode batches just past one wave.

A uniform batch of a few more requests than one wave of programs (132 SMs on an H200,
N = 16) would run its last requests as a tail wave as long as the first; the plan cuts
such batches finer instead (`split_plan`: with the 16-row bf16 kernel, even runs of the
batch's tiles in one wave of persistent programs where they beat whole requests; with
the others, uniform splits or whole waves of splits of two sizes). This times the
decode (stage 1 and the combine, CUDA-graph replays, as `benchmarks.bench_kernels`
times its decode rows) under the plan's own choice and under 1-4 forced splits per
request (`num_splits`, which widens the grid and is never persistent): the plan's time
should match the best uniform split count's. The JSON's `pieces` is the plan's number
of splits. One row pads 132 requests with 12 empty ones, as an engine's graph does:
there the plan's choice should match one split. The last rows are ragged. --cache fp8
times the fp8 cache.

--ragged times, instead, batches past one wave with lengths of every kind (uniform,
two-level, uniform random, lognormal; drawn from a fixed seed) under the plan's choice
and under each of the two plans it chooses between with a kernel that runs several
splits per program (`split_plan`): whole requests (the scored plan on that grid) and the
persistent one (even runs of the batch's tiles), each forced by moving the threshold
`split_plan.STREAM_TILES` out of reach either way. It prints each batch's tiles, the
persistent runs' share and splits per run (the JSON's `pieces_per_run`), and a
least-squares fit of the persistent plan's time against them.

    python -m benchmarks.bench_split_plan --out split_plan.json
    python -m benchmarks.bench_split_plan --ragged --out split_plan_ragged.json
"""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
import torch

from benchmarks.harness import bench, graphed
from benchmarks.workloads import decode_inputs
from pagedmla.ops.triton import split_plan
from pagedmla.ops.triton._utils import cdiv, multiprocessor_count
from pagedmla.ops.triton.decode import mla_decode

# (batch, context, lengths or None for uniform)
SHAPES = [(128, 1088, None), (144, 1088, [1088] * 132 + [0] * 12), (133, 1088, None),
          (140, 1088, None), (170, 1088, None), (200, 1088, None), (140, 2048, None),
          (140, 4096, None), (170, 4096, None), (200, 4096, None), (220, 4096, None),
          (240, 4096, None), (256, 4096, None),
          (300, 4096, None), (140, 8192, None), (170, 8192, None),
          (140, 4096, [4096, 2048] * 70), (152, 4096, [1088] * 132 + [0] * 12 + [4096] * 8)]
SPLITS = (None, 1, 2, 3, 4)  # None: the plan's choice
# The persistent-plan threshold per forced choice (--ragged): the plan's own, never
# persistent (whole requests), always persistent.
THRESHOLDS = {"plan": split_plan.STREAM_TILES, "whole": 10**6, "persistent": -(10**6)}


def ragged_batches(seed: int = 38) -> list[tuple[str, list[int]]]:
    """Batches of 133-256 requests past one wave (N = 16 on an H200), lengths of every
    kind; the random ones from `seed`."""
    rng = random.Random(seed)

    def uniform(n: int, lo: int, hi: int) -> list[int]:
        return [rng.randint(lo, hi) for _ in range(n)]

    def lognormal(n: int, median: int, cap: int) -> list[int]:
        return [max(64, min(cap, int(rng.lognormvariate(0, 0.8) * median))) for _ in range(n)]

    return [
        ("140 x 4k", [4096] * 140), ("140 x 2k", [2048] * 140), ("170 x 1088", [1088] * 170),
        ("200 x 4k", [4096] * 200), ("256 x 4k", [4096] * 256),
        ("70 x 4k + 70 x 2k", [4096, 2048] * 70), ("70 x 8k + 70 x 1k", [8192, 1024] * 70),
        ("100 x 4k + 100 x 1k", [4096, 1024] * 100),
        ("10 x 16k + 130 x 1k", [16384] * 10 + [1024] * 130),
        ("140 in 512-8k", uniform(140, 512, 8192)), ("200 in 512-8k", uniform(200, 512, 8192)),
        ("256 in 256-4k", uniform(256, 256, 4096)), ("140 in 3k-5k", uniform(140, 3072, 5120)),
        ("160 lognormal 2k", lognormal(160, 2048, 16384)),
        ("256 lognormal 2k", lognormal(256, 2048, 16384)),
        ("133 in 1k-2k", uniform(133, 1024, 2048)),
    ]


def run_ragged(heads: int, cache: torch.dtype, label: str) -> list[dict]:
    """The --ragged table (module docstring); returns its rows."""
    programs = multiprocessor_count(torch.device("cuda"))  # one wave at one head group
    rows = []
    print(f"{label} cache, N = {heads}, {programs} persistent programs")
    print("| batch | tiles | share | splits / run | plan µs | whole | persistent "
          "| plan / best |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, lengths in ragged_batches():
        inputs = decode_inputs(len(lengths), heads, max(lengths), cache=cache,
                               lengths=lengths)
        times: dict[str, float] = {}
        splits: dict[str, int] = {}
        for choice, threshold in THRESHOLDS.items():
            split_plan.STREAM_TILES = threshold
            plans: dict = {}
            replay = graphed(lambda x=inputs, p=plans: mla_decode(*x, plans=p))
            times[choice] = bench(replay)
            (plan,) = plans.values()
            splits[choice] = int((plan.work[:, 0] >= 0).sum())
            del replay
            if plan.rows == plan.programs:  # a kernel of one split per program: no choice
                break
        split_plan.STREAM_TILES = THRESHOLDS["plan"]
        tiles = sum(max(1, cdiv(n, 64)) for n in lengths)
        share = cdiv(tiles, programs)
        per_run = splits.get("persistent", 0) / programs
        rows.append({"batch": name, "N": heads, "cache": label, "lengths": lengths,
                     "tiles": tiles, "share": share, "pieces_per_run": per_run,
                     "pieces": splits, "us": times})
        forced = [times.get("whole"), times.get("persistent")]
        ratio = f"{times['plan'] / min(forced):.3f}" if None not in forced else "-"
        print(f"| {name} | {tiles} | {share} | {per_run:.2f} | {times['plan']:.1f} | "
              + " | ".join("-" if t is None else f"{t:.1f}" for t in forced)
              + f" | {ratio} |", flush=True)
        del inputs
        torch.cuda.empty_cache()
    if any("persistent" not in r["us"] for r in rows):
        return rows
    # The persistent plan's time ~ a + b x share + c x splits per run (µs).
    design = np.array([[1.0, r["share"], r["pieces_per_run"]] for r in rows])
    a, b, c = np.linalg.lstsq(design, np.array([r["us"]["persistent"] for r in rows]),
                              rcond=None)[0]
    print(f"persistent plan: {a:.1f} us + {b:.3f} us x share + {c:.2f} us x splits per run")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--ragged", action="store_true",
                        help="whole vs persistent plans on batches of every kind")
    parser.add_argument("--out", default="split_plan.json")
    args = parser.parse_args()
    cache = torch.float8_e4m3fn if args.cache == "fp8" else torch.bfloat16
    if args.ragged:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(),
                       "rows": run_ragged(args.heads, cache, args.cache)}, f, indent=1)
        return
    rows = []
    print(f"{args.cache} cache, N = {args.heads}")
    print("| batch | context | splits | plan µs | 1 split | 2 | 3 | 4 | plan / best forced |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, lengths in SHAPES:
        inputs = decode_inputs(batch, args.heads, context, cache=cache, lengths=lengths)
        times, plan_splits = {}, 0
        for splits in SPLITS:
            plans: dict = {}
            replay = graphed(lambda x=inputs, s=splits, p=plans: mla_decode(
                *x, num_splits=s, plans=p))
            times["plan" if splits is None else str(splits)] = bench(replay)
            if splits is None:
                (plan,) = plans.values()
                plan_splits = int((plan.work[:, 0] >= 0).sum())
        label = str(batch) if lengths is None else f"{batch} ragged"
        rows.append({"batch": label, "N": args.heads, "context": context, "cache": args.cache,
                     "lengths": lengths, "pieces": plan_splits, "us": times})
        best = min(t for k, t in times.items() if k != "plan")
        print(f"| {label} | {context} | {plan_splits} | "
              + " | ".join(f"{t:.1f}" for t in times.values())
              + f" | {times['plan'] / best:.2f} |", flush=True)
        del inputs, replay
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
