"""`EngineArgs`: the engine's arguments in one documented dataclass.

`LLM(EngineArgs(...))` and `LLM(model, **keywords)` build the same engine, and the
command line's engine flags are derived from these fields (`add_cli_args`,
`from_cli_args`), so that the three cannot drift apart.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedmla.attention.opaque import compile_supported
from pagedmla.cache import FP8_DTYPE, MODEL_DTYPES, resolve_cache_dtype
from pagedmla.distributed.state import check_parallel_sizes
from pagedmla.ops.registry import available_backends
from pagedmla.validation import boolean, integer, positive_finite, real

# Model dtypes by their names ("auto", also a name of `dtype`, is None: the device's
# default).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _parse_dtype(name: str) -> torch.dtype | None:
    """A --dtype flag's value: one of DTYPES' names or "auto" (None)."""
    if name != "auto" and name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"invalid dtype {name!r}: choose from auto, {', '.join(sorted(DTYPES))}")
    return DTYPES.get(name)


KV_SCALE_CHOICES = ("auto", "calibrate")


def _parse_kv_scale(text: str) -> str | float:
    """A --kv-cache-scale flag's value: auto, calibrate or a number."""
    if text in KV_SCALE_CHOICES:
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(
            f"invalid kv-cache-scale {text!r}: auto, calibrate or a finite number > 0")
    return value


@dataclass
class EngineArgs:
    """Everything an `LLM` is built from, in five groups.

    Model: the checkpoint (`model`), its dtype, the device and the longest sequence.
    Cache: the paged latent KV cache: tokens per page, the entry dtype and an fp8 cache's
    scales, how many pages
    (given, or sized from the GPU memory left), prefix caching, and the rows of the
    workspace that chunked prefill gathers cached context into.
    Scheduling: how many sequences and tokens one step may hold, and whether the host
    plans each step while the device still runs the one before.
    Parallelism: the tensor parallel ranks, the decode context parallel ranks among
    them, and how a sequence's tokens are dealt to those.
    Execution: the kernel backend, CUDA graphs, the start-up warm-up and where compiled
    kernels are kept, cost-based routing of short extends to the absorbed MQA path, and
    the random seed.

    Construction checks every field (`validate`): a TypeError or ValueError names the
    argument, and a dtype given by name becomes the torch.dtype.
    """

    # Model
    model: str = field(default="tiny", metadata={
        "help": "'tiny' (the built-in model) or a Hugging Face checkpoint directory"})
    dtype: torch.dtype | str | None = field(default=None, metadata={
        "help": "model dtype, a torch.dtype or its name; auto (None): bfloat16 on CUDA, "
        "float32 on the CPU",
        "parse": _parse_dtype, "metavar": "{auto," + ",".join(sorted(DTYPES)) + "}"})
    device: str | torch.device | None = field(default=None, metadata={
        "help": "cpu, cuda or cuda:N (default: cuda when present)"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest sequence, prompt and output (default: the model's "
        "max_position_embeddings)"})
    dequantize_weights: bool = field(default=False, metadata={
        "help": "hold a block-fp8 checkpoint's weights in the model dtype, dequantized at "
        "load (twice the memory of fp8, bf16 GEMMs), instead of in fp8"})
    # Cache
    block_size: int = field(default=64, metadata={
        "help": "tokens per cache page (on Hopper, multiples of 8 get the Gluon decode "
        "kernels' bulk tile copies)"})
    kv_cache_dtype: str | torch.dtype = field(default="auto", metadata={
        "help": "cache entries: auto (the model dtype), fp8 or fp8_e4m3 (one per-tensor "
        "scale), or fp8_ds_mla (DeepSeek's 656-byte entries: e4m3 latent with a scale per "
        "128 values, bf16 rope; L = 512, R = 64, bf16 or float32 models)"})
    kv_cache_scale: str | float = field(default="auto", metadata={
        "help": "an fp8 cache's per-layer scales: auto (the checkpoint's k_scale / kv_scale "
        "where it ships them, else calibrate), calibrate (one prefill of random tokens at "
        "start-up), or one number for every layer",
        "parse": _parse_kv_scale, "metavar": "{auto,calibrate,X}"})
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
    prefill_context_parallel_size: int = field(default=1, metadata={
        "help": "replicas of the TP group that split each step's prompt tokens (ranks: "
        "TP size times this)"})
    # Execution
    backend: str = field(default="auto", metadata={
        "help": "kernels: auto (the fastest available), reference or triton"})
    enforce_eager: bool = field(default=False, metadata={"help": "never replay CUDA graphs"})
    compile: bool = field(default=False, metadata={
        "help": "run each step's forward under torch.compile(fullgraph=True), attention "
        "an opaque custom op (steps with prompts then replay no piecewise graphs)"})
    warmup: bool = field(default=True, metadata={
        "help": "at start-up, build every kernel variant the configuration can reach, so "
        "that no request waits for a compilation (compiling backends on CUDA)"})
    compile_cache_dir: str | None = field(default=None, metadata={
        "help": "where compiled kernels are kept across processes (TRITON_CACHE_DIR; "
        "default: Triton's, ~/.triton/cache)"})
    batch_invariant: bool = field(default=False, metadata={
        "help": "a request's tokens and logprobs bitwise the same whatever shares its "
        "steps and however its prompt is chunked; a sampled request's given a seed "
        "(slower: ops/batch_invariant.py)"})
    route_by_cost: bool = field(default=True, metadata={
        "help": "send short extends to the absorbed MQA path where the cost model "
        "(pagedmla.routing) predicts it cheaper"})
    seed: int = field(default=0, metadata={
        "help": "seed of the sampling generator and of torch's global one"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type and value, as far as they can be checked without the
        model or the device (LLM() checks the rest); normalise dtype to a torch.dtype or
        None and model to a str."""
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be 'tiny' or a checkpoint directory, got {self.model!r}")
        self.model = os.fspath(self.model)
        if isinstance(self.dtype, str):
            if self.dtype != "auto" and self.dtype not in DTYPES:
                raise ValueError(f"dtype must be auto, {', '.join(sorted(DTYPES))} or one of "
                                 f"{MODEL_DTYPES}, got {self.dtype!r}")
            self.dtype = DTYPES.get(self.dtype)
        if self.dtype is not None and self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, its name or 'auto', got "
                             f"{self.dtype!r}")
        if self.device is not None:
            _check_device(self.device)
        if self.max_model_len is not None:
            self.max_model_len = integer("max_model_len", self.max_model_len, minimum=1)
        self.block_size = integer("block_size", self.block_size, minimum=1)
        if not isinstance(self.kv_cache_dtype, (str, torch.dtype)):
            raise TypeError(f"kv_cache_dtype must be a str or a torch.dtype, got "
                            f"{self.kv_cache_dtype!r}")
        cache_dtype = resolve_cache_dtype(self.kv_cache_dtype, self.dtype or torch.float32)
        if isinstance(self.kv_cache_scale, str):
            if self.kv_cache_scale not in KV_SCALE_CHOICES:
                raise ValueError(f"kv_cache_scale must be auto, calibrate or a positive "
                                 f"number, got {self.kv_cache_scale!r}")
        else:
            self.kv_cache_scale = positive_finite(
                "kv_cache_scale", real("kv_cache_scale", self.kv_cache_scale))
        if self.kv_cache_scale != "auto" and cache_dtype != FP8_DTYPE:
            raise ValueError(f"kv_cache_scale {self.kv_cache_scale!r} needs kv_cache_dtype "
                             f"fp8 (one scale per layer), got {self.kv_cache_dtype!r}")
        if self.num_kv_blocks is not None:  # block 0 is reserved: 2 at least
            self.num_kv_blocks = integer("num_kv_blocks", self.num_kv_blocks, minimum=2)
        self.gpu_memory_utilization = real("gpu_memory_utilization",
                                           self.gpu_memory_utilization)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.workspace_rows is not None:
            self.workspace_rows = integer("workspace_rows", self.workspace_rows, minimum=1)
        self.max_num_seqs = integer("max_num_seqs", self.max_num_seqs, minimum=1)
        self.max_num_batched_tokens = integer("max_num_batched_tokens",
                                              self.max_num_batched_tokens, minimum=1)
        self.tensor_parallel_size = integer("tensor_parallel_size", self.tensor_parallel_size)
        self.decode_context_parallel_size = integer("decode_context_parallel_size",
                                                    self.decode_context_parallel_size)
        self.prefill_context_parallel_size = integer("prefill_context_parallel_size",
                                                     self.prefill_context_parallel_size)
        check_parallel_sizes(self.tensor_parallel_size, self.decode_context_parallel_size,
                             self.prefill_context_parallel_size)
        self.cp_kv_cache_interleave_size = integer(
            "cp_kv_cache_interleave_size", self.cp_kv_cache_interleave_size, minimum=1)
        if self.backend not in available_backends():
            raise ValueError(f"backend must be one of {available_backends()}, got "
                             f"{self.backend!r}")
        for name in ("dequantize_weights", "enable_prefix_caching", "async_scheduling",
                     "enforce_eager", "compile", "warmup", "batch_invariant",
                     "route_by_cost"):
            boolean(name, getattr(self, name))
        if self.batch_invariant:
            self._check_batch_invariant()
        if self.compile and not compile_supported():
            raise ValueError(f"compile=True needs torch >= 2.10 (custom ops that take Python "
                             f"objects), this is torch {torch.__version__}")
        if self.compile_cache_dir is not None:
            if not isinstance(self.compile_cache_dir, (str, os.PathLike)):
                raise TypeError("compile_cache_dir must be a directory path, got "
                                f"{self.compile_cache_dir!r}")
            self.compile_cache_dir = os.fspath(self.compile_cache_dir)
            if not self.compile_cache_dir:
                raise ValueError("compile_cache_dir must be a directory path, got ''")
        # torch.Generator.manual_seed's range.
        self.seed = integer("seed", self.seed, minimum=0, maximum=2**64 - 1)

    def _check_batch_invariant(self) -> None:
        """ValueError for what batch_invariant=True does not combine with."""
        for name in ("tensor_parallel_size", "prefill_context_parallel_size"):
            if getattr(self, name) > 1:
                raise ValueError(f"batch_invariant=True needs {name} 1 (a collective's "
                                 f"order follows the message size), got {getattr(self, name)}")
        if self.compile:
            raise ValueError("batch_invariant=True and compile=True cannot be combined")
        if self.kv_cache_dtype == "fp8_ds_mla":
            raise ValueError("batch_invariant=True supports the auto, bf16/fp16/fp32 and "
                             "fp8 caches, not fp8_ds_mla")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field: `--block-size` for block_size, `--x / --no-x` for a bool
        field x, plus the spellings in its metadata's "aliases"; help and default from
        the field, the text's parser from its metadata's "parse" or its type."""
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
                parse, metavar = (
                    (f.metadata["parse"], f.metadata["metavar"]) if "parse" in f.metadata
                    else _flag_type(hints[f.name])
                )
                group.add_argument(*flags, dest=f.name, default=f.default, help=text,
                                   type=parse, metavar=metavar)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The EngineArgs of parsed flags (a namespace of `add_cli_args`'s parser)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def _check_device(device: object) -> None:
    """ValueError unless device names the CPU (index 0 at most) or a CUDA device;
    whether that CUDA device exists is LLM()'s to check."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or a torch.device, got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}") from error
    if parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {device!r}")


def _flag_type(hint: Any) -> tuple[Callable[[str], Any], str | None]:
    """How a flag's text becomes the field's value, and its metavar (None: argparse's):
    a field that takes a str takes the text as is (a device or cache dtype name), others
    their own type (int, float)."""
    kinds = set(typing.get_args(hint)) - {type(None)} or {hint}
    if str in kinds:
        return str, None
    (kind,) = kinds
    return kind, None

