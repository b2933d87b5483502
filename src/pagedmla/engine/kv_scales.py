"""An fp8 cache's per-layer scales at start-up (`EngineArgs.kv_cache_scale`).

An fp8 cache stores x / scale, and e4m3 holds |x / scale| <= 448: with scale 1.0 a model
whose latents exceed 448 saturates them. The scales come from, in `auto`'s order:

- the checkpoint, where it ships them (`models.kv_scales`: `self_attn.k_scale` or
  `kv_scale` per layer);
- calibration: one prefill of CALIBRATION_TOKENS random token ids (seeded, the same on
  every rank) through the model, each layer's cache tracking the largest |value| it is
  given (`LatentKVCache.track`); its scale is then HEADROOM x that amax / 448 rounded to
  the nearest power of two (a headroom of 1.4x to 2.8x): x / scale is exact, and the
  same where amax differs in its last bits (another reduction order). A larger scale
  would cost k_pe, which shares it and is often much smaller than the latent, its
  precision (e4m3's subnormals). It costs one forward of those
  tokens at start-up, before the graphs are captured (under tensor parallelism every rank
  runs it in step, as it captures graphs, and the ranks agree on the largest values).
- one number given for every layer.

Random tokens stand in for text: the latents are RMS-normalised before the cache, so their
magnitude is set mostly by the norm's weights, while k_pe's follows the hidden states.
Where real text reaches larger values, `LatentKVCache.clipped` counts what saturates.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedmla.cache import FP8_DTYPE, LatentKVCache
from pagedmla.metadata import BatchSpec
from pagedmla.models.kv_scales import read_kv_scales

if TYPE_CHECKING:
    from pagedmla.distributed.state import ParallelState
    from pagedmla.engine.block_manager import BlockManager
    from pagedmla.engine.model_runner import ModelRunner
    from pagedmla.models.checkpoint import Checkpoint

CALIBRATION_TOKENS = 1024
HEADROOM = 2.0


def set_kv_cache_scales(caches: list[LatentKVCache], choice: str | float,
                        checkpoint: Checkpoint | None,
                        calibration: Callable[[], list[float]]) -> str:
    """Set the scale of each layer's fp8 cache from `choice` (auto, calibrate or a number;
    `calibration` runs `calibrate`); returns where they came from, for the start-up log."""
    scales = None
    if isinstance(choice, float):
        scales, source = [choice] * len(caches), f"{choice:g} for every layer"
    elif choice == "auto" and checkpoint is not None:
        scales, source = read_kv_scales(checkpoint, len(caches)), "the checkpoint's"
    if scales is None:
        scales = calibration()
        source = f"calibrated on {CALIBRATION_TOKENS} random tokens, headroom {HEADROOM:g}x"
    for cache, scale in zip(caches, scales, strict=True):
        cache.scale = scale
    return f"fp8 KV cache scales {min(scales):.3g}-{max(scales):.3g} ({source})"


def calibrate(runner: ModelRunner, caches: list[LatentKVCache], block_manager: BlockManager,
              vocab_size: int, max_tokens: int, ranks: ParallelState | None) -> list[float]:
    """Each layer's scale from one prefill of random tokens through the runner (the module
    docstring), of at most max_tokens tokens (the engine's step budget and max_model_len);
    `ranks`: the tensor parallel group, whose ranks agree on the result."""
    block_size = block_manager.block_size
    tokens = min(CALIBRATION_TOKENS, max_tokens,
                 (block_manager.num_usable_blocks - 1) * block_size)
    gen = torch.Generator().manual_seed(0)
    token_ids = torch.randint(vocab_size, (tokens,), generator=gen)
    positions = torch.arange(tokens)
    blocks = -(-tokens // block_size)
    # Blocks 1.. (block 0 is the null block); nothing is cached yet, so they are free.
    spec = BatchSpec(query_lens=[tokens], seq_lens=[tokens],
                     block_table=torch.arange(1, blocks + 1, dtype=torch.int32)[None],
                     slot_mapping=positions + block_size)
    for cache in caches:
        cache.track()
    runner.execute(token_ids, positions, spec, [tokens - 1])
    amax = [cache.amax for cache in caches]
    for cache in caches:
        cache.untrack()
    if ranks is not None:
        # Under decode context parallelism each rank holds other tokens' latents: every
        # rank takes the largest of all (NaN if any rank saw one).
        gathered = ranks.gather_objects(amax)
        amax = [math.nan if any(math.isnan(v) for v in layer) else max(layer)
                for layer in zip(*gathered, strict=True)]
    limit = torch.finfo(FP8_DTYPE).max
    for layer, value in enumerate(amax):
        if not 0 < value < math.inf:  # NaN or inf, or a layer that wrote only zeros
            raise ValueError(f"kv_cache_scale: calibration found layer {layer}'s latents "
                             f"{value} (need finite values, not all 0): give a number")
    return [2.0 ** round(math.log2(HEADROOM * value / limit)) for value in amax]
