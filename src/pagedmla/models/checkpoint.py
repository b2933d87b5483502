"""A Hugging Face checkpoint directory's tensors, read whole or by slice.

A directory holds config.json and either `model.safetensors`, shards listed by
`model.safetensors.index.json`, or loose `*.safetensors` files. Every shard's header is
read when a `Checkpoint` is opened (names, shapes and dtypes; a truncated shard or one
that lacks a tensor its index lists is found there), and tensors are read by slice
(`safe_open(...).get_slice`), so that a tensor parallel rank reads only the rows or
columns it keeps. `Checkpoint.bytes_read` counts the bytes of the slices read.

DeepSeek's fp8 block-quantized weights (`X.weight` in float8_e4m3fn with a float32
`X.weight_scale_inv`, one scale per 128x128 block, found in any shard) are read as they
are stored (a model that keeps them in fp8 reads the scales as tensors of their own) or
dequantized as they are read: a slice of the weight with the scales of the blocks it
touches, each element multiplied by its block's scale, so a slice gives exactly the
same values as the same slice of the whole dequantized weight.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from pagedmla.models.config import weight_block_size
from pagedmla.ops.block_fp8 import (
    DEFAULT_BLOCK_SIZE,
    FP8_WEIGHT_DTYPE,
    dequantize_blocks,
    scale_grid,
)
from pagedmla.validation import read_json_object

SCALE_SUFFIX = "_scale_inv"
_FP8_NAMES = ("F8_E4M3", "F8_E5M2")  # the same dtypes as safetensors headers spell them
_MAX_NAMES_SHOWN = 10


@contextmanager
def _open_shard(file: Path) -> Iterator[Any]:
    """safe_open(file), its errors (a truncated or corrupt file) as ValueErrors naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{file} is not a complete safetensors file: {err}") from err


@dataclass(frozen=True)
class Stored:
    """A checkpoint tensor as its shard's header describes it."""

    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "BF16", "F32", "F8_E4M3", ...


def _stored_tensors(directory: Path) -> dict[str, Stored]:
    """Every tensor of the checkpoint, from the shards' headers (the index's names only,
    where there is an index)."""
    index_path = directory / "model.safetensors.index.json"
    listed: dict[str, set[str]] | None = None
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ValueError(f"{index_path}: 'weight_map' must map tensor names to file names")
        listed = {}
        for name, file in weight_map.items():
            listed.setdefault(file, set()).add(name)
        missing = sorted(f for f in listed if not (directory / f).is_file())
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard files not present: {missing}")
        files = [directory / f for f in sorted(listed)]
    else:
        single = directory / "model.safetensors"
        files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {directory}")
    stored: dict[str, Stored] = {}
    for file in files:
        with _open_shard(file) as f:  # reads the header only
            names = set(f.keys())
            if listed is not None:
                absent = sorted(listed[file.name] - names)
                if absent:
                    raise ValueError(
                        f"{file} lacks {len(absent)} tensor(s) that {index_path.name} "
                        f"lists: {names_shown(absent)}"
                    )
                names = listed[file.name]
            for name in sorted(names):
                part = f.get_slice(name)
                stored[name] = Stored(file, tuple(part.get_shape()), part.get_dtype())
    return stored


def names_shown(names: Sequence[str]) -> str:
    """The first names of a list, and how many more there are."""
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return f"{shown}, ... ({more} more)" if more > 0 else shown


def block_size_of(config: dict[str, Any], path: Path) -> tuple[int, int]:
    """fp8 block shape of `path` (the config.json, whose dict is `config`): its
    `quantization_config`'s, else 128 x 128; other quantization schemes are refused."""
    try:
        return weight_block_size(config) or DEFAULT_BLOCK_SIZE
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json")
    return read_json_object(path)


class Checkpoint:
    """The tensors of a checkpoint directory (`stored`: name -> header entry, fp8 scales
    included; `scales`: those scales), read by slice while `opened`.

    Opening checks the files (present, headers complete, every scale paired with a
    weight); `check` checks a tensor against the shape a model expects and its fp8
    scales, from the headers alone, so that a faulty checkpoint is refused before the
    model's memory is allocated.
    """

    def __init__(self, directory: Path, block_size: Sequence[int] | None = None) -> None:
        if block_size is None:
            block_size = block_size_of(read_config(directory), directory / "config.json")
        self.block_size = tuple(block_size)
        self.stored = _stored_tensors(directory)
        self.scales = {n: s for n, s in self.stored.items() if n.endswith(SCALE_SUFFIX)}
        for scale_name, scale in self.scales.items():
            if scale_name.removesuffix(SCALE_SUFFIX) not in self.stored:
                raise ValueError(
                    f"{scale.file}: {scale_name} has no weight "
                    f"{scale_name.removesuffix(SCALE_SUFFIX)}"
                )
        self.bytes_read = 0
        self._stack: ExitStack | None = None
        self._handles: dict[Path, Any] = {}

    def check(self, name: str, shape: Sequence[int] | None = None) -> None:
        """ValueError naming the file unless `name` has `shape` (when given) and is fp8
        exactly when it has a scale of the right shape."""
        stored = self.stored[name]
        file = stored.file
        if shape is not None and stored.shape != tuple(shape):
            raise ValueError(
                f"{file}: weight {name!r} has shape {list(stored.shape)}, expected {list(shape)}"
            )
        scale = self.scales.get(name + SCALE_SUFFIX)
        fp8 = stored.dtype in _FP8_NAMES
        if scale is None:
            if fp8:
                raise ValueError(f"{file}: {name} is {stored.dtype} but has no "
                                 f"{name}{SCALE_SUFFIX}")
            return
        if not fp8:
            raise ValueError(f"{file}: {name} has {name}{SCALE_SUFFIX} but dtype {stored.dtype}")
        grid = scale_grid(stored.shape, self.block_size) if len(stored.shape) == 2 else None
        if scale.shape != grid:
            bo, bi = self.block_size
            raise ValueError(
                f"{file}: {name}: weight_scale_inv for a {'x'.join(map(str, stored.shape))} "
                f"weight with {bo}x{bi} blocks must have shape {grid}, got {scale.shape}"
            )

    @contextmanager
    def opened(self) -> Iterator[Checkpoint]:
        """Keep the shards opened by `read` open (memory mapped) until the block ends."""
        with ExitStack() as stack:
            self._stack = stack
            try:
                yield self
            finally:
                self._stack = None
                self._handles.clear()

    def _handle(self, file: Path) -> Any:
        if file not in self._handles:
            assert self._stack is not None, "Checkpoint.read needs Checkpoint.opened"
            self._handles[file] = self._stack.enter_context(_open_shard(file))
        return self._handles[file]

    def read(
        self, name: str, index: tuple[slice, ...] | None, dtype: torch.dtype
    ) -> torch.Tensor:
        """tensor[index] (all of it for None): as stored, but for an fp8 weight with
        scales read as `dtype` other than fp8, dequantized to `dtype`; its bytes, and
        those of the scales read with it, count in bytes_read."""
        stored = self.stored[name]
        if index is None:
            index = tuple(slice(0, n) for n in stored.shape)
        part = self._handle(stored.file).get_slice(name)[index]
        self.bytes_read += part.numel() * part.element_size()
        scale_name = name + SCALE_SUFFIX
        if scale_name not in self.scales or dtype == FP8_WEIGHT_DTYPE:
            return part
        rows, cols = index
        (bo, bi), origin = self.block_size, (rows.start, cols.start)
        blocks = (slice(rows.start // bo, -(-rows.stop // bo)),
                  slice(cols.start // bi, -(-cols.stop // bi)))
        scales = self._handle(self.scales[scale_name].file).get_slice(scale_name)[blocks]
        self.bytes_read += scales.numel() * scales.element_size()
        return dequantize_blocks(part, scales, self.block_size, dtype, origin)


def iter_checkpoint_tensors(
    directory: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    block_size: Sequence[int] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of a checkpoint directory, one shard at a time.

    fp8 weights with a `_scale_inv` companion (found in any shard) are dequantized
    to `dtype`; other tensors come as stored. `block_size` defaults to config.json's
    `quantization_config.weight_block_size`, else 128x128. Names for which `keep`
    returns False are neither read nor yielded. The directory is checked (files
    present, shard headers complete, every scale paired with a weight of its dtype and
    shape) before this returns, not on first use.
    """
    checkpoint = Checkpoint(Path(directory), block_size)
    names = [n for n in checkpoint.stored
             if n not in checkpoint.scales and (keep is None or keep(n))]
    for name in names:
        checkpoint.check(name)
    names.sort(key=lambda n: checkpoint.stored[n].file)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        with checkpoint.opened():
            for name in names:
                yield name, checkpoint.read(name, None, dtype)

    return stream()
