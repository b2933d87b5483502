"""The `pagedmla` command line (also `python -m pagedmla`): generate, bench, check.

The engine flags of `generate` and `bench` are `EngineArgs`' fields
(`EngineArgs.add_cli_args`), with its defaults.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from pagedmla.engine import LLM, EngineArgs, SamplingParams
from pagedmla.engine.args import DTYPES


def _throughput(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds if seconds else 0.0:.1f} tok/s)"


def _generate(args: argparse.Namespace) -> int:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line]
    if not prompts:
        prompts = ["The paged latent cache", "Multi-head latent attention is"]
    llm = LLM(EngineArgs.from_cli_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed if args.temperature > 0 else None,
    )
    outputs = llm.generate(prompts, params)
    for out in outputs:
        print(f"--- prompt: {out.prompt!r}")
        print(f"    completion: {out.outputs[0].text!r}")
    stats = llm.stats
    print(f"prefill: {_throughput(stats.prefill_tokens, stats.prefill_time)}")
    print(f"decode:  {_throughput(stats.decode_tokens, stats.decode_time)}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    llm = LLM(EngineArgs.from_cli_args(args))
    vocab = llm.config.vocab_size
    prompts, params = [], []
    for _ in range(args.num_requests):
        length = rng.randint(max(1, args.input_len // 2), args.input_len)
        prompts.append([rng.randrange(vocab) for _ in range(length)])
        params.append(SamplingParams(
            temperature=0.0, ignore_eos=True,
            max_tokens=rng.randint(max(1, args.output_len // 2), args.output_len),
        ))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(p) for p in prompts)
    ttft = sorted(llm.stats.first_token_times.values())
    print(f"{args.num_requests} requests in {elapsed:.2f} s: "
          f"{args.num_requests / elapsed:.2f} req/s, "
          f"{(prompt_tokens + generated) / elapsed:.1f} tok/s total, "
          f"{generated / elapsed:.1f} generated tok/s")
    print(f"time to first token: median {ttft[len(ttft) // 2] * 1e3:.0f} ms, "
          f"max {ttft[-1] * 1e3:.0f} ms; {llm.stats.steps} steps, "
          f"{llm.stats.preemptions} preemptions")
    return 0


def _check(args: argparse.Namespace) -> int:
    from pagedmla.check import run_check

    passed = run_check(args.device or "cpu", DTYPES[args.dtype], args.backend)
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmla", description="Multi-head latent attention")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts with an MLA model")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.set_defaults(func=_generate)

    bench = commands.add_parser(
        "bench", help="synthetic serving benchmark (kernel benchmarks: python -m "
        "benchmarks.bench_kernels in the repository)")
    EngineArgs.add_cli_args(bench)
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=32)
    bench.set_defaults(func=_bench)

    check = commands.add_parser(
        "check", help="run a mixed MLA step for DeepSeek shapes against the dense oracle"
    )
    check.add_argument("--device", default=None, help="cpu (default) or cuda")
    check.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    check.add_argument("--backend", default="auto")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # python -m pagedmla.cli (`python -m pagedmla` is __main__.py)
    sys.exit(main())
