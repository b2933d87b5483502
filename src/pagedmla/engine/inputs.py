"""What `LLM` is given, checked at the call: engine arguments, the device, prompts and
their SamplingParams. Each check raises TypeError or ValueError naming the argument."""

from __future__ import annotations

import copy
import numbers
from collections.abc import Sequence as SequenceABC
from dataclasses import fields, replace
from typing import Any

import torch

from pagedmla.device import resolve_device
from pagedmla.engine.args import EngineArgs
from pagedmla.engine.sampling_params import SamplingParams
from pagedmla.validation import integer


def engine_args(model: str | EngineArgs, keywords: dict[str, Any]) -> EngineArgs:
    """What LLM(model, **keywords) was given, as checked EngineArgs of its own."""
    if isinstance(model, EngineArgs):
        if keywords:
            raise TypeError(f"LLM() takes EngineArgs or keywords, not both; got EngineArgs "
                            f"and {', '.join(sorted(keywords))}")
        return replace(model)  # a copy, checked again: the caller's may have changed
    unknown = sorted(set(keywords) - {f.name for f in fields(EngineArgs)})
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)} "
                        f"(the engine's arguments are the fields of pagedmla.EngineArgs)")
    return EngineArgs(model=model, **keywords)


def engine_device(device: str | torch.device | None) -> torch.device:
    """The device named (EngineArgs checked its form), or CUDA when present, else the
    CPU; a ValueError for a CUDA device this machine lacks."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    count = torch.cuda.device_count()
    if device.type == "cuda" and (device.index or 0) >= count:
        raise ValueError(f"device {str(device)!r}: this machine has {count} CUDA devices")
    return resolve_device(device)


def prompt_list(prompts: object) -> list[object]:
    """generate()'s prompts as a list of prompts (each checked by `LLM._encode`)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a str or a list of prompts, each a str or a list of "
                        f"token ids, got {type(prompts).__name__} {prompts!r:.80}")
    if prompts and all(isinstance(p, numbers.Integral) for p in prompts):
        flat = repr(list(prompts)) if len(prompts) <= 8 else "[...]"
        raise TypeError(f"prompts is a flat list of token ids, {flat:.80}: a prompt of token "
                        f"ids goes inside the list of prompts, [{flat:.80}] for one prompt")
    return list(prompts)


def checked_token_ids(name: str, prompt: SequenceABC[object], vocab_size: int) -> list[int]:
    """A prompt's token ids as ints: a TypeError naming name[j] for an id that is not an
    int (a bool or a float is not), a ValueError for one outside [0, vocab_size)."""
    ids = list(prompt)
    if not all(type(token) is int for token in ids):
        ids = [integer(f"{name}[{j}]", token) for j, token in enumerate(ids)]
    if ids and not (min(ids) >= 0 and max(ids) < vocab_size):
        j = next(j for j, token in enumerate(ids) if not 0 <= token < vocab_size)
        raise ValueError(f"{name}[{j}] must be a token id in [0, {vocab_size}), got {ids[j]}")
    return ids


def checked_params(
    sampling_params: SamplingParams | SequenceABC[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt, each a checked copy (`SamplingParams.validate`) of
    the one given for it, so that the caller's objects stay as they are and changing them
    later does not reach the requests; None means the defaults for every prompt."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        given = [sampling_params] * count
    elif isinstance(sampling_params, (list, tuple)):
        given = list(sampling_params)
        if len(given) != count:
            raise ValueError(f"got {len(given)} SamplingParams for {count} prompts")
        for index, params in enumerate(given):
            if not isinstance(params, SamplingParams):
                raise TypeError(f"sampling_params[{index}] must be a SamplingParams, got "
                                f"{type(params).__name__} {params!r:.80}")
    else:
        raise TypeError("sampling_params must be a SamplingParams, a list of them or None, "
                        f"got {type(sampling_params).__name__} {sampling_params!r:.80}")
    copies: dict[int, SamplingParams] = {}
    for params in given:  # each object checked once, however many prompts share it
        if id(params) not in copies:
            copies[id(params)] = checked = copy.copy(params)
            checked.validate()
    return [copies[id(params)] for params in given]
