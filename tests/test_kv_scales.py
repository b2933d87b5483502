"""An fp8 cache's per-layer scales (`engine/kv_scales.py`, `models/kv_scales.py`) and its
clipping counters (`LatentKVCache.track`).

The model under test has latents past fp8's range: the random tiny model with each
layer's kv_a_layernorm weight multiplied by 2000 and kv_b_proj divided by 2000, so it
computes the same function (in float32) while the cache is given values in the thousands.
With scale 1.0 an fp8 cache saturates them; with calibrated or shipped scales its
logprobs stay close to a float32 cache's.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedmla import LLM, SamplingParams
from pagedmla.cache import LatentKVCache
from pagedmla.engine.args import EngineArgs
from pagedmla.engine.kv_scales import HEADROOM, calibrate
from pagedmla.models.tiny import tiny_config, write_tiny_checkpoint

GROWTH = 2000.0
OPTIONS = dict(device="cpu", dtype=torch.float32, block_size=16, num_kv_blocks=160,
               max_num_seqs=4, max_num_batched_tokens=64)


def _rewrite(directory: Path, change) -> Path:
    """The checkpoint in `directory` as one model.safetensors, its tensors passed through
    change(dict) first."""
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(shard))
        shard.unlink()
    (directory / "model.safetensors.index.json").unlink(missing_ok=True)
    change(tensors)
    save_file(tensors, directory / "model.safetensors")
    return directory


def _large_latents(tensors: dict[str, torch.Tensor]) -> None:
    for name in list(tensors):
        if name.endswith("kv_a_layernorm.weight"):
            tensors[name] = tensors[name] * GROWTH
        elif name.endswith("kv_b_proj.weight"):
            tensors[name] = tensors[name] / GROWTH


@pytest.fixture(scope="module")
def large(tmp_path_factory) -> Path:
    directory = write_tiny_checkpoint(tmp_path_factory.mktemp("large_latents"))
    return _rewrite(directory, _large_latents)


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (9, 33, 70)]


def _greedy(llm: LLM) -> list[list[int]]:
    """Eight greedy tokens after each prompt: the continuation every engine then scores."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]


def _prefill_logprobs(llm: LLM, tokens: list[list[int]]) -> list[list[float]]:
    """The logprob of each of `tokens` after its prompt, teacher-forced: the prompt
    extended token by token, max_tokens 1, logprobs of the whole vocabulary."""
    vocab = llm.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab, ignore_eos=True)
    result = []
    for prompt, continuation in zip(_prompts(), tokens, strict=True):
        row = []
        for i, token in enumerate(continuation):
            out = llm.generate([prompt + continuation[:i]], params, use_tqdm=False)
            row.append(out[0].outputs[0].logprobs[0][token])
        result.append(row)
    return result


def test_calibrated_fp8_cache_stays_close_to_float32_where_scale_one_saturates(large) -> None:
    exact = LLM(str(large), **OPTIONS)
    tokens = _greedy(exact)
    want = _prefill_logprobs(exact, tokens)
    errors = {}
    for scale in ("auto", 1.0):
        llm = LLM(str(large), kv_cache_dtype="fp8", kv_cache_scale=scale, **OPTIONS)
        for cache in llm.caches:
            cache.track()
        got = _prefill_logprobs(llm, tokens)
        errors[scale] = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w))
        clipped = sum(cache.clipped for cache in llm.caches)
        amax = max(cache.amax for cache in llm.caches)
        assert amax > 448  # the latents are past fp8's range
        assert (clipped > 0) == (scale == 1.0), (scale, clipped)
    assert errors["auto"] < 0.15, errors  # fp8's own rounding
    assert errors[1.0] > 10 * errors["auto"], errors


def test_calibration_sets_the_power_of_two_nearest_headroom_times_the_largest_latent(large) -> None:
    llm = LLM(str(large), kv_cache_dtype="fp8", kv_cache_scale=1.0, **OPTIONS)
    scales = calibrate(llm.runner, llm.caches, llm.block_manager, llm.config.vocab_size,
                       llm.max_model_len, None)
    assert len(scales) == len(llm.caches)
    # The float32 engine, fed the same prompt of random tokens, tracked independently.
    exact = LLM(str(large), **OPTIONS)
    for cache in exact.caches:
        cache.track()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(exact.config.vocab_size, (1024,), generator=gen).tolist()
    exact.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)
    for scale, cache in zip(scales, exact.caches, strict=True):
        # The power of two nearest HEADROOM x amax / 448.
        assert math.log2(scale) == round(math.log2(HEADROOM * cache.amax / 448))


def test_checkpoint_scales_are_read_per_layer(tmp_path) -> None:
    layers = tiny_config()["num_hidden_layers"]
    want = [0.25 * (i + 1) for i in range(layers)]

    def ship(kind: str, count: int, value=lambda i: 0.25 * (i + 1)):
        def change(tensors):
            for i in range(count):
                tensors[f"model.layers.{i}.self_attn.{kind}_scale"] = torch.tensor(value(i))
                tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(99.0)
        return change

    for kind in ("k", "kv"):
        directory = _rewrite(write_tiny_checkpoint(tmp_path / kind), ship(kind, layers))
        llm = LLM(str(directory), kv_cache_dtype="fp8", **OPTIONS)
        assert [float(c.scale) for c in llm.caches] == want
        # Calibration and a number override them; a 16-bit cache ignores them.
        calibrated = LLM(str(directory), kv_cache_dtype="fp8", kv_cache_scale="calibrate",
                         **OPTIONS)
        assert [float(c.scale) for c in calibrated.caches] != want
        fixed = LLM(str(directory), kv_cache_dtype="fp8", kv_cache_scale=3.0, **OPTIONS)
        assert {float(c.scale) for c in fixed.caches} == {3.0}
        assert {float(c.scale) for c in LLM(str(directory), **OPTIONS).caches} == {1.0}
    partial = _rewrite(write_tiny_checkpoint(tmp_path / "partial"), ship("k", layers - 1))
    with pytest.raises(ValueError, match=rf"not for layers \[{layers - 1}\]"):
        LLM(str(partial), kv_cache_dtype="fp8", **OPTIONS)
    negative = _rewrite(write_tiny_checkpoint(tmp_path / "negative"),
                        ship("k", layers, lambda i: -1.0))
    with pytest.raises(ValueError, match="finite and > 0"):
        LLM(str(negative), kv_cache_dtype="fp8", **OPTIONS)


def test_tracking_counts_what_clips_and_the_largest_value() -> None:
    cache = LatentKVCache(4, 4, 8, 2, kv_cache_dtype="fp8", dtype=torch.float32, scale=0.5)
    kv_c, k_pe = torch.zeros(3, 8), torch.zeros(3, 2)
    kv_c[0, 0], kv_c[1, :3], k_pe[2, 1] = -300.0, 225.0, 1e4  # 448 * 0.5 = 224
    slots = torch.tensor([0, 1, -1])  # the third row is skipped: not counted
    assert cache.clipped is None and cache.amax is None
    cache.observe(kv_c, k_pe, slots)  # not tracking: nothing counted
    cache.track()
    cache.observe(kv_c, k_pe, slots)
    assert (cache.clipped, cache.amax) == (4, 300.0)
    k_pe[0, 0] = math.nan
    cache.observe(kv_c, k_pe, slots)
    assert math.isnan(cache.amax)
    cache.untrack()
    assert cache.clipped is None
    wide = LatentKVCache(4, 4, 8, 2, dtype=torch.float32)
    wide.track()
    wide.observe(kv_c.nan_to_num(), k_pe.nan_to_num(), slots)
    assert (wide.clipped, wide.amax) == (None, 300.0)  # no fp8, no clipping


@pytest.mark.parametrize("value, cache, error", [
    ("bogus", "fp8", ValueError), (0.0, "fp8", ValueError), (math.inf, "fp8", ValueError),
    (True, "fp8", TypeError), ("1.5", "fp8", ValueError),
    # A scale other than auto's is an fp8 cache's only.
    (2.0, "auto", ValueError), ("calibrate", "fp8_ds_mla", ValueError)])
def test_kv_cache_scale_is_validated(value, cache, error) -> None:
    with pytest.raises(error, match="kv_cache_scale"):
        EngineArgs(kv_cache_scale=value, kv_cache_dtype=cache)
    EngineArgs(kv_cache_scale="auto", kv_cache_dtype=cache)


def test_kv_cache_scale_flag(capsys) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    for text, want in (("calibrate", "calibrate"), ("0.5", 0.5), ("auto", "auto")):
        flags = ["--kv-cache-scale", text, "--kv-cache-dtype", "fp8"]
        assert EngineArgs.from_cli_args(parser.parse_args(flags)).kv_cache_scale == want
    for text in ("big", "0", "-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--kv-cache-scale", text])
        assert "invalid kv-cache-scale" in capsys.readouterr().err
