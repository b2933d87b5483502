"""What an engine holds in device memory: the start-up report, and the check that a
model fits before anything is allocated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedmla.cache import LatentKVCache
from pagedmla.dims import MLADims
from pagedmla.models.config import DeepseekConfig
from pagedmla.ops.reference_indexer import (
    SCALE_BYTES,
    allocate_indexer_cache,
    check_power_of_two,
)

GIB = 2**30


@dataclass(frozen=True)
class MemoryReport:
    """One rank's memory at start-up.

    weight_bytes: its weights, the tensors process_weights_after_loading derives
    included (under tensor parallelism: its shard); kv_cache_bytes: its caches, all
    layers; kv_cache_tokens: the tokens of context the engine's cache holds (its usable
    blocks times the scheduler's block size: under decode context parallelism a group's
    capacity); load_seconds: planning and loading the weights; checkpoint_bytes_read:
    the bytes of the checkpoint slices it read (0 for the built-in tiny model);
    kv_cache_format: the cache's entry format and bytes per token and layer
    (`cache.describe_cache_format`).
    """

    rank: int
    weight_bytes: int
    kv_cache_bytes: int
    kv_cache_tokens: int
    load_seconds: float
    checkpoint_bytes_read: int
    kv_cache_format: str = ""

    @property
    def weight_gib(self) -> float:
        return self.weight_bytes / GIB

    @property
    def kv_cache_gib(self) -> float:
        return self.kv_cache_bytes / GIB

    def __str__(self) -> str:
        cache_format = f"; {self.kv_cache_format}" if self.kv_cache_format else ""
        return (f"rank {self.rank}: weights {self.weight_gib:.3f} GiB, KV cache "
                f"{self.kv_cache_gib:.3f} GiB ({self.kv_cache_tokens} tokens{cache_format}), "
                "weights "
                f"loaded in {self.load_seconds:.1f} s "
                f"({self.checkpoint_bytes_read / GIB:.3f} GiB of checkpoint read)")


def workspace_bytes(dims: MLADims, rows: int, dtype: torch.dtype) -> int:
    """The chunked-context path's peak: `rows` gathered latent rows and their
    up-projection (keys and values, and the queries) at once."""
    per_row = (dims.cache_width + dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim)
               + dims.num_heads * dims.qk_head_dim)
    return rows * per_row * dtype.itemsize


def cache_block_bytes(
    dims: MLADims, block_size: int, cache_dtype: torch.dtype, num_layers: int
) -> int:
    """The bytes of one block of the latent cache, over all layers."""
    per_token = LatentKVCache.bytes_per_token(dims.kv_lora_rank, dims.qk_rope_head_dim,
                                              cache_dtype)
    return per_token * block_size * num_layers


def index_key_block_bytes(
    config: DeepseekConfig, block_size: int, dtype: torch.dtype, fp8: bool
) -> int:
    """The bytes of one block of a sparse-attention model's indexer key caches, over the
    layers that have an indexer (0 for dense MLA): D values of `dtype` per token, or D
    fp8 codes and a float32 scale."""
    index = config.indexer
    if index is None:
        return 0
    if fp8:  # before anything is allocated: the Hadamard rotation needs a power of two
        check_power_of_two(index.head_dim)
    per_token = index.head_dim + SCALE_BYTES if fp8 else index.head_dim * dtype.itemsize
    layers = sum(index.has_indexer(i) for i in range(config.num_hidden_layers))
    return per_token * block_size * layers


def attach_index_keys(
    caches: list[LatentKVCache], config: DeepseekConfig, dtype: torch.dtype, fp8: bool
) -> None:
    """Give each layer with an indexer its key cache, paged like the layer's latents."""
    index = config.indexer
    for layer, cache in enumerate(caches):
        if index is not None and index.has_indexer(layer):
            cache.index_keys = allocate_indexer_cache(
                cache.num_blocks, cache.block_size, index.head_dim, dtype, fp8, cache.device)


def check_fits(
    device: torch.device,
    free: int,
    total: int,
    utilization: float,
    weights: int,
    workspace: int,
    cache: int,
    cache_blocks: int,
) -> None:
    """ValueError saying how much memory is missing when the weights, the workspace and
    `cache_blocks` cache blocks (`cache` bytes) need more than gpu_memory_utilization
    leaves of the device's `free` bytes (of `total`)."""
    available = free - (1.0 - utilization) * total
    need = weights + workspace + cache
    if need <= available:
        return
    raise ValueError(
        f"the model does not fit on {device}: its weights {weights / GIB:.2f} GiB + the "
        f"workspace {workspace / GIB:.2f} GiB + a KV cache of {cache_blocks} blocks "
        f"{cache / GIB:.2f} GiB need {need / GIB:.2f} GiB; gpu_memory_utilization "
        f"{utilization} of {total / GIB:.2f} GiB, {free / GIB:.2f} GiB free, leaves "
        f"{max(available, 0) / GIB:.2f} GiB: {(need - available) / GIB:.2f} GiB missing "
        "(shard the model over more GPUs with tensor_parallel_size, or raise "
        "gpu_memory_utilization)"
    )
