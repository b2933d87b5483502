"""The model's per-token ops (RMSNorm, RMSNorm after a residual add, the rotary
embedding) of both backends against float64 oracles written here.

The triton kernels run on CPU tensors in Triton's interpreter (float32, float16: see
tests/triton_helpers.py for what the interpreter cannot check) and on the GPU in bf16.
Tolerances: the ops normalise or rotate in float32 and round once to the output dtype
(twice for RMSNorm: the normalised value, then its product with the weight), so the
error is a few units of that dtype's roundoff: 2 ulp of float32 (the float32 sums and
rsqrt add about 1e-6), and one or two of 16-bit dtypes.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmla.ops import REFERENCE

pytest.importorskip("triton")

from pagedmla.ops.triton import TRITON_BACKEND
from pagedmla.ops.triton.moe import block_layout

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
@pytest.mark.parametrize("T,N,P,R", [(3, 1, 8, 4), (2, 16, 16, 64), (4, 5, 0, 8), (2, 3, 8, 12),
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


def _oracle_experts(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token in float64: sum_j weights[t, j] * w2[e] (silu(g) * u), [g | u] =
    w13[e] x[t], e = ids[t, j]; ids >= E contribute nothing."""
    E, two_i, _ = w13.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= E:
                continue
            h = w13[e].double().cpu() @ x[t].double().cpu()
            g, u = h[: two_i // 2], h[two_i // 2 :]
            out[t] += float(weights[t, j]) * (w2[e].double().cpu() @ (g * torch.sigmoid(g) * u))
    return out


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,k,H,inter", [(5, 8, 2, 32, 24), (1, 4, 3, 16, 16), (40, 6, 2, 48, 40),
                                       (0, 4, 2, 16, 16)])
def test_fused_experts(backend, dtype, T, E, k, H, inter) -> None:
    """Random routing with repeated experts, an expert nobody picks and ids >= E (another
    rank's experts); float64 oracle."""
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + k)
    x = _poisoned((T, H), dtype, gen)
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).to(dtype).to(DEVICE)
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).to(dtype).to(DEVICE)
    ids = torch.randint(0, E + 1, (T, k), generator=gen)  # E: dropped
    ids[ids == 1] = 0  # expert 1 gets no token
    weights = torch.rand(T, k, generator=gen)
    out = backend.fused_experts(x, w13, w2, weights.to(DEVICE), ids.to(DEVICE))
    assert out.shape == (T, H) and out.dtype == dtype
    expect = _oracle_experts(x, w13, w2, weights, ids).to(DEVICE)
    # Outputs ~1; 16-bit dtypes round gate/up or the activation once before the down
    # projection (sums over inter of roundoff ~ u * sqrt(inter)).
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}[dtype]
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_fused_experts_gpu_decode_shape_and_graph_capture() -> None:
    """DeepSeek-V2-Lite's expert shapes at a decode batch (128 tokens, 64 experts, top 6):
    the Triton op matches the reference backend in bf16, also replayed from a CUDA graph
    with a different routing than at capture (the layout lives on the device)."""
    gen = torch.Generator().manual_seed(5)
    T, E, k, H, inter = 128, 64, 6, 2048, 1408
    x = (torch.randn(T, H, generator=gen)).bfloat16().cuda()
    w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H**0.5).bfloat16().cuda()
    w2 = (torch.randn(E, H, inter, generator=gen) / inter**0.5).bfloat16().cuda()

    def routing(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        return torch.rand(T, k, generator=g).cuda(), ids.cuda()

    weights, ids = routing(1)
    static = (x.clone(), weights.clone(), ids.clone())
    TRITON_BACKEND.fused_experts(*static[:1], w13, w2, *static[1:])  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON_BACKEND.fused_experts(static[0], w13, w2, static[1], static[2])
    for seed in (2, 3):
        weights, ids = routing(seed)
        static[1].copy_(weights)
        static[2].copy_(ids)
        graph.replay()
        expect = REFERENCE.fused_experts(x, w13, w2, weights, ids)
        err = (out.float() - expect.float()).norm() / expect.float().norm()
        assert err < 1e-2, f"relative error {err:.2e}"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_block_layout_places_every_pair_once_in_blocks_of_one_expert(data) -> None:
    """The experts' sorted layout, checked directly: every pair with an id < E sits in
    exactly one row, of a block whose expert is its own, in order of pair index within
    an expert; nothing else holds a pair; blocks past the used ones say E."""
    E = data.draw(st.integers(1, 9), label="experts")
    T = data.draw(st.integers(1, 12), label="tokens")
    k = data.draw(st.integers(1, min(E, 4)), label="k")
    block_m = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_m")
    ids = torch.tensor(data.draw(st.lists(st.integers(0, E + 2), min_size=T * k,
                                          max_size=T * k))).view(T, k)
    block_expert, row_pair = block_layout(ids, E, block_m)
    assert block_expert.shape == (-(-T * k // block_m) + E,)
    assert row_pair.shape == (block_expert.shape[0] * block_m,)
    flat = ids.view(-1).tolist()
    rows = row_pair.tolist()
    experts = block_expert.tolist()
    placed = [p for p in rows if p >= 0]
    assert sorted(placed) == [p for p, e in enumerate(flat) if e < E]
    for block, expert in enumerate(experts):
        pairs = [p for p in rows[block * block_m : (block + 1) * block_m] if p >= 0]
        if expert == E:
            assert not pairs
        else:
            assert pairs and all(flat[p] == expert for p in pairs)
    used = [e for e in experts if e < E]
    assert experts == sorted(used) + [E] * (len(experts) - len(used))  # by expert, used first
    for expert in set(used):
        in_order = [p for b, e in enumerate(experts) if e == expert
                    for p in rows[b * block_m : (b + 1) * block_m] if p >= 0]
        assert in_order == sorted(in_order)
