"""Bad input to LLM(), EngineArgs, SamplingParams and LLM.generate is refused at the call.

Each refusal is a TypeError (wrong kind of value) or a ValueError (a value out of range)
whose message names the argument, raised before anything is queued: after it the
scheduler holds no sequence, every cache block is free, and the next call runs as if
the bad one had never been made.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedmla import LLM, EngineArgs, SamplingParams
from pagedmla.cli import build_parser

OPTIONS = dict(device="cpu", block_size=16, num_kv_blocks=24, max_num_batched_tokens=32)
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = [[5, 6, 7, 8]]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", **OPTIONS)


@pytest.fixture(scope="module")
def expected(llm: LLM) -> tuple[list[int], int]:
    """PROMPT's greedy tokens and steps (4 tokens fill no block: no prefix cache hit)."""
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    return out[0].outputs[0].token_ids, llm.stats.steps


def _assert_untouched(llm: LLM, expected: tuple[list[int], int]) -> None:
    """Nothing of the refused call is left, and the next call runs as usual."""
    assert not llm.scheduler.has_unfinished()
    manager = llm.block_manager
    assert manager.num_free_blocks == manager.num_usable_blocks
    out = llm.generate(PROMPT, GREEDY, use_tqdm=False)
    assert (out[0].outputs[0].token_ids, llm.stats.steps) == expected


# --- SamplingParams ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("max_tokens", 2.5, TypeError),
        ("max_tokens", True, TypeError),
        ("max_tokens", None, TypeError),
        ("max_tokens", "4", TypeError),
        ("top_k", 2.5, TypeError),
        ("top_k", False, TypeError),
        ("temperature", float("inf"), ValueError),
        ("temperature", "0.5", TypeError),
        ("temperature", None, TypeError),
        ("top_p", True, TypeError),
        ("top_p", float("nan"), ValueError),
        ("seed", 2**70, ValueError),
        ("seed", 2**64, ValueError),
        ("seed", -1, ValueError),
        ("seed", 1.0, TypeError),
        ("stop_token_ids", 5, TypeError),
        ("stop_token_ids", "5", TypeError),
        ("stop_token_ids", [1, 2.0], TypeError),
        ("stop_token_ids", [True], TypeError),
        ("stop_token_ids", [-1], ValueError),
        ("logprobs", 2.5, TypeError),
        ("logprobs", True, TypeError),
        ("ignore_eos", 1, TypeError),
        ("ignore_eos", None, TypeError),
    ],
)
def test_sampling_params_check_types_and_values(field: str, value: object,
                                                error: type[Exception]) -> None:
    with pytest.raises(error, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_accept_their_whole_range_and_numpy_numbers() -> None:
    SamplingParams(seed=2**64 - 1)
    SamplingParams(temperature=0, top_p=1, stop_token_ids=())
    params = SamplingParams(max_tokens=np.int64(4), top_k=np.int32(3), seed=np.uint64(7),
                            temperature=np.float32(0.5), stop_token_ids=(np.int64(9), 2))
    assert (params.max_tokens, params.top_k, params.seed) == (4, 3, 7)
    assert all(type(v) is int for v in (params.max_tokens, params.top_k, params.seed))
    assert type(params.temperature) is float
    assert params.stop_token_ids == [9, 2] and type(params.stop_token_ids[0]) is int


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("stop_token_ids", 5, TypeError),  # failed inside a step, for good
        ("logprobs", 2.5, TypeError),  # likewise, in the sampler
        ("top_k", 0, ValueError),
        ("max_tokens", 2.5, TypeError),
        ("temperature", float("nan"), ValueError),
        ("seed", 2**70, ValueError),
    ],
)
def test_generate_checks_params_changed_after_construction(
    llm: LLM, expected: tuple[list[int], int], field: str, value: object,
    error: type[Exception],
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    setattr(params, field, value)
    with pytest.raises(error, match=field):
        llm.generate(PROMPT, params, use_tqdm=False)
    with pytest.raises(error, match=field):  # the bad one second in a list
        llm.generate(PROMPT * 2, [GREEDY, params], use_tqdm=False)
    _assert_untouched(llm, expected)


def test_generate_keeps_a_checked_copy_of_the_params(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=np.int64(3), ignore_eos=True)
    params.max_tokens = np.int64(2)
    out = llm.generate(PROMPT, params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    assert type(params.max_tokens) is np.int64  # the caller's object is left as it is


# --- prompts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompts", "error", "pattern"),
    [
        ([1, 72, 105], TypeError, r"flat list of token ids.*\[\[1, 72, 105\]\]"),
        (b"hi", TypeError, "prompts must be"),
        (None, TypeError, "prompts must be"),
        (42, TypeError, "prompts must be"),
        ({"prompt": "hi"}, TypeError, "prompts must be"),
        ([[]], ValueError, r"prompts\[0\] is empty"),
        ([[5, 6], []], ValueError, r"prompts\[1\] is empty"),
        ([b"hi"], TypeError, r"prompts\[0\] must be a str or a list of token ids"),
        ([[5, 6], None], TypeError, r"prompts\[1\] must be"),
        ([[1.0, 2]], TypeError, r"prompts\[0\]\[0\] must be an int"),
        ([[5, True]], TypeError, r"prompts\[0\]\[1\] must be an int"),
        ([[5, "6"]], TypeError, r"prompts\[0\]\[1\] must be an int"),
        ([[5, 259]], ValueError, r"prompts\[0\]\[1\] must be a token id in \[0, 259\)"),
        ([[-1]], ValueError, r"prompts\[0\]\[0\] must be a token id"),
    ],
)
def test_bad_prompts(llm: LLM, expected: tuple[list[int], int], prompts: object,
                     error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    _assert_untouched(llm, expected)


def test_prompts_in_other_accepted_forms(llm: LLM, expected: tuple[list[int], int]) -> None:
    tokens = expected[0]
    by_tuple = llm.generate((tuple(PROMPT[0]),), GREEDY, use_tqdm=False)
    by_numpy = llm.generate([[np.int64(t) for t in PROMPT[0]]], GREEDY, use_tqdm=False)
    assert by_tuple[0].outputs[0].token_ids == by_numpy[0].outputs[0].token_ids == tokens
    assert llm.generate([], GREEDY, use_tqdm=False) == []
    # A str is one prompt; the byte tokenizer gives even "" its BOS token.
    assert len(llm.generate("", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    ("sampling_params", "error", "pattern"),
    [
        ([GREEDY], ValueError, "1 SamplingParams for 2 prompts"),
        ([GREEDY, {"max_tokens": 3}], TypeError, r"sampling_params\[1\] must be a SamplingParams"),
        ({"max_tokens": 3}, TypeError, "sampling_params must be"),
    ],
)
def test_bad_sampling_params_argument(llm: LLM, expected: tuple[list[int], int],
                                      sampling_params: object, error: type[Exception],
                                      pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        llm.generate(PROMPT * 2, sampling_params, use_tqdm=False)
    _assert_untouched(llm, expected)


def test_every_request_is_checked_before_any_is_queued(
    llm: LLM, expected: tuple[list[int], int]
) -> None:
    """The issue's case: a valid first prompt used to be queued before the second was
    refused, and the next one-token call then ran its tokens first."""
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    with pytest.raises(ValueError, match=r"prompts\[1\] of 5001 tokens.*max_model_len 4096"):
        llm.generate(["ok", "x" * 5000], params, use_tqdm=False)
    # Longer than the whole cache (23 blocks of 16 tokens), but within max_model_len.
    with pytest.raises(ValueError, match=r"prompts\[1\] needs up to 26 cache blocks"):
        llm.generate([[5, 6], [7] * 400], GREEDY, use_tqdm=False)
    assert llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.stats.steps == 1
    _assert_untouched(llm, expected)


# --- LLM() and EngineArgs --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "pattern"),
    [
        (dict(device="cpu:1"), ValueError, "device must be cpu"),
        (dict(device="tpu"), ValueError, "device"),
        (dict(device="not a device"), ValueError, "device"),
        (dict(device=0), TypeError, "device"),
        (dict(dtype="float64"), ValueError, "dtype"),
        (dict(dtype=torch.float64), ValueError, "dtype"),
        (dict(dtype=torch.int32), ValueError, "dtype"),
        (dict(dtype=32), ValueError, "dtype"),
        (dict(max_model_len=0), ValueError, "max_model_len must be an int >= 1, got 0"),
        (dict(max_model_len=-5), ValueError, "max_model_len"),
        (dict(max_model_len=64.0), TypeError, "max_model_len must be an int"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(block_size=True), TypeError, "block_size"),
        (dict(num_kv_blocks=1), ValueError, "num_kv_blocks"),
        (dict(num_kv_blocks="8"), TypeError, "num_kv_blocks"),
        (dict(gpu_memory_utilization=0), ValueError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization=float("nan")), ValueError, "gpu_memory_utilization"),
        (dict(gpu_memory_utilization="0.5"), TypeError, "gpu_memory_utilization"),
        (dict(workspace_rows=0), ValueError, "workspace_rows"),
        (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
        (dict(max_num_batched_tokens=2.5), TypeError, "max_num_batched_tokens"),
        (dict(tensor_parallel_size=1.0), TypeError, "tensor_parallel_size"),
        (dict(cp_kv_cache_interleave_size=0), ValueError, "cp_kv_cache_interleave_size"),
        (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
        (dict(kv_cache_dtype=8), TypeError, "kv_cache_dtype"),
        (dict(backend="fastest"), ValueError, "backend"),
        (dict(enforce_eager="yes"), TypeError, "enforce_eager"),
        (dict(async_scheduling=None), TypeError, "async_scheduling"),
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=2**64), ValueError, "seed"),
        (dict(seed=0.5), TypeError, "seed"),
    ],
)
def test_bad_engine_arguments(kwargs: dict, error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        EngineArgs(**kwargs)
    with pytest.raises(error, match=pattern):
        LLM("tiny", **{**OPTIONS, **kwargs})


def test_engine_args_changed_after_construction_are_checked_again() -> None:
    args = EngineArgs(**OPTIONS)
    args.max_model_len = 0
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(args)
    assert args.max_model_len == 0  # LLM checked a copy of its own


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16),
     ("auto", None), (torch.float16, torch.float16), (None, None)],
)
def test_dtype_by_name_or_torch_dtype(name: object, dtype: torch.dtype | None) -> None:
    assert EngineArgs(dtype=name).dtype == dtype
    assert EngineArgs(dtype=name) == EngineArgs(dtype=dtype)


def test_llm_takes_a_dtype_name(llm: LLM) -> None:
    by_name = LLM("tiny", **{**OPTIONS, "dtype": "float32"})
    assert by_name.dtype == torch.float32
    assert by_name.args == replace(llm.args, dtype=torch.float32)


def test_the_dtype_flag_takes_auto() -> None:
    args = build_parser().parse_args(["generate", "--dtype", "auto"])
    assert EngineArgs.from_cli_args(args).dtype is None


def test_a_model_path_may_be_a_path_object(tmp_path) -> None:
    assert EngineArgs(model=tmp_path).model == str(tmp_path)
    with pytest.raises(TypeError, match="model"):
        EngineArgs(model=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_this_machine_lacks() -> None:
    EngineArgs(device="cuda:1")  # a well-formed name: the command line may prepare it
    with pytest.raises(ValueError, match="device 'cuda': this machine has 0 CUDA devices"):
        LLM("tiny", **{**OPTIONS, "device": "cuda"})
