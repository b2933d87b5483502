"""Which kernel the library runs for a call, as the kernel benchmarks read it.

Every name the benchmarks take from the decode and prefill dispatch is read here and
nowhere else: the configs they report, whether a Hopper GPU runs a call on a Gluon
kernel, the launch parameters that force the portable Triton kernel instead (timed
beside it), and the Triton kernels whose compiled code the config sweeps describe.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from benchmarks.workloads import FP8, DecodeArgs
from pagedmla.ops.triton.decode import DECODE_CONFIGS, DecodeConfig, _decode_partial_kernel
from pagedmla.ops.triton.decode import hopper_kernel as decode_hopper_kernel
from pagedmla.ops.triton.decode import pick_config as decode_pick_config
from pagedmla.ops.triton.prefill import PrefillConfig, _varlen_attention_kernel
from pagedmla.ops.triton.prefill import hopper_kernel as prefill_hopper_kernel
from pagedmla.ops.triton.prefill import pick_config as prefill_pick_config

# --- decode -----------------------------------------------------------------------------


def decode_configs() -> dict[str, dict]:
    """Every decode stage-1 config by regime, as JSON (the report's "configs")."""
    return {k: asdict(v) for k, v in DECODE_CONFIGS.items()}


def decode_config(regime: str) -> DecodeConfig:
    """The decode stage-1 config of one regime ("rows16", "rows64-fp8", ...)."""
    return DECODE_CONFIGS[regime]


def decode_block_h(rows: int) -> int:
    """Query rows per program of the bf16 decode config for `rows` = N x q_len query rows
    per request (the report's "decode_regimes")."""
    return decode_pick_config(rows, torch.bfloat16).block_h


def _picked(args: DecodeArgs) -> tuple[DecodeConfig, int]:
    """The config mla_decode picks for these arguments, and its query rows per request."""
    q, data, rows = args[0], args[1], args[0].shape[1] * args[6]
    return decode_pick_config(rows, q.dtype, data.dtype == FP8), rows


def decode_runs_gluon(args: DecodeArgs) -> bool:
    """Whether mla_decode(*args) runs stage 1 as a Gluon kernel (on a Hopper GPU)."""
    config, rows = _picked(args)
    return config.hopper and decode_hopper_kernel(args[0], args[1], rows, args[8]) is not None


def triton_decode_config(args: DecodeArgs) -> DecodeConfig:
    """The config mla_decode picks for these arguments, on the portable Triton kernel
    (pass it as `config=`)."""
    return replace(_picked(args)[0], hopper=False)


def decode_stage1_kernel():
    """The Triton decode stage-1 kernel (a JITFunction)."""
    return _decode_partial_kernel


# --- prefill ----------------------------------------------------------------------------


def triton_prefill_config(qk_dim: int, v_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The Triton prefill kernel's launch parameters for these widths (pass it as
    `config=` to run that kernel where a Gluon one would take the call)."""
    return prefill_pick_config(qk_dim, v_dim, dtype)


def prefill_runs_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       softmax_scale: float) -> bool:
    """Whether varlen_attention runs these inputs on the Gluon kernel (on a Hopper GPU)."""
    return prefill_hopper_kernel(q, k, v, softmax_scale) is not None


def prefill_kernel():
    """The Triton prefill kernel (a JITFunction)."""
    return _varlen_attention_kernel
