"""EngineArgs: one set of engine arguments for `LLM` and the command line's flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest
import torch

from pagedmla import LLM, EngineArgs, SamplingParams
from pagedmla.cli import build_parser

FIELDS = {f.name: f for f in dataclasses.fields(EngineArgs)}


def _subparser(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def _engine_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The actions of the parser's engine group, by destination."""
    group = next(g for g in parser._action_groups if g.title.startswith("engine"))
    return {action.dest: action for action in group._group_actions}


def test_every_field_is_documented_with_a_default() -> None:
    hints = typing.get_type_hints(EngineArgs)
    for name, f in FIELDS.items():
        assert f.default is not dataclasses.MISSING, name
        assert f.metadata["help"].strip(), name
        assert name in hints
    assert EngineArgs.__doc__ and all(
        group in EngineArgs.__doc__
        for group in ("Model", "Cache", "Scheduling", "Parallelism", "Execution"))


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_every_field_has_a_flag_and_every_engine_flag_a_field(command: str) -> None:
    flags = _engine_flags(_subparser(command))
    assert set(flags) == set(FIELDS)
    for name, action in flags.items():
        assert f"--{name.replace('_', '-')}" in action.option_strings
        assert action.default == FIELDS[name].default, name
        assert FIELDS[name].metadata["help"] in action.help


def test_the_flags_default_to_the_llm_defaults() -> None:
    for command in ("generate", "bench"):
        args = build_parser().parse_args([command])
        assert EngineArgs.from_cli_args(args) == EngineArgs()


def test_the_command_line_spellings() -> None:
    args = build_parser().parse_args([
        "generate", "--model", "/ckpt", "--dtype", "bfloat16", "--device", "cuda:1",
        "--kv-cache-dtype", "fp8", "--block-size", "16", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--num-kv-blocks", "100", "--no-prefix-caching",
        "--backend", "triton", "--enforce-eager", "--no-async-scheduling", "--seed", "7",
        "--tensor-parallel-size", "4", "--decode-context-parallel-size", "2",
        "--cp-kv-cache-interleave-size", "8", "--max-model-len", "4096",
        "--workspace-rows", "2048", "--gpu-memory-utilization", "0.5", "--no-route-by-cost",
    ])
    assert EngineArgs.from_cli_args(args) == EngineArgs(
        model="/ckpt", dtype=torch.bfloat16, device="cuda:1", kv_cache_dtype="fp8",
        block_size=16, max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=100,
        enable_prefix_caching=False, backend="triton", enforce_eager=True,
        async_scheduling=False, seed=7, tensor_parallel_size=4,
        decode_context_parallel_size=2, cp_kv_cache_interleave_size=8, max_model_len=4096,
        workspace_rows=2048, gpu_memory_utilization=0.5, route_by_cost=False,
    )
    on = build_parser().parse_args(["bench", "--enable-prefix-caching", "--async-scheduling"])
    assert on.enable_prefix_caching and on.async_scheduling


def test_an_unknown_dtype_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--dtype", "float64"])
    assert "invalid dtype 'float64'" in capsys.readouterr().err


def test_unknown_keywords_are_named() -> None:
    with pytest.raises(TypeError, match="blok_size, max_seqs"):
        LLM("tiny", device="cpu", blok_size=16, max_seqs=4)


def test_engine_args_and_keywords_do_not_mix() -> None:
    with pytest.raises(TypeError, match="not both"):
        LLM(EngineArgs(device="cpu"), block_size=16)


def test_keywords_and_engine_args_build_the_same_engine() -> None:
    keywords = dict(device="cpu", dtype=torch.float32, block_size=16, num_kv_blocks=32,
                    max_num_batched_tokens=32)
    by_keywords = LLM(model="tiny", **keywords)
    by_args = LLM(EngineArgs(model="tiny", **keywords))
    assert by_keywords.args == by_args.args == EngineArgs(**keywords)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(40))]
    expected = [o.outputs[0].token_ids for o in by_keywords.generate(prompts, params,
                                                                     use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in by_args.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert by_args.block_manager.block_size == 16 and by_args.caches[0].num_blocks == 32
