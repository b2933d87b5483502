"""MLAAttention(backend="triton") against the float64 oracle: every op of the backend in
one layer call.
"""

from __future__ import annotations

import pytest
import torch

from pagedmla import MLADims
from pagedmla.testing import make_paged_batch, relative_error

pytest.importorskip("triton")

from tests.triton_helpers import DEVICE, SMALL, _run_layer, cuda, runnable


@runnable
@pytest.mark.parametrize(
    ("dims", "cache_dtype", "block_size"),
    [(SMALL, "auto", 16), (SMALL, "fp8", 1),
     (MLADims(num_heads=3, kv_lora_rank=48, qk_nope_head_dim=24, qk_rope_head_dim=0,
              v_head_dim=16), "auto", 64)],
    ids=["float32", "fp8-page1", "nope-page64"],
)
def test_layer_matches_oracle(dims: MLADims, cache_dtype: str, block_size: int) -> None:
    # Decodes (1 and 2 tokens), then prefills with and without context, context forced
    # into several chunks with a continuation: every op of the backend is used.
    q_lens = [1, 2, 1, 7, 5]
    seq_lens = [40, 19, 1, 7, 60]
    batch = make_paged_batch(dims, q_lens, seq_lens, block_size, kv_cache_dtype=cache_dtype,
                             fp8_scale=0.37, seed=160 + block_size, device=DEVICE)
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=max(16, block_size))
    assert not out.isnan().any()
    err = relative_error(out, batch.oracle(decode_threshold=2))
    assert err < 2e-4, f"relative error {err:.3g}"
    assert batch.cache_mismatches() == 0


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_layer_gpu_bf16_oracle(cache_dtype: str) -> None:
    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)
    q_lens = [1, 1, 2, 300, 37]
    seq_lens = [1, 900, 70, 300, 2000]
    batch = make_paged_batch(dims, q_lens, seq_lens, 64, dtype=torch.bfloat16,
                             kv_cache_dtype=cache_dtype, fp8_scale=0.37, seed=700,
                             device="cuda")
    out = _run_layer(batch, "triton", decode_threshold=2, workspace_rows=1024)
    assert relative_error(out, batch.oracle(decode_threshold=2)) < 2e-2
    assert batch.cache_mismatches() == 0
