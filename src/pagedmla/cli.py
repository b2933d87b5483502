"""The `pagedmla` command line."""

from __future__ import annotations

import argparse
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _check(args: argparse.Namespace) -> int:
    from pagedmla.check import run_check

    device = args.device or "cpu"
    return 0 if run_check(device, DTYPES[args.dtype], args.backend) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmla", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
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
