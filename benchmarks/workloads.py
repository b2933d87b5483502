"""The kernel benchmarks' inputs, and the fewest bytes and FLOPs each kernel must spend.

Shared by the benchmarks and by the GPU tests that check the kernels at the benchmarks'
sizes (tests/test_kernel_sweep.py). Latent width L = 512 and rope width R = 64
(DeepSeek-V2 / V3).
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.harness import DEV

L, R = 512, 64
FP8 = torch.float8_e4m3fn

DecodeArgs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                   torch.Tensor, int, int, int, float]


def decode_inputs(batch: int, heads: int, context: int, q_len: int = 1, block_size: int = 64,
                  cache: torch.dtype = torch.bfloat16, seed: int = 0,
                  lengths: list[int] | None = None) -> DecodeArgs:
    """mla_decode's arguments for B = `batch` requests of `q_len` query tokens each: a
    paged cache [W pages, block_size, L + R] with every request at `context` positions
    (new tokens included), or at lengths[b] <= context for request b, its pages scattered
    by a random permutation (page 0 unused); q [B * q_len, N, L + R] bf16. An fp8 cache
    has scale 0.5."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    lengths = lengths or [context] * batch
    per_req = -(-context // block_size)
    used = sum(-(-n // block_size) for n in lengths)
    data = torch.empty(used + 1, block_size, L + R, device=DEV, dtype=torch.bfloat16)
    data.normal_(generator=gen)
    data = data.to(cache)
    order = (torch.randperm(used, device=DEV, generator=gen) + 1).int()
    table = torch.zeros(batch, per_req, dtype=torch.int32, device=DEV)
    taken = 0
    for b, n in enumerate(lengths):
        blocks = -(-n // block_size)
        table[b, :blocks] = order[taken:taken + blocks]
        taken += blocks
    q = torch.randn(batch * q_len, heads, L + R, device=DEV, dtype=torch.bfloat16,
                    generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=DEV)
    scale = torch.tensor(0.5 if cache == FP8 else 1.0, device=DEV)
    return (q, data, scale, table, seq_lens, qsl, q_len, context, L, (L + R) ** -0.5)


def decode_cost(batch: int, heads: int, context: int, q_len: int, elt: int,
                rows: int | None = None) -> tuple[int, int]:
    """(bytes, FLOPs): cache rows (batch x context, or `rows` in all) read once + q read
    + out written; QK^T over L + R and PV over L for every head and query token."""
    rows = batch * context if rows is None else rows
    tokens = batch * q_len
    nbytes = rows * (L + R) * elt + tokens * heads * (L + R) * 2 + tokens * heads * L * 2
    flops = 2 * heads * q_len * rows * (L + R) + 2 * heads * q_len * rows * L
    return nbytes, flops


def cu_lens(lens: list[int]) -> torch.Tensor:
    """Cumulative lengths [0, l0, l0 + l1, ...] as an int32 CUDA tensor."""
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=DEV)


def attention_flops(q_lens: list[int], k_lens: list[int], heads: int, width: int,
                    causal: bool) -> int:
    """2 x heads x (qk + v) FLOPs per visible (query, key) pair; causal bottom-right."""
    pairs = 0
    for q_len, k_len in zip(q_lens, k_lens):
        if causal:  # query i sees min(k_len, k_len - q_len + i + 1) keys (at least 0)
            shift = k_len - q_len
            pairs += sum(max(0, min(k_len, shift + i + 1)) for i in range(q_len))
        else:
            pairs += q_len * k_len
    return 2 * heads * pairs * width
