"""Plan, then load, a model: "tiny" (built in) or a Hugging Face checkpoint directory.

`plan_model` reads config.json, the tokenizer and the shards' headers
(`models/checkpoint.py`) and builds the model on the `meta` device, where nothing is
allocated. Under tensor parallelism a `Sharder` (the distributed layer's `parallelize`)
turns that model into the rank's and says which part of each tensor the rank keeps
(`RankShards`). The plan then knows every tensor the rank will hold: its shape and
dtype, and the checkpoint tensors and slices that fill it, hence the bytes the rank's
weights take (`ModelPlan.weight_bytes`), all before anything is allocated.
`load_planned` allocates the rank's tensors on the device, reads only their slices from
the shards, shard by shard, and derives what `process_weights_after_loading` derives.
A rank never holds a tensor of the whole model. "tiny" is the trained tiny checkpoint
the package ships (`models/tiny.py`), read as any checkpoint directory but with the byte
tokenizer; without it, the random tiny model, made in memory: loaded whole with
`load_weights`, then sharded.

A faulty checkpoint is a ValueError naming the file: JSON that does not parse, a
config.json key missing or of the wrong type (named too), a shard that is truncated or
lacks a tensor its index lists, a tensor the model lacks, does not have or that has
another shape (all found from the headers, before the model's memory is allocated), and
a weight that holds NaN or inf in the dtype the model holds it in (checked on the
device as it is copied: an fp8 weight kept in fp8 as stored, one dequantized once
dequantized).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from pagedmla.models.checkpoint import (
    SCALE_SUFFIX,
    Checkpoint,
    block_size_of,
    iter_checkpoint_tensors,
    names_shown,
    read_config,
)
from pagedmla.models.config import DeepseekConfig
from pagedmla.models.deepseek import DeepseekForCausalLM, ignored_weight, weight_index
from pagedmla.models.kv_scales import is_kv_scale
from pagedmla.models.shards import Alternatives, Index, Piece, RankShards, Shard
from pagedmla.models.tiny import tiny_config, tiny_weights, trained_tiny_dir
from pagedmla.ops.block_fp8 import all_finite
from pagedmla.tokenizer import ByteTokenizer, TextTokenizer, load_tokenizer

__all__ = [
    "ModelPlan",
    "Sharder",
    "TensorSource",
    "iter_checkpoint_tensors",
    "load_config",
    "load_model",
    "load_planned",
    "plan_model",
]

logger = logging.getLogger(__name__)

# The whole model (on the meta device) -> this rank's module and how it holds the
# model's tensors (`pagedmla.distributed.tensor_parallel.shard_for`); a rank may hold a
# block-fp8 tensor's part dequantized, in the model dtype.
Sharder = Callable[[DeepseekForCausalLM], tuple[nn.Module, RankShards]]


@dataclass(frozen=True)
class TensorSource:
    """One of a rank's tensors: its shape and dtype, its part of the model tensor (None:
    whole; `pads`: reaching past the end, zeros there) and the checkpoint tensors that
    fill the model tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    shard: Shard | None
    pieces: tuple[Piece, ...]
    pads: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class ModelPlan:
    """Everything about a rank's model but its weights' values.

    module: the rank's model on the meta device (`load_planned` fills it in place, so a
    plan loads once); sources: the model tensors the rank holds, by the whole model's
    state_dict key; targets: the rank module's state_dict key -> that key;
    derived_bytes: what process_weights_after_loading adds (W_UK, W_UV); checkpoint:
    None for the random tiny model.
    """

    model: str
    config: DeepseekConfig
    config_dict: dict[str, Any]
    tokenizer: TextTokenizer | None
    dtype: torch.dtype
    backend: str
    module: nn.Module
    sources: dict[str, TensorSource]
    targets: dict[str, str]
    derived_bytes: int
    shard: Sharder | None
    checkpoint: Checkpoint | None

    @property
    def weight_bytes(self) -> int:
        """The bytes of the rank's weights once loaded, derived ones included."""
        return sum(s.nbytes for s in self.sources.values()) + self.derived_bytes


def checkpoint_dir(model: str | os.PathLike[str]) -> Path | None:
    """The checkpoint directory `model` names: "tiny" is the trained tiny model's, or
    None (the random tiny model) when the package holds no trained weights."""
    if str(model) == "tiny":
        return trained_tiny_dir()
    directory = Path(model)
    if not directory.is_dir():
        raise FileNotFoundError(
            f"model must be 'tiny' or a checkpoint directory; {str(model)!r} is neither"
        )
    return directory


def _config_dict(model: str | os.PathLike[str]) -> dict[str, Any]:
    """config.json of "tiny" or of a checkpoint directory, as a plain dict."""
    directory = checkpoint_dir(model)
    return tiny_config() if directory is None else read_config(directory)


def _parse_config(model: str | os.PathLike[str], config_dict: dict[str, Any]) -> DeepseekConfig:
    try:
        return DeepseekConfig.from_dict(config_dict)
    except ValueError as err:
        where = "tiny" if str(model) == "tiny" else Path(model) / "config.json"
        raise ValueError(f"{where}: {err}") from err


def load_config(model: str | os.PathLike[str]) -> DeepseekConfig:
    """The config of "tiny" or of a checkpoint directory, without reading any weight."""
    return _parse_config(model, _config_dict(model))


def _decoder(module: nn.Module) -> DeepseekForCausalLM:
    """The DeepseekForCausalLM that owns a (maybe sharded) model's layers."""
    decoder = module.decoder
    assert isinstance(decoder, DeepseekForCausalLM)
    return decoder


def plan_model(
    model: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    shard: Sharder | None = None,
    keep_fp8: bool = True,
) -> ModelPlan:
    """The plan of loading `model` ("tiny" or a checkpoint directory) in `dtype`, sharded
    by `shard` (None: whole); a block-fp8 checkpoint's weights kept in fp8, or with
    `keep_fp8` False dequantized to `dtype` as they are read. Reads config.json, the
    tokenizer and the shards' headers; allocates nothing."""
    directory = checkpoint_dir(model)
    if directory is None:
        logger.warning("the package holds no trained tiny model (models/tiny_trained): "
                       "'tiny' is the random one, whose text is noise")
    config_dict = tiny_config() if directory is None else read_config(directory)
    config = _parse_config(model, config_dict)
    if not keep_fp8:
        config = replace(config, weight_block_size=None)
    checkpoint = None
    tokenizer: TextTokenizer | None = ByteTokenizer()
    if directory is not None:
        checkpoint = Checkpoint(directory, block_size_of(config_dict, directory / "config.json"))
        if str(model) != "tiny":
            tokenizer = load_tokenizer(directory, config_dict)
    whole = DeepseekForCausalLM(config, dtype, "meta", backend)
    full = {key: tuple(t.shape) for key, t in whole.state_dict().items()}
    alternatives = whole.checkpoint_sources()
    if checkpoint is None:
        pieces = {key: alts[0] for key, alts in alternatives.items()}
    else:
        pieces = _chosen_pieces(str(directory), checkpoint, alternatives,
                                config.num_hidden_layers)
    module, rank = (whole, RankShards({}, {k: k for k in full})) if shard is None else shard(whole)
    decoder = _decoder(module)
    decoder.process_weights_after_loading()  # on meta: the derived tensors' shapes
    sources: dict[str, TensorSource] = {}
    rank_tensors = module.state_dict()
    for rank_key, key in rank.full_keys.items():
        shape = full[key]
        part = rank.shards.get(key)
        local = shape if part is None else part.shape(shape)
        held = rank_tensors[rank_key]  # its dtype may not be the whole model's: see Sharder
        assert tuple(held.shape) == local, (rank_key, local)
        pads = part is not None and part.pads(shape)
        sources[key] = TensorSource(local, held.dtype, part, pieces[key], pads)
    derived = sum(t.numel() * t.element_size() for t in decoder.derived_weights())
    return ModelPlan(str(model), config, config_dict, tokenizer, dtype, backend, module,
                     sources, dict(rank.full_keys), derived, shard, checkpoint)


def _chosen_pieces(
    source: str, checkpoint: Checkpoint, alternatives: dict[str, Alternatives], num_layers: int
) -> dict[str, tuple[Piece, ...]]:
    """For each model tensor, the first alternative the checkpoint holds; ValueErrors for
    tensors it lacks, tensors the model does not have, and shapes or fp8 scales that do
    not fit (`Checkpoint.check`). KV cache scales are the engine's (`models.kv_scales`)."""
    stored = checkpoint.stored
    chosen: dict[str, tuple[Piece, ...]] = {}
    missing: list[str] = []
    for key, alts in alternatives.items():
        found = next((alt for alt in alts if all(p.name in stored for p in alt)), None)
        if found is None:
            missing += [p.name for p in alts[0] if p.name not in stored]
        else:
            chosen[key] = found
    if missing:
        raise ValueError(
            f"{source} lacks {len(missing)} tensor(s) the model needs: "
            f"{names_shown(sorted(missing))}"
        )
    known = weight_index(alternatives)
    for name, entry in stored.items():
        # A scale the model holds no tensor for is read with its weight, dequantized.
        weight = name.removesuffix(SCALE_SUFFIX) if name in checkpoint.scales else name
        if weight not in known and not ignored_weight(name, num_layers) and not is_kv_scale(name):
            raise ValueError(
                f"{entry.file}: unknown weight {name!r}: the model has no tensor of that name"
            )
    for alt in chosen.values():
        for piece in alt:
            checkpoint.check(piece.name, piece.shape)
    return chosen


def _install(root: nn.Module, key: str, tensor: torch.Tensor) -> None:
    """Make `tensor` the parameter or buffer `key` of `root`."""
    owner_name, _, name = key.rpartition(".")
    owner = root.get_submodule(owner_name)
    if isinstance(getattr(owner, name), nn.Parameter):
        tensor = nn.Parameter(tensor, requires_grad=False)
    setattr(owner, name, tensor)


@torch.no_grad()
def load_planned(plan: ModelPlan, device: str | torch.device = "cpu") -> nn.Module:
    """The plan's module with its weights on `device`; for a checkpoint, the rank's
    slices read (`plan.checkpoint.bytes_read` counts their bytes)."""
    device = torch.device(device)
    checkpoint = plan.checkpoint
    if checkpoint is None:
        return _load_tiny(plan, device)
    tensors = {
        key: (torch.zeros if s.pads else torch.empty)(s.shape, dtype=s.dtype, device=device)
        for key, s in plan.sources.items()
    }
    for rank_key, key in plan.targets.items():
        _install(plan.module, rank_key, tensors[key])
    reads: dict[Path, list[tuple[str, str, tuple[slice, ...], Index]]] = {}
    for key, source in plan.sources.items():
        for piece in source.pieces:
            placed = piece.placement(source.shard)
            if placed is not None:
                file = checkpoint.stored[piece.name].file
                reads.setdefault(file, []).append((key, piece.name, *placed))
    with checkpoint.opened():
        # The built-in model loads as quietly as the random one (one small shard).
        for file in tqdm(sorted(reads), desc="Loading checkpoint shards", unit="shard",
                         disable=plan.model == "tiny"):
            for key, name, index, dest in reads[file]:
                view = tensors[key][dest]
                view.copy_(checkpoint.read(name, index, view.dtype))
                if not all_finite(view):
                    raise ValueError(
                        f"{file}: weight {name!r} has NaN or inf values (as {view.dtype})"
                    )
    _decoder(plan.module).process_weights_after_loading()
    left = [name for name, t in (*plan.module.named_parameters(), *plan.module.named_buffers())
            if t.is_meta]
    assert not left, f"tensors the plan did not fill: {left}"
    return plan.module


def _load_tiny(plan: ModelPlan, device: torch.device) -> nn.Module:
    """The random tiny model: made whole in memory, then sharded."""
    net = DeepseekForCausalLM(plan.config, plan.dtype, device, plan.backend)
    provided = net.load_weights(tiny_weights(plan.config_dict))
    assert provided == net.expected_weight_names()
    net.process_weights_after_loading()
    if plan.shard is None:
        return net
    module = plan.shard(net)[0]
    if device.type == "cuda":
        torch.cuda.empty_cache()  # return the whole weights' memory before sizing the cache
    return module


def load_model(
    model: str | os.PathLike[str],
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    backend: str = "auto",
) -> tuple[DeepseekForCausalLM, DeepseekConfig, TextTokenizer | None]:
    """Build and load a whole model: "tiny" (built in) or a Hugging Face checkpoint
    directory (`plan_model`, then `load_planned`).

    Returns the model, its config and its tokenizer (None when the directory has no
    tokenizer.json; then only token-id prompts can be used).
    """
    plan = plan_model(model, dtype, backend)
    return _decoder(load_planned(plan, device)), plan.config, plan.tokenizer
