"""The model's per-token ops (RMSNorm, RMSNorm after a residual add, the rotary
embedding) of both backends against float64 oracles written here.

The triton kernels run on CPU tensors in Triton's interpreter (float32, float16: see
tests/test_triton_ops.py for what the interpreter cannot check) and on the GPU in bf16.
Tolerances: the ops normalise or rotate in float32 and round once to the output dtype
(twice for RMSNorm: the normalised value, then its product with the weight), so the
error is a few units of that dtype's roundoff: 2 ulp of float32 (the float32 sums and
rsqrt add about 1e-6), and one or two of 16-bit dtypes.
"""

from __future__ import annotations

import pytest
import torch

from pagedmla.ops import REFERENCE

pytest.importorskip("triton")

from pagedmla.ops.triton import TRITON_BACKEND

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
BACKENDS = [REFERENCE, TRITON_BACKEND]
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Max abs error per output of magnitude ~1-3: float32 math rounded to the dtype.
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _oracle_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return weight.double() * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)


def _oracle_rope(x: torch.Tensor, angle_cos: torch.Tensor, angle_sin: torch.Tensor,
                 interleaved: bool) -> torch.Tensor:
    """Rotate pairs as complex numbers (a + ib) * (cos + i sin) in float64; returns
    [real parts | imaginary parts]."""
    x64 = x.double()
    R = x.shape[-1]
    if interleaved:
        pairs = x64.reshape(*x.shape[:-1], R // 2, 2)
    else:
        pairs = torch.stack((x64[..., : R // 2], x64[..., R // 2 :]), dim=-1)
    z = torch.view_as_complex(pairs.contiguous())
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    turn = torch.complex(angle_cos.double(), angle_sin.double()).view(shape)
    w = z * turn
    return torch.cat((w.real, w.imag), dim=-1)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of magnitude ~1 in a buffer whose unused tail columns are NaN."""
    x = torch.full((*shape[:-1], shape[-1] + 8), float("nan"), dtype=dtype, device=DEVICE)
    x[..., : shape[-1]] = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    return x[..., : shape[-1]]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,D", [(1, 16), (5, 48), (3, 512), (2, 7)])
def test_rms_norm(backend, dtype, T, D) -> None:
    gen = torch.Generator().manual_seed(T * 1000 + D)
    x = _poisoned((T, D), dtype, gen)  # rows strided (NaN columns between them)
    weight = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
    out = backend.rms_norm(x, weight, 1e-6)
    assert out.shape == (T, D) and out.dtype == dtype
    torch.testing.assert_close(out.double(), _oracle_norm(x, weight, 1e-6).to(DEVICE),
                               atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,D", [(1, 16), (6, 40), (2, 2048)])
def test_add_rms_norm(backend, dtype, T, D) -> None:
    gen = torch.Generator().manual_seed(T * 1000 + D + 1)
    x, residual = _poisoned((T, D), dtype, gen), _poisoned((T, D), dtype, gen)
    weight = (1 + 0.5 * torch.randn(D, generator=gen)).to(dtype).to(DEVICE)
    out, total = backend.add_rms_norm(x, residual, weight, 1e-5)
    # The sum is the dtype's own rounding of x + residual, exactly.
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out.double(), _oracle_norm(total, weight, 1e-5).to(DEVICE),
                               atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "half"])
@pytest.mark.parametrize("T,N,P,R", [(3, 1, 8, 4), (2, 16, 16, 64), (4, 5, 0, 8),
                                     (1, 128, 128, 64)])
def test_rotary(backend, dtype, interleaved, T, N, P, R) -> None:
    gen = torch.Generator().manual_seed(T + N + P + R)
    q = torch.randn(T, N, P + R, generator=gen).to(dtype).to(DEVICE)
    latent = _poisoned((T, 24 + R), dtype, gen)
    k_pe = latent[:, 24:]  # strided rows, as the model's slice of its kv projection
    angles = torch.rand(T, R // 2, generator=gen, dtype=torch.float64) * 100
    cos, sin = (1.3 * angles.cos()).float().to(DEVICE), (1.3 * angles.sin()).float().to(DEVICE)
    q_nope = q[..., :P].clone()
    expect_q = _oracle_rope(q[..., P:], cos, sin, interleaved)
    expect_k = _oracle_rope(k_pe, cos, sin, interleaved)
    rotated = backend.rotary(q, k_pe, cos, sin, interleaved)
    assert rotated.shape == (T, R) and rotated.is_contiguous() and rotated.dtype == dtype
    assert torch.equal(q[..., :P], q_nope)  # the nope part is left alone
    tol = 1.3 * 2 * TOL[dtype]  # |cos| + |sin| <= 1.3 sqrt(2) scales the inputs
    torch.testing.assert_close(rotated.double(), expect_k, atol=tol, rtol=0)
    torch.testing.assert_close(q[..., P:].double(), expect_q, atol=tol, rtol=0)
