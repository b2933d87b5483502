"""Which kernel the library runs for a call, as the kernel benchmarks read it.

Every name the benchmarks take from the kernel selection (`pagedmla.ops.triton.selection`)
is read here and nowhere else: the portable decode configs they report, whether a call
runs on a Gluon kernel, the configs that force the portable Triton kernel instead (timed
beside it: `config=` always runs that kernel), and the Triton kernels whose compiled code
the config sweeps describe.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
from triton.runtime.jit import JITFunction

from benchmarks.workloads import FP8, DecodeArgs
from pagedmla.ops.triton.decode_triton import (
    DECODE_CONFIGS,
    DecodeConfig,
    _decode_partial_kernel,
    pick_config,
)
from pagedmla.ops.triton.prefill_triton import PrefillConfig, _varlen_attention_kernel
from pagedmla.ops.triton.prefill_triton import pick_config as prefill_pick_config
from pagedmla.ops.triton.selection import decode_kernel, prefill_kernel

# --- decode -----------------------------------------------------------------------------


def decode_configs() -> dict[str, dict]:
    """Every portable decode stage-1 config by regime, as JSON (the report's "configs")."""
    return {k: asdict(v) for k, v in DECODE_CONFIGS.items()}


def decode_config(regime: str) -> DecodeConfig:
    """The portable decode stage-1 config of one regime ("rows16", "rows64-fp8", ...)."""
    return DECODE_CONFIGS[regime]


def decode_block_h(rows: int) -> int:
    """Query rows per program of the bf16 decode config for `rows` = N x q_len query rows
    per request (the report's "decode_regimes")."""
    return pick_config(rows, torch.bfloat16).block_h


def _rows(args: DecodeArgs) -> int:
    """Query rows per request of a decode call: N x max_query_len."""
    return args[0].shape[1] * args[6]


def decode_runs_gluon(args: DecodeArgs) -> bool:
    """Whether mla_decode(*args) runs stage 1 as a Gluon kernel (on a Hopper GPU)."""
    return decode_kernel(args[0], args[1], _rows(args), args[8]).gluon


def triton_decode_config(args: DecodeArgs) -> DecodeConfig:
    """The portable kernel's config for these arguments (pass it as `config=` to run
    that kernel where a Gluon one would take the call)."""
    return pick_config(_rows(args), args[0].dtype, args[1].dtype == FP8)


def decode_stage1_kernel() -> JITFunction:
    """The Triton decode stage-1 kernel (a JITFunction)."""
    return _decode_partial_kernel


# --- prefill ----------------------------------------------------------------------------


def triton_prefill_config(qk_dim: int, v_dim: int, dtype: torch.dtype) -> PrefillConfig:
    """The Triton prefill kernel's launch parameters for these widths (pass it as
    `config=` to run that kernel where a Gluon one would take the call)."""
    return prefill_pick_config(qk_dim, v_dim, dtype)


def prefill_runs_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                       max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                       causal: bool) -> bool:
    """Whether varlen_attention (our kernels, no cuDNN) runs this call on a Gluon kernel."""
    return prefill_kernel(q, k, v, cu_seqlens_q.shape[0] - 1, max_seqlen_q, max_seqlen_k,
                          softmax_scale, causal, cudnn=False).gluon


def prefill_kernel_jit() -> JITFunction:
    """The Triton prefill kernel (a JITFunction)."""
    return _varlen_attention_kernel
