"""`merge_attn_states` against the reference op: empty partials, in-place merges, and a
large bf16 case on the GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla.ops import reference as ref
from pagedmla.testing import relative_error

pytest.importorskip("triton")

from pagedmla.ops.triton import merge_attn_states
from tests.triton_helpers import ATOL, DEVICE, cuda, runnable


def _merge_inputs(T: int, N: int, D: int, dtype: torch.dtype, seed: int,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    po = torch.randn(T, N, D, generator=gen).to(DEVICE, dtype)
    so = torch.randn(T, N, D, generator=gen).to(DEVICE, dtype)
    # lse as strided [N, T] views: every other column of a wider buffer, and a slice.
    pl = (torch.randn(N, 2 * T, generator=gen) * 3).to(DEVICE)[:, ::2]
    sl = (torch.randn(N, T + 5, generator=gen) * 3).to(DEVICE)[:, 5:]
    # Empty partials (-inf, +inf) with NaN outputs behind them; both empty; huge gap.
    for t, h in ((0, 0), (1, 2), (3, N - 1)):
        pl[h, t] = -math.inf
        po[t, h] = math.nan
    sl[1, 0] = math.inf
    so[0, 1] = math.nan
    pl[2, 4], sl[2, 4] = -math.inf, -math.inf
    po[4, 2] = so[4, 2] = math.nan
    pl[0, 5], sl[0, 5] = 80.0, -80.0
    return po, pl, so, sl


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("D", [24, 128])
def test_merge_matches_reference(dtype: torch.dtype, D: int) -> None:
    po, pl, so, sl = _merge_inputs(9, 5, D, dtype, seed=70 + D)
    out = torch.full_like(po, math.nan)
    out_lse = torch.full((5, 9), math.nan, device=DEVICE)
    merge_attn_states(po, pl, so, sl, out, out_lse)
    want, want_lse = torch.empty_like(po), torch.empty_like(out_lse)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    assert not out.isnan().any() and not out_lse.isnan().any()
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-6)
    assert out_lse[2, 4] == -math.inf and (out[4, 2] == 0).all()


@runnable
def test_merge_in_place_without_lse() -> None:
    # output aliases prefix_output, output_lse aliases prefix_lse (a strided slice);
    # then output alone in place with output_lse None.
    po, pl, so, sl = _merge_inputs(9, 5, 24, torch.float32, seed=80)
    want, want_lse = torch.empty_like(po), torch.empty(5, 9, device=DEVICE)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    buf, lse_buf = po.clone(), pl.clone()
    merge_attn_states(buf, lse_buf, so, sl, buf, lse_buf)
    torch.testing.assert_close(buf, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse_buf, want_lse, atol=1e-5, rtol=1e-6)
    buf = so.clone()
    merge_attn_states(po, pl, buf, sl, buf, None)
    torch.testing.assert_close(buf, want, atol=2e-5, rtol=0)


@pytest.mark.cuda
@cuda
def test_merge_gpu_bf16() -> None:
    po, pl, so, sl = _merge_inputs(2048, 128, 128, torch.bfloat16, seed=600)
    out, out_lse = torch.full_like(po, math.nan), torch.full((128, 2048), math.nan,
                                                              device="cuda")
    merge_attn_states(po, pl, so, sl, out, out_lse)
    want, want_lse = torch.empty_like(po), torch.empty_like(out_lse)
    ref.merge_attn_states(po, pl, so, sl, want, want_lse)
    # Only bf16 rounding of the result separates the two (~1e-5 relative).
    assert relative_error(out, want.double()) < 1e-3
    torch.testing.assert_close(out_lse, want_lse, atol=1e-5, rtol=1e-6)
    # In place over the prefix (as the chunked-context prefill does): the lse is read
    # and written by different warps of one program.
    merge_attn_states(po, pl, so, sl, po, pl)
    assert relative_error(po, want.double()) < 1e-3
    torch.testing.assert_close(pl, want_lse, atol=1e-5, rtol=1e-6)
