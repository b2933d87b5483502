"""merge_attn_states against the direct formula, including every empty-partial case."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmla import merge_attn_states
from pagedmla.ops.registry import get_backend

INF = math.inf
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def direct_merge(out_p, lse_p, out_s, lse_s) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook formula in float64, for finite lse only: outputs [T,N,D], lse [N,T]."""
    lp = lse_p.double().T.unsqueeze(-1)
    ls = lse_s.double().T.unsqueeze(-1)
    wp, ws = torch.exp(lp), torch.exp(ls)
    out = (wp * out_p.double() + ws * out_s.double()) / (wp + ws)
    return out, torch.log(wp + ws).squeeze(-1).T


def random_partials(T: int, N: int, D: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    out_p = torch.randn(T, N, D, generator=gen).to(dtype)
    out_s = torch.randn(T, N, D, generator=gen).to(dtype)
    # lse spread over a wide range so that one side often dominates.
    lse_p = torch.randn(N, T, generator=gen) * 8
    lse_s = torch.randn(N, T, generator=gen) * 8
    return out_p, lse_p, out_s, lse_s


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 9), st.integers(1, 70), st.integers(0, 2**31 - 1))
def test_matches_direct_formula(T: int, N: int, D: int, seed: int) -> None:
    # float32 computation vs float64 formula: a few roundings of 6e-8 -> 1e-5 is ample.
    out_p, lse_p, out_s, lse_s = random_partials(T, N, D, seed)
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    want, want_lse = direct_merge(out_p, lse_p, out_s, lse_s)
    assert out.shape == (T, N, D) and out.dtype == torch.float32
    assert lse.shape == (N, T) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


def test_large_lse_does_not_overflow() -> None:
    # exp(lse) overflows float32 (and float64) here; a stable merge must not care.
    out_p, lse_p, out_s, lse_s = random_partials(5, 3, 8, seed=1)
    out, lse = merge_attn_states(out_p, lse_p + 1000, out_s, lse_s + 1000)
    want, want_lse = direct_merge(out_p, lse_p, out_s, lse_s)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse + 1000, rtol=1e-6, atol=1e-4)


def test_bfloat16_outputs() -> None:
    # bf16 in and out: one final rounding to bf16 (unit roundoff 4e-3) dominates.
    out_p, lse_p, out_s, lse_s = random_partials(16, 4, 32, seed=2, dtype=torch.bfloat16)
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    want, want_lse = direct_merge(out_p, lse_p, out_s, lse_s)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("empty", [-INF, INF])
@pytest.mark.parametrize("side", ["prefix", "suffix"])
def test_one_side_empty_returns_the_other_exactly(empty: float, side: str) -> None:
    # Rows 0, 2, 5 of head 1 and all of row 3 are empty on one side (output 0, lse +-inf).
    out_p, lse_p, out_s, lse_s = random_partials(6, 3, 16, seed=3)
    out_e, lse_e = (out_p, lse_p) if side == "prefix" else (out_s, lse_s)
    full_out, full_lse = (out_s, lse_s) if side == "prefix" else (out_p, lse_p)
    cells = [(1, 0), (1, 2), (1, 5), (0, 3), (1, 3), (2, 3)]
    for head, t in cells:
        lse_e[head, t] = empty
        out_e[t, head] = 0
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for head, t in cells:
        assert torch.equal(out[t, head], full_out[t, head])
        assert lse[head, t] == full_lse[head, t]
    # The other cells are ordinary merges.
    want, want_lse = direct_merge(out_p, lse_p, out_s, lse_s)
    mask = torch.ones(3, 6, dtype=torch.bool)
    for head, t in cells:
        mask[head, t] = False
    torch.testing.assert_close(out.double()[mask.T], want[mask.T], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double()[mask], want_lse[mask], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize(("lse_a", "lse_b"), [(-INF, -INF), (INF, INF), (-INF, INF),
                                              (INF, -INF)])
def test_both_empty_gives_zero_and_minus_inf(lse_a: float, lse_b: float) -> None:
    T, N, D = 4, 2, 8
    out, lse = merge_attn_states(
        torch.zeros(T, N, D), torch.full((N, T), lse_a), torch.zeros(T, N, D),
        torch.full((N, T), lse_b),
    )
    assert torch.equal(out, torch.zeros(T, N, D))
    assert torch.equal(lse, torch.full((N, T), -INF))


def test_merge_with_empty_is_identity_for_whole_tensors() -> None:
    # merge((0, -inf), x) = x and merge(x, (0, -inf)) = x, bit for bit.
    x_out, x_lse, _, _ = random_partials(7, 5, 12, seed=4)
    empty_out, empty_lse = torch.zeros_like(x_out), torch.full_like(x_lse, -INF)
    for args in ((empty_out, empty_lse, x_out, x_lse), (x_out, x_lse, empty_out, empty_lse)):
        out, lse = merge_attn_states(*args)
        assert torch.equal(out, x_out) and torch.equal(lse, x_lse)


def test_writes_into_given_outputs() -> None:
    out_p, lse_p, out_s, lse_s = random_partials(8, 3, 16, seed=5)
    want, want_lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    output = torch.full_like(out_p, math.nan)
    output_lse = torch.full_like(lse_p, math.nan)
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s, output=output, output_lse=output_lse)
    assert out.data_ptr() == output.data_ptr() and lse.data_ptr() == output_lse.data_ptr()
    assert torch.equal(output, want) and torch.equal(output_lse, want_lse)


@pytest.mark.parametrize("alias", ["prefix", "suffix"])
def test_outputs_may_alias_inputs(alias: str) -> None:
    out_p, lse_p, out_s, lse_s = random_partials(9, 4, 16, seed=6)
    lse_p[0, 1] = -INF
    out_p[1, 0] = 0
    want, want_lse = merge_attn_states(out_p, lse_p, out_s, lse_s)
    target_out, target_lse = (out_p, lse_p) if alias == "prefix" else (out_s, lse_s)
    out, lse = merge_attn_states(out_p, lse_p, out_s, lse_s, output=target_out,
                                 output_lse=target_lse)
    assert out.data_ptr() == target_out.data_ptr() and lse.data_ptr() == target_lse.data_ptr()
    assert torch.equal(target_out, want) and torch.equal(target_lse, want_lse)


def test_aliased_row_slices_like_a_running_partial() -> None:
    # The layer merges a chunk into the rows of a running partial in place.
    out_p, lse_p, out_s, lse_s = random_partials(10, 2, 8, seed=7)
    want, want_lse = merge_attn_states(out_p[3:7], lse_p[:, 3:7], out_s[:4], lse_s[:, :4])
    merge_attn_states(out_p[3:7], lse_p[:, 3:7], out_s[:4], lse_s[:, :4],
                      output=out_p[3:7], output_lse=lse_p[:, 3:7])
    assert torch.equal(out_p[3:7], want) and torch.equal(lse_p[:, 3:7], want_lse)


def test_shape_and_dtype_validation() -> None:
    out_p, lse_p, out_s, lse_s = random_partials(6, 3, 8, seed=8)
    with pytest.raises(ValueError, match="suffix_output"):
        merge_attn_states(out_p, lse_p, out_s[:5], lse_s)
    with pytest.raises(ValueError, match="suffix_output"):
        merge_attn_states(out_p, lse_p, out_s[..., :4], lse_s)
    with pytest.raises(ValueError, match="prefix_lse"):
        merge_attn_states(out_p, lse_p.T.contiguous(), out_s, lse_s)  # [T, N], not [N, T]
    with pytest.raises(ValueError, match="suffix_lse"):
        merge_attn_states(out_p, lse_p, out_s, lse_s[:2])
    with pytest.raises(ValueError, match="prefix_output"):
        merge_attn_states(out_p[0], lse_p, out_s, lse_s)
    with pytest.raises(TypeError, match="prefix_lse"):
        merge_attn_states(out_p, lse_p.half(), out_s, lse_s)
    with pytest.raises(TypeError, match="suffix_output"):
        merge_attn_states(out_p, lse_p, out_s.double(), lse_s)
    with pytest.raises(ValueError, match="output"):
        merge_attn_states(out_p, lse_p, out_s, lse_s, output=torch.empty(6, 3, 7))
    with pytest.raises(ValueError, match="output_lse"):
        merge_attn_states(out_p, lse_p, out_s, lse_s, output_lse=torch.empty(6, 3))
    with pytest.raises(TypeError, match="prefix_output"):
        merge_attn_states(out_p.numpy(), lse_p, out_s, lse_s)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_outputs_are_refused(backend: str, dtype: torch.dtype) -> None:
    # Both backends would store a float merge into integers, truncated, without a word.
    out_p, lse_p, out_s, lse_s = (t.to(DEVICE) for t in random_partials(4, 2, 8, seed=9))
    output = torch.ones(4, 2, 8, dtype=dtype, device=DEVICE)
    with pytest.raises(TypeError, match=f"output must be floating point, got {dtype}"):
        merge_attn_states(out_p, lse_p, out_s, lse_s, output=output, backend=backend)
    assert output.all(), "a refused merge must not write"
    with pytest.raises(TypeError, match="output_lse must be float32"):
        merge_attn_states(out_p, lse_p, out_s, lse_s,
                          output_lse=torch.zeros(2, 4, dtype=dtype, device=DEVICE),
                          backend=backend)


def _oracle_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The D-way log-sum-exp merge in float64, one (token, head) at a time: the finite
    lse's partials weighted by exp(lse); none finite -> 0."""
    D, T, N, L = out.shape
    merged = torch.zeros(T, N, L, dtype=torch.float64)
    for t in range(T):
        for n in range(N):
            live = [d for d in range(D) if math.isfinite(lse[d, t, n].item())]
            if not live:
                continue
            logs = torch.tensor([lse[d, t, n].item() for d in live], dtype=torch.float64)
            weights = torch.softmax(logs, dim=0)
            for w, d in zip(weights, live, strict=True):
                merged[t, n] += w * out[d, t, n].double()
    return merged


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize(("D", "T", "N", "L"), [(1, 3, 2, 16), (2, 5, 3, 40), (3, 4, 2, 64),
                                                (4, 2, 5, 24)])
def test_merge_partials(backend: str, D: int, T: int, N: int, L: int) -> None:
    """Decode context parallel partials, laid out as DCPDecode receives them (outputs and
    lse packed in one [D, T, N, L + 1] buffer, so both are strided), against the float64
    oracle: empty partials (lse -inf or +inf, output NaN: never read) in random places,
    one row empty in every partial (0 out)."""
    gen = torch.Generator().manual_seed(D * 1000 + T * 10 + N)
    packed = torch.randn(D, T, N, L + 1, generator=gen)
    packed[..., L] = torch.randn(D, T, N, generator=gen) * 6
    empty = torch.rand(D, T, N, generator=gen) < 0.3
    empty[:, 0, 0] = True
    packed[..., L][empty] = torch.where(torch.rand(int(empty.sum()), generator=gen) < 0.5,
                                        -INF, INF)
    packed[..., :L][empty] = float("nan")
    on_device = packed.to(DEVICE)  # Triton compiles for CUDA tensors, interprets CPU ones
    out, lse = on_device[..., :L], on_device[..., L]
    merged = get_backend(backend, DEVICE).merge_partials(out, lse, torch.float32).cpu()
    assert merged.shape == (T, N, L) and merged.dtype == torch.float32
    want = _oracle_partials(packed[..., :L], packed[..., L])
    assert torch.allclose(merged.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(merged[0, 0], torch.zeros(L))
