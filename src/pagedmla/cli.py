"""The `pagedmla` command line (also `python -m pagedmla`): generate, serve, bench, check.

The engine flags of `generate` and `bench` are `EngineArgs`' fields
(`EngineArgs.add_cli_args`), with its defaults.

A flag value of the wrong form or range is an argparse error: the usage and
`pagedmla ...: error: argument --flag: ...`, exit status 2. So is an input the engine
refuses (its ValueError, TypeError or OSError: a missing or broken checkpoint, a prompt
longer than the model allows), printed as `pagedmla: error: ...` without a traceback.
Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import re
import sys
import time
from pathlib import Path

import torch

import pagedmla
from pagedmla.engine import LLM, EngineArgs, SamplingParams
from pagedmla.engine.args import DTYPES

# Lines of a prompts file end at "\n", "\r\n" or "\r" (and nowhere else, unlike
# str.splitlines, which would cut a prompt at a form feed or U+2028).
_LINE_END = re.compile(r"\r\n|\r|\n")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _real(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _top_k(text: str) -> int:
    value = _integer(text)
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (off) or an integer >= 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = _real(text)
    if not 0.0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    value = _real(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    value = _real(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def _port(text: str) -> int:
    value = _integer(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value}")
    return value


def _device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r}") from None
    return text


def _prompt_lines(path: str) -> list[str]:
    """The non-empty lines of the UTF-8 text file `path`, a byte order mark at its start
    dropped (as the "utf-8-sig" codec does; decoded here as "utf-8" so that an error's
    offset counts the file's bytes)."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {err.strerror or err}") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"{path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} "
            f"({err.reason})"
        ) from None
    return [line for line in _LINE_END.split(text.removeprefix("\ufeff")) if line]


def _throughput(tokens: int, seconds: float) -> str:
    return f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds if seconds else 0.0:.1f} tok/s)"


def _generate(args: argparse.Namespace) -> int:
    prompts = [*(args.prompt or []), *(args.prompts_file or [])]
    if not prompts:
        prompts = ["**pagedmla** is", "MLA (DeepSeek-V2) caches", "Tensor parallelism"]
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.seed if args.temperature > 0 else None,
    )
    llm = LLM(EngineArgs.from_cli_args(args))
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


def _serve(args: argparse.Namespace) -> int:
    from pagedmla.server.main import serve

    return serve(EngineArgs.from_cli_args(args), host=args.host, port=args.port,
                 api_key=args.api_key, served_model_name=args.served_model_name)


def _check(args: argparse.Namespace) -> int:
    from pagedmla.check import run_check

    passed = run_check(args.device or "cpu", DTYPES[args.dtype], args.backend,
                       kv_cache_dtype=args.kv_cache_dtype, kv_cache_scale=args.kv_cache_scale)
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmla", description="Multi-head latent attention")
    parser.add_argument("--version", action="version", version=f"%(prog)s {pagedmla.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="complete prompts with an MLA model")
    EngineArgs.add_cli_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--prompts-file", type=_prompt_lines, default=None, metavar="FILE",
                     help="a UTF-8 text file, one prompt per line (empty lines skipped)")
    gen.add_argument("--max-tokens", type=_positive_int, default=32)
    gen.add_argument("--temperature", type=_non_negative_float, default=0.0,
                     help="0 (the default) is greedy")
    gen.add_argument("--top-p", type=_probability, default=1.0)
    gen.add_argument("--top-k", type=_top_k, default=-1, help="-1 (the default) is off")
    gen.set_defaults(func=_generate)

    bench = commands.add_parser(
        "bench", help="synthetic serving benchmark (kernel benchmarks: python -m "
        "benchmarks.bench_kernels in the repository)")
    EngineArgs.add_cli_args(bench)
    bench.add_argument("--num-requests", type=_positive_int, default=32)
    bench.add_argument("--input-len", type=_positive_int, default=128,
                       help="longest prompt; lengths are drawn from [input-len // 2, input-len]")
    bench.add_argument("--output-len", type=_positive_int, default=32,
                       help="most tokens per request, drawn like --input-len")
    bench.set_defaults(func=_bench)

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming)")
    EngineArgs.add_cli_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: %(default)s, this machine only)")
    serve.add_argument("--port", type=_port, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="demand 'Authorization: Bearer KEY' on /v1, /tokenize, /detokenize")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: --model)")
    serve.set_defaults(func=_serve)

    check = commands.add_parser(
        "check", help="run a mixed MLA step for DeepSeek shapes against the dense oracle"
    )
    check.add_argument("--device", type=_device, default=None, help="cpu (default) or cuda")
    check.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    check.add_argument("--backend", default="auto")
    check.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                       help="fp8: the cache stores x / scale and the check reports clipping")
    check.add_argument("--kv-cache-scale", type=_positive_float, default=1.0,
                       help="the fp8 cache's scale (default: %(default)s)")
    check.set_defaults(func=_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # The engine's start-up report (each rank's memory, the load time) goes to stderr.
    logging.basicConfig(format="%(name)s: %(message)s")
    logging.getLogger("pagedmla").setLevel(logging.INFO)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")


if __name__ == "__main__":  # python -m pagedmla.cli (`python -m pagedmla` is __main__.py)
    sys.exit(main())
