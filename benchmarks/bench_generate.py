"""End-to-end offline throughput (`pagedmla bench`) on `benchmarks.bench_engine`'s model.

Writes that random-weight DeepSeek checkpoint (`--layers`, `--hidden`, `--moe`; see
`bench_engine.bench_config`) to a temporary directory and runs `pagedmla bench --model
<it>` with the arguments after `--`: requests of random prompt tokens, generated to
their max_tokens, timed end to end through `LLM.generate` (tokens per second of prefill
and decode). For example, 600 requests of 512 prompt and 256 generated tokens on the
27-layer model:

    python -m benchmarks.bench_generate --layers 27 -- --dtype bfloat16 \\
        --num-requests 600 --input-len 512 --output-len 256 --max-num-seqs 128 \\
        --max-num-batched-tokens 2048 --num-kv-blocks 4096
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from benchmarks.bench_engine import bench_config
from pagedmla.cli import main as pagedmla_main
from pagedmla.models.tiny import write_tiny_checkpoint


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--moe", action="store_true", help="V2-Lite's routed experts")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="after --: arguments of `pagedmla bench` (not --model)")
    args = parser.parse_args(argv)
    rest = [a for a in args.bench_args if a != "--"]
    if "--model" in rest:
        parser.error("--model is the checkpoint this script writes: leave it out")
    with tempfile.TemporaryDirectory() as directory:
        write_tiny_checkpoint(directory, config=bench_config(args.layers, args.hidden, args.moe))
        return pagedmla_main(["bench", "--model", directory, *rest])


if __name__ == "__main__":
    sys.exit(main())
