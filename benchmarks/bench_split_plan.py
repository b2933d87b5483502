"""The split plan against forced piece counts, on decode batches just past one wave.

A uniform batch of a few more requests than one wave of programs (132 SMs on an H200,
N = 16) would run its last requests as a second wave as long as the first; the plan
cuts such batches finer instead (`split_plan`: with the 16-row bf16 kernel, even runs
of the batch's tiles in one wave of persistent programs where they beat whole
requests; with the others, uniform pieces or whole waves of pieces of two sizes). This
times the decode (stage 1 and the combine, CUDA-graph replays, as the kernel benchmark
times its decode rows) under the plan's own choice and under 1-4 forced pieces per
request (`num_splits`, which widens the grid and is never persistent), to check the
plan's choice against the best uniform cut; `pieces` is the plan's count.
One row pads 132 requests with 12 empty ones, as an engine's graph does: there the
plan's choice should match one piece. The last rows are ragged. --cache fp8 times the
fp8 cache.

    python3 benchmarks/bench_split_plan.py --out split_plan.json
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedmla.kernel_bench import bench, decode_inputs, graphed
from pagedmla.ops.triton.decode import mla_decode

# (batch, context, lengths or None for uniform)
SHAPES = [(128, 1088, None), (144, 1088, [1088] * 132 + [0] * 12), (133, 1088, None),
          (140, 1088, None), (170, 1088, None), (200, 1088, None), (140, 2048, None),
          (140, 4096, None), (170, 4096, None), (200, 4096, None), (220, 4096, None),
          (240, 4096, None), (256, 4096, None),
          (300, 4096, None), (140, 8192, None), (170, 8192, None),
          (140, 4096, [4096, 2048] * 70), (152, 4096, [1088] * 132 + [0] * 12 + [4096] * 8)]
SPLITS = (None, 1, 2, 3, 4)  # None: the plan's choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--cache", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--out", default="split_plan.json")
    args = parser.parse_args()
    cache = torch.float8_e4m3fn if args.cache == "fp8" else torch.bfloat16
    rows = []
    print(f"{args.cache} cache, N = {args.heads}")
    print("| batch | context | pieces | plan µs | 1 piece | 2 | 3 | 4 | plan / best forced |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch, context, lengths in SHAPES:
        inputs = decode_inputs(batch, args.heads, context, cache=cache, lengths=lengths)
        times, pieces = {}, 0
        for splits in SPLITS:
            plans: dict = {}
            replay = graphed(lambda x=inputs, s=splits, p=plans: mla_decode(
                *x, num_splits=s, plans=p))
            times["plan" if splits is None else str(splits)] = bench(replay)
            if splits is None:
                (plan,) = plans.values()
                pieces = int((plan.work[:, 0] >= 0).sum())
        label = str(batch) if lengths is None else f"{batch} ragged"
        rows.append({"batch": label, "N": args.heads, "context": context, "cache": args.cache,
                     "lengths": lengths, "pieces": pieces, "us": times})
        best = min(t for k, t in times.items() if k != "plan")
        print(f"| {label} | {context} | {pieces} | "
              + " | ".join(f"{t:.1f}" for t in times.values())
              + f" | {times['plan'] / best:.2f} |", flush=True)
        del inputs, replay
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
