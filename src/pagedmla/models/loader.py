"""Hugging Face checkpoint directories -> DeepseekForCausalLM, config and tokenizer.

A directory holds config.json and either `model.safetensors`, shards listed by
`model.safetensors.index.json`, or loose `*.safetensors` files. Tensors stream one
shard at a time. DeepSeek's fp8 block-quantized weights (`X.weight` in float8_e4m3fn
with a float32 `X.weight_scale_inv`, one scale per 128x128 block) are dequantized
here, so the model only ever sees plain weights and never a `*_scale_inv` tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM
from pagedmla.models.tiny import tiny_config, tiny_weights
from pagedmla.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer

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


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Map every tensor name of the checkpoint to the file that holds it."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text())["weight_map"]
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard files not present: {missing}")
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {directory}")
    names: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:  # reads the header only
            names.update(dict.fromkeys(f.keys(), file))
    return names


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
    present, every scale paired with a weight) before this returns, not on first use.
    """
    directory = Path(directory)
    if block_size is None:
        block_size = _block_size(_read_config(directory))
    files = _tensor_files(directory)
    for scale_name in (n for n in files if n.endswith(SCALE_SUFFIX)):
        if scale_name.removesuffix(SCALE_SUFFIX) not in files:
            raise ValueError(f"{scale_name} has no weight {scale_name.removesuffix(SCALE_SUFFIX)}")
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        if not name.endswith(SCALE_SUFFIX) and (keep is None or keep(name)):
            by_file.setdefault(file, []).append(name)
    return _stream(by_file, files, tuple(block_size), dtype)


def _stream(
    by_file: dict[Path, list[str]],
    files: dict[str, Path],
    block_size: tuple[int, int],
    dtype: torch.dtype,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read the names of `by_file` shard by shard, dequantizing fp8 weights."""
    for file in tqdm(sorted(by_file), desc="Loading checkpoint shards", unit="shard"):
        with safe_open(str(file), framework="pt") as f:
            for name in by_file[file]:
                tensor = f.get_tensor(name)
                scale_name = name + SCALE_SUFFIX
                if scale_name in files:
                    if tensor.dtype not in FP8_DTYPES:
                        raise ValueError(f"{name} has {scale_name} but dtype {tensor.dtype}")
                    if files[scale_name] == file:
                        scale_inv = f.get_tensor(scale_name)
                    else:
                        with safe_open(str(files[scale_name]), framework="pt") as g:
                            scale_inv = g.get_tensor(scale_name)
                    tensor = dequantize_fp8_blocks(tensor, scale_inv, block_size, dtype)
                elif tensor.dtype in FP8_DTYPES:
                    raise ValueError(f"{name} is {tensor.dtype} but has no {scale_name}")
                yield name, tensor


def _read_config(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint directory {directory} has no config.json")
    return json.loads(path.read_text())


def _block_size(config: dict[str, Any]) -> tuple[int, int]:
    """fp8 block shape from `quantization_config`; other quantization schemes are refused."""
    quant = config.get("quantization_config")
    if quant is None:
        return DEFAULT_BLOCK_SIZE
    if quant.get("quant_method") != "fp8":
        raise ValueError(
            f"unsupported quantization_config.quant_method {quant.get('quant_method')!r}; "
            "only DeepSeek's block fp8 ('fp8') is supported"
        )
    bo, bi = quant.get("weight_block_size", DEFAULT_BLOCK_SIZE)
    return int(bo), int(bi)


def _is_model_layer(config: dict[str, Any]) -> Callable[[str], bool]:
    """False for layers past num_hidden_layers: DeepSeek-V3's multi-token-prediction
    layers, which next-token inference does not use (so they are not even read)."""
    num_layers = config["num_hidden_layers"]

    def keep(name: str) -> bool:
        match = _LAYER_INDEX.match(name)
        return match is None or int(match.group(1)) < num_layers

    return keep


def _load_weights(
    model: DeepseekForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], source: str
) -> None:
    """Feed `weights` to the model and require every tensor it expects."""
    provided = model.load_weights(weights)
    missing = sorted(model.expected_weight_names() - set(provided))
    if missing:
        shown = ", ".join(missing[:_MAX_NAMES_SHOWN])
        more = (
            f", ... ({len(missing) - _MAX_NAMES_SHOWN} more)"
            if len(missing) > _MAX_NAMES_SHOWN
            else ""
        )
        raise ValueError(f"{source} lacks {len(missing)} tensor(s) the model needs: {shown}{more}")
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
        raise ValueError(f"{model}: {err}") from err


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
    if is_tiny:
        weights: Iterable[tuple[str, torch.Tensor]] = tiny_weights(config_dict)
        tokenizer: TextTokenizer | None = ByteTokenizer()
    else:
        weights = iter_checkpoint_tensors(directory, dtype=dtype, keep=_is_model_layer(config_dict))
        tokenizer = load_tokenizer(directory, config_dict)
    net = DeepseekForCausalLM(config, dtype=dtype, device=device, backend=backend)
    _load_weights(net, weights, "the built-in tiny model" if is_tiny else str(model))
    return net, config, tokenizer
