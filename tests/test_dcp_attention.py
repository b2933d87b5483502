"""Decode context parallel MLAAttention on 2 and 4 gloo ranks against the dense oracle.

Each rank holds its shard of a paged batch (`shard_cache`: the batch's cache, laid out
in virtual blocks of block_size * D tokens, moved row by row to the owning rank) and
the heads N / D of its tensor parallel share; its output must match the float64
oracle's columns for those heads, and its cache must hold exactly the new rows it owns.
One spawn per group size runs every case. float32 tolerance as in
test_attention_oracle: 2e-4 relative L2 (observed ~1e-6).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from pagedmla import LatentKVCache, MLAAttention, MLADims
from pagedmla.distributed.dcp_layout import DCPLayout
from pagedmla.distributed.dcp_metadata import DCPMetadataBuilder
from pagedmla.distributed.state import ParallelState
from pagedmla.testing import _bits, make_paged_batch, relative_error
from tests.dist_helpers import run_ranks, shard_cache

FLOAT32_TOL = 2e-4
DIMS = MLADims(num_heads=8, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16)


@dataclass(frozen=True)
class Case:
    name: str
    query_lens: list[int]
    seq_lens: list[int]
    block_size: int = 4
    interleave: int = 1
    decode_threshold: int = 1
    workspace_rows: int | None = None
    kv_cache_dtype: str = "auto"
    fp8_scale: float = 1.0


CASES = [
    # Sequences shorter than the group: some ranks hold nothing of them.
    Case("decode, empty shards", [1] * 6, [1, 2, 3, 5, 8, 41]),
    Case("decode, every row on rank 0", [1, 1], [1, 1]),
    Case("decode, interleave 2", [1] * 5, [1, 2, 3, 7, 37], interleave=2),
    Case("multi-token decode", [3, 1, 4, 2, 6], [3, 9, 30, 5, 21], decode_threshold=4),
    Case("multi-token decode, interleave 4", [2, 4, 1, 9], [2, 19, 4, 30],
         block_size=8, interleave=4, decode_threshold=4),
    # Workspace of a few rows per rank: many chunks, continuations, context-free prefills.
    Case("chunked context", [1, 1, 5, 6, 3, 9], [7, 2, 50, 6, 33, 70], workspace_rows=8),
    Case("chunked context, interleave 2", [1, 4, 7, 2], [13, 40, 7, 61], block_size=8,
         interleave=2, workspace_rows=16),
    Case("fp8 cache", [1, 1, 5, 8], [3, 26, 40, 8], kv_cache_dtype="fp8", fp8_scale=0.5,
         workspace_rows=8),
]


def _run_case(state: ParallelState, case: Case, seed: int,
              backend: str) -> tuple[float, int, int]:
    """(relative error of this rank's heads, cache slots wrong, context chunks)."""
    D, rank = state.dcp_size, state.dcp_rank
    layout = DCPLayout(D, rank, case.interleave, case.block_size)
    batch = make_paged_batch(
        DIMS, case.query_lens, case.seq_lens, block_size=layout.virtual_block_size,
        kv_cache_dtype=case.kv_cache_dtype, fp8_scale=case.fp8_scale, seed=seed,
    )
    heads = DIMS.num_heads // D
    mine = slice(rank * heads, (rank + 1) * heads)
    dims = replace(DIMS, num_heads=heads)
    cache = LatentKVCache(batch.cache.num_blocks, case.block_size, DIMS.kv_lora_rank,
                          DIMS.qk_rope_head_dim, kv_cache_dtype=case.kv_cache_dtype,
                          dtype=torch.float32, scale=case.fp8_scale)
    cache.data.copy_(shard_cache(batch.cache.data, layout))
    builder = DCPMetadataBuilder(dims, layout, state, workspace_rows=case.workspace_rows,
                                 decode_threshold=case.decode_threshold)
    meta = builder.build(batch.spec)
    latent = DIMS.kv_lora_rank
    kv_b_proj = batch.kv_b_proj.view(DIMS.num_heads, -1, latent)[mine].reshape(-1, latent)
    attn = MLAAttention(dims, softmax_scale=batch.softmax_scale, kv_b_proj=kv_b_proj,
                        backend=backend)
    out = attn(batch.q[:, mine].contiguous(), batch.kv_c, batch.k_pe, cache, meta)
    ref = batch.oracle(case.decode_threshold).view(batch.num_tokens, DIMS.num_heads, -1)
    err = relative_error(out, ref[:, mine])
    expected = shard_cache(batch.expected_cache(), layout)
    wrong = int((_bits(cache.data) != _bits(expected)).any(dim=-1).sum())
    context = meta.prefill.context if meta.prefill is not None else None
    return err, wrong, len(context.chunks) if context is not None else 0


def _all_cases(world: int, backend: str) -> list[tuple[float, int, int]]:
    state = ParallelState.connect(world, world, torch.device("cpu"))
    assert dist.get_world_size() == world
    return [_run_case(state, case, seed, backend) for seed, case in enumerate(CASES)]


# The Triton backend (interpreter) on two ranks: its kernels, the partials' merge included.
# These ranks are CPU processes, so on a CUDA machine (compiled Triton, no interpreter) the
# triton case cannot run; there tests/test_cuda_graph.py runs DCP 2 with it on two GPUs.
TRITON_ON_CPU = pytest.param(
    2, "triton", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                          reason="CPU ranks run Triton only interpreted"))


@pytest.mark.parametrize(("world", "backend"), [(2, "reference"), (4, "reference"),
                                                TRITON_ON_CPU])
def test_dcp_layer_matches_oracle(world: int, backend: str) -> None:
    per_rank = run_ranks(_all_cases, world, world, backend)
    for index, case in enumerate(CASES):
        for rank, results in enumerate(per_rank):
            err, wrong, chunks = results[index]
            assert err < FLOAT32_TOL, f"{case.name}, rank {rank}: error {err:.3g}"
            assert wrong == 0, f"{case.name}, rank {rank}: {wrong} cache slots differ"
            if case.workspace_rows is not None:
                assert chunks > 2, f"{case.name}: only {chunks} context chunks"


@pytest.mark.parametrize(("D", "rank", "interleave"), [(2, 0, 1), (2, 1, 1), (4, 3, 2)])
def test_decode_spec_is_what_build_gives_the_kernels(D: int, rank: int, interleave: int) -> None:
    """CUDA graph staging bypasses build() and reads decode_spec: this rank's slots as
    build() writes them, and per request the positions this rank holds (position p
    belongs to rank (p // interleave) % D), counted here directly."""
    layout = DCPLayout(D, rank, interleave, 4)
    state = SimpleNamespace(dcp_size=D, dcp_rank=rank)
    builder = DCPMetadataBuilder(DIMS, layout, state)
    seq_lens = [1, 2, 3, 5, 8, 41, 17]
    batch = make_paged_batch(DIMS, [1] * len(seq_lens), seq_lens,
                             block_size=layout.virtual_block_size, seed=rank)
    spec = builder.decode_spec(batch.spec)
    meta = builder.build(batch.spec)
    assert spec.seq_lens == [sum((p // interleave) % D == rank for p in range(s))
                             for s in seq_lens]
    assert spec.seq_lens == meta.decode.seq_lens.tolist()
    assert spec.slot_mapping.tolist() == meta.slot_mapping.tolist()
    assert torch.equal(spec.block_table, batch.spec.block_table)
