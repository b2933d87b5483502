"""Hugging Face checkpoint directories -> DeepseekForCausalLM, config and tokenizer.

A directory holds config.json and either `model.safetensors`, shards listed by
`model.safetensors.index.json`, or loose `*.safetensors` files. Tensors stream one
shard at a time. DeepSeek's fp8 block-quantized weights (`X.weight` in float8_e4m3fn
with a float32 `X.weight_scale_inv`, one scale per 128x128 block) are dequantized
here, so the model only ever sees plain weights and never a `*_scale_inv` tensor.

A faulty checkpoint is a ValueError naming the file: JSON that does not parse, a
config.json key missing or of the wrong type (named too), a shard that is truncated or
lacks a tensor its index lists, and a tensor that does not fit the model or holds NaN
or inf (`DeepseekForCausalLM.load_weights` checks each weight as it is copied).
Shard headers are read before the model's memory is allocated.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM
from pagedmla.models.tiny import tiny_config, tiny_weights
from pagedmla.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer
from pagedmla.validation import read_json_object

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK_SIZE = (128, 128)
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_NAMES_SHOWN = 10


def dequantize_fp8_blocks(
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """weight.float() * scale_inv, each scale covering one block_size block of `weight`.

    weight [out, in] (fp8); scale_inv [ceil(out/bo), ceil(in/bi)]; blocks at the
    bottom and right edges may be partial. The product is formed in float32, then
    cast to `dtype`.
    """
    rows, cols = weight.shape
    bo, bi = block_size
    grid = (math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(
            f"weight_scale_inv for a {rows}x{cols} weight with {bo}x{bi} blocks must have "
            f"shape {grid}, got {tuple(scale_inv.shape)}"
        )
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:rows]
    scale = scale.repeat_interleave(bi, dim=1)[:, :cols]
    return (weight.float() * scale).to(dtype)


@contextmanager
def _open_shard(file: Path) -> Iterator[Any]:
    """safe_open(file), its errors (a truncated or corrupt file) as ValueErrors naming it."""
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except SafetensorError as err:
        raise ValueError(f"{file} is not a complete safetensors file: {err}") from err


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the file that holds it.

    Every shard's header is read, so a truncated shard or one that lacks a tensor its
    index lists is found here.
    """
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = read_json_object(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ValueError(f"{index_path}: 'weight_map' must map tensor names to file names")
        listed: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            listed.setdefault(file, set()).add(name)
        missing = sorted(f for f in listed if not (directory / f).is_file())
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard files not present: {missing}")
        for file in sorted(listed):
            with _open_shard(directory / file) as f:
                absent = sorted(listed[file] - set(f.keys()))
            if absent:
                raise ValueError(
                    f"{directory / file} lacks {len(absent)} tensor(s) that {index_path.name} "
                    f"lists: {_names(absent)}"
                )
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {directory}")
    names: dict[str, Path] = {}
    for file in files:
        with _open_shard(file) as f:  # reads the header only
            names.update(dict.fromkeys(f.keys(), file))
    return names


def _names(names: Sequence[str]) -> str:
    """The first names of a list, and how many more there are."""
    shown = ", ".join(names[:_MAX_NAMES_SHOWN])
    more = len(names) - _MAX_NAMES_SHOWN
    return f"{shown}, ... ({more} more)" if more > 0 else shown


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
    present, shard headers complete, every scale paired with a weight) before this
    returns, not on first use.
    """
    return _checkpoint_tensors(Path(directory), dtype, block_size, keep)[1]


def _checkpoint_tensors(
    directory: Path,
    dtype: torch.dtype,
    block_size: Sequence[int] | None,
    keep: Callable[[str], bool] | None,
) -> tuple[dict[str, Path], Iterator[tuple[str, torch.Tensor]]]:
    """iter_checkpoint_tensors' stream, with the file of every tensor name."""
    if block_size is None:
        block_size = _block_size(_read_config(directory), directory / "config.json")
    files = _tensor_files(directory)
    for scale_name in (n for n in files if n.endswith(SCALE_SUFFIX)):
        if scale_name.removesuffix(SCALE_SUFFIX) not in files:
            raise ValueError(
                f"{files[scale_name]}: {scale_name} has no weight "
                f"{scale_name.removesuffix(SCALE_SUFFIX)}"
            )
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if not name.endswith(SCALE_SUFFIX) and (keep is None or keep(name)):
            by_file.setdefault(file, []).append(name)
    return files, _stream(by_file, files, tuple(block_size), dtype)


def _stream(
    by_file: dict[Path, list[str]],
    files: dict[str, Path],
    block_size: tuple[int, int],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the names of `by_file` shard by shard, dequantizing fp8 weights."""
    for file in tqdm(sorted(by_file), desc="Loading checkpoint shards", unit="shard"):
        with _open_shard(file) as f:
            for name in by_file[file]:
                tensor = f.get_tensor(name)
                scale_name = name + SCALE_SUFFIX
                if scale_name in files:
                    if tensor.dtype not in FP8_DTYPES:
                        raise ValueError(
                            f"{file}: {name} has {scale_name} but dtype {tensor.dtype}"
                        )
                    if files[scale_name] == file:
                        scale_inv = f.get_tensor(scale_name)
                    else:
                        with _open_shard(files[scale_name]) as g:
                            scale_inv = g.get_tensor(scale_name)
                    try:
                        tensor = dequantize_fp8_blocks(tensor, scale_inv, block_size, dtype)
                    except ValueError as err:
                        raise ValueError(f"{file}: {name}: {err}") from err
                elif tensor.dtype in FP8_DTYPES:
                    raise ValueError(f"{file}: {name} is {tensor.dtype} but has no {scale_name}")
                yield name, tensor


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json")
    return read_json_object(path)


def _block_size(config: dict[str, Any], path: Path) -> tuple[int, int]:
    """fp8 block shape from `quantization_config` of `path` (the config.json); other
    quantization schemes are refused."""
    quant = config.get("quantization_config")
    if quant is None:
        return DEFAULT_BLOCK_SIZE
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise ValueError(
            f"{path}: unsupported quantization_config.quant_method {method!r}; "
            "only DeepSeek's block fp8 ('fp8') is supported"
        )
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK_SIZE))
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(
            f"{path}: 'quantization_config.weight_block_size' must be two positive integers, "
            f"got {block!r}"
        )
    return block[0], block[1]


def _is_model_layer(config: dict[str, Any]) -> Callable[[str], bool]:
    """False for layers past num_hidden_layers: DeepSeek-V3's multi-token-prediction
    layers, which next-token inference does not use (so they are not even read)."""
    num_layers = config["num_hidden_layers"]

    def keep(name: str) -> bool:
        match = _LAYER_INDEX.match(name)
        return match is None or int(match.group(1)) < num_layers

    return keep


def _load_weights(
    model: DeepseekForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    source: str,
    files: dict[str, Path] | None = None,
) -> None:
    """Feed `weights` to the model and require every tensor it expects.

    A tensor the model refuses (shape, NaN or inf) is named with its file from `files`.
    """
    copying: list[str] = []  # the name the model holds while it copies that tensor

    def tracked() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            copying.append(name)
            yield name, tensor
            copying.pop()

    try:
        provided = model.load_weights(tracked())
    except ValueError as err:
        if copying and files is not None and copying[-1] in files:
            raise ValueError(f"{files[copying[-1]]}: {err}") from err
        raise
    missing = sorted(model.expected_weight_names() - set(provided))
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} tensor(s) the model needs: {_names(missing)}"
        )
    model.process_weights_after_loading()


def _config_dict(model: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of "tiny" or of a checkpoint directory, as a plain dict."""
    if str(model) == "tiny":
        return tiny_config()
    directory = Path(model)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model must be 'tiny' or a checkpoint directory; {str(model)!r} is neither"
        )
    return _read_config(directory)


def _parse_config(model: str | os.PathLike[str], config_dict: dict[str, Any]) -> DeepseekConfig:
    try:
        return DeepseekConfig.from_dict(config_dict)
    except ValueError as err:
        where = "tiny" if str(model) == "tiny" else Path(model) / "config.json"
        raise ValueError(f"{where}: {err}") from err


def load_config(model: str | os.PathLike[str]) -> DeepseekConfig:
    """The config of "tiny" or of a checkpoint directory, without reading any weight."""
    return _parse_config(model, _config_dict(model))


def load_model(
    model: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> tuple[DeepseekForCausalLM, DeepseekConfig, TextTokenizer | None]:
    """Build and load a model: "tiny" (built in) or a Hugging Face checkpoint directory.

    Returns the model, its config and its tokenizer (None when the directory has no
    tokenizer.json; then only token-id prompts can be used).
    """
    is_tiny = str(model) == "tiny"
    directory = Path(model)
    config_dict = _config_dict(model)
    # Architecture and files are checked before the model's memory is allocated.
    config = _parse_config(model, config_dict)
    files: dict[str, Path] | None = None
    if is_tiny:
        weights: Iterable[tuple[str, torch.Tensor]] = tiny_weights(config_dict)
        tokenizer: TextTokenizer | None = ByteTokenizer()
    else:
        files, weights = _checkpoint_tensors(directory, dtype, None, _is_model_layer(config_dict))
        tokenizer = load_tokenizer(directory, config_dict)
    net = DeepseekForCausalLM(config, dtype=dtype, device=device, backend=backend)
    _load_weights(net, weights, "the built-in tiny model" if is_tiny else str(model), files)
    return net, config, tokenizer
