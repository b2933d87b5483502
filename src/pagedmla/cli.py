"""The `pagedmla` command line: generate, bench, check."""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny' (built in) or a checkpoint dir")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                        help="model dtype (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto, fp8 or fp8_e4m3")
    parser.add_argument("--block-size", type=int, default=64,
                        help="tokens per cache page (on Hopper, multiples of 8 get the Gluon "
                        "decode kernels' bulk tile copies)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="never replay CUDA graphs for decode steps")
    parser.add_argument("--no-async-scheduling", action="store_true",
                        help="wait for each step's tokens before planning the next")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks to shard the model over (processes started here, or torchrun)")
    parser.add_argument("--decode-context-parallel-size", type=int, default=1,
                        help="ranks (dividing the TP size) that share each sequence's KV cache")
    parser.add_argument("--cp-kv-cache-interleave-size", type=int, default=1,
                        help="consecutive tokens per rank in the decode context parallel layout")


def _make_llm(args: argparse.Namespace):
    from pagedmla import LLM

    return LLM(
        model=args.model,
        dtype=DTYPES[args.dtype] if args.dtype else None,
        device=args.device,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.num_kv_blocks,
        enable_prefix_caching=not args.no_prefix_caching,
        backend=args.backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
    )


def _throughput(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds if seconds else 0.0:.1f} tok/s)"


def _generate(args: argparse.Namespace) -> int:
    from pagedmla import SamplingParams

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [line for line in Path(args.prompts_file).read_text().splitlines() if line]
    if not prompts:
        prompts = ["The paged latent cache", "Multi-head latent attention is"]
    llm = _make_llm(args)
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
    if args.kernels:
        from pagedmla.kernel_bench import main as kernel_bench

        Path(args.out).mkdir(parents=True, exist_ok=True)
        return kernel_bench(["--out", f"{args.out}/bench_kernels.json", "--plots", args.out])
    from pagedmla import SamplingParams

    rng = random.Random(args.seed)
    llm = _make_llm(args)
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
    _engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", default=None, help="one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.set_defaults(func=_generate)

    bench = commands.add_parser("bench", help="synthetic serving benchmark")
    _engine_args(bench)
    bench.add_argument("--num-requests", type=int, default=32)
    bench.add_argument("--input-len", type=int, default=128)
    bench.add_argument("--output-len", type=int, default=32)
    bench.add_argument("--kernels", action="store_true", help="run the GPU kernel benchmarks")
    bench.add_argument("--out", default="results", help="directory for --kernels results")
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


if __name__ == "__main__":
    sys.exit(main())
