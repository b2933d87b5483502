"""`EngineArgs`: the engine's arguments in one documented dataclass.

`LLM(EngineArgs(...))` and `LLM(model, **keywords)` build the same engine, and the
command line's engine flags are derived from these fields (`add_cli_args`,
`from_cli_args`), so that the three cannot drift apart.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

# Model dtypes by their command-line names.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineArgs:
    """Everything an `LLM` is built from, in five groups.

    Model: the checkpoint (`model`), its dtype, the device and the longest sequence.
    Cache: the paged latent KV cache: tokens per page, the entry dtype, how many pages
    (given, or sized from the GPU memory left), prefix caching, and the rows of the
    workspace that chunked prefill gathers cached context into.
    Scheduling: how many sequences and tokens one step may hold, and whether the host
    plans each step while the device still runs the one before.
    Parallelism: the tensor parallel ranks, the decode context parallel ranks among
    them, and how a sequence's tokens are dealt to those.
    Execution: the kernel backend, CUDA graphs, cost-based routing of short extends to
    the absorbed MQA path, and the random seed.
    """

    # Model
    model: str = field(default="tiny", metadata={
        "help": "'tiny' (the built-in model) or a Hugging Face checkpoint directory"})
    dtype: torch.dtype | None = field(default=None, metadata={
        "help": "model dtype (default: bfloat16 on CUDA, float32 on the CPU)"})
    device: str | torch.device | None = field(default=None, metadata={
        "help": "cpu or cuda (default: cuda when present)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest sequence, prompt and output (default: the model's "
        "max_position_embeddings)"})
    # Cache
    block_size: int = field(default=64, metadata={
        "help": "tokens per cache page (on Hopper, multiples of 8 get the Gluon decode "
        "kernels' bulk tile copies)"})
    kv_cache_dtype: str | torch.dtype = field(default="auto", metadata={
        "help": "cache entries: auto (the model dtype), fp8 or fp8_e4m3"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "cache pages per layer (default: what gpu_memory_utilization leaves; "
        "64Ki tokens on the CPU)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "fraction of the GPU's memory that the model, the workspace and the cache "
        "may fill"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the cached pages of shared prompt prefixes",
        "aliases": ("--prefix-caching",)})
    workspace_rows: int | None = field(default=None, metadata={
        "help": "rows of the chunked-prefill context workspace (default: sized from "
        "max_model_len and max_num_seqs)"})
    # Scheduling
    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    max_num_batched_tokens: int = field(default=8192, metadata={
        "help": "most tokens in one step (longer prompts are prefilled in chunks)"})
    async_scheduling: bool = field(default=True, metadata={
        "help": "plan and enqueue each step while the device still runs the one before"})
    # Parallelism
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks to shard the model over (processes started here, or torchrun)"})
    decode_context_parallel_size: int = field(default=1, metadata={
        "help": "ranks (dividing the TP size) that share each sequence's KV cache"})
    cp_kv_cache_interleave_size: int = field(default=1, metadata={
        "help": "consecutive tokens per rank in the decode context parallel layout"})
    # Execution
    backend: str = field(default="auto", metadata={
        "help": "kernels: auto (the fastest available), reference or triton"})
    enforce_eager: bool = field(default=False, metadata={"help": "never replay CUDA graphs"})
    route_by_cost: bool = field(default=True, metadata={
        "help": "send short extends to the absorbed MQA path where the cost model "
        "(pagedmla.routing) predicts it cheaper"})
    seed: int = field(default=0, metadata={
        "help": "seed of the sampling generator and of torch's global one"})

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field: `--block-size` for block_size, `--x / --no-x` for a bool
        field x, plus the spellings in its metadata's "aliases"; help and default from
        the field."""
        group = parser.add_argument_group("engine (pagedmla.EngineArgs)")
        hints = typing.get_type_hints(EngineArgs)
        for f in fields(EngineArgs):
            flags = (f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ()))
            text = f.metadata["help"]
            if f.default is not None:
                text += " (default: %(default)s)"
            if hints[f.name] is bool:
                group.add_argument(*flags, dest=f.name, default=f.default, help=text,
                                   action=argparse.BooleanOptionalAction)
            else:
                parse, metavar = _flag_type(hints[f.name])
                group.add_argument(*flags, dest=f.name, default=f.default, help=text,
                                   type=parse, metavar=metavar)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags (a namespace of `add_cli_args`'s parser)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid dtype {name!r}: choose from {', '.join(sorted(DTYPES))}")
    return DTYPES[name]


def _flag_type(hint: Any) -> tuple[Callable[[str], Any], str | None]:
    """How a flag's text becomes the field's value, and its metavar (None: argparse's):
    a field that takes a str takes the text as is (a device or cache dtype name), a
    torch.dtype field one of DTYPES' names, others their own type (int, float)."""
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    if str in kinds:
        return str, None
    if torch.dtype in kinds:
        return _parse_dtype, "{" + ",".join(sorted(DTYPES)) + "}"
    (kind,) = kinds
    return kind, None

