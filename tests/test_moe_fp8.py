"""Block-fp8 routed experts (`ops/block_fp8.py` layout) of both backends against a
float64 oracle written here.

The oracle dequantizes each weight block by hand and runs the pairs token by token. The
reference backend dequantizes the weights and computes in x's dtype (no activation
quantization): it must match the oracle without quantization. The Triton kernels also
quantize the activations to e4m3 per token and bk group (x, then silu(gate) * up); the
oracle emulates that with torch's float8 cast. x's quantization is the same float32
arithmetic in both, so it matches bit for bit (checked directly). The intermediate's
cannot: the kernel's float32 sums differ from float64 in the last bits, and an element
within that difference of a rounding midpoint may land one e4m3 step (2^-3 relative)
away. So the oracle gives each output element a slack: for every intermediate element,
the distance to the e4m3 values its error interval reaches, carried through |w2|, plus
eps times the sum of absolute terms (eps 1e-4 for float32 in the interpreter, 1e-3 for
the GPU's fp8 tensor-core sums); the relative L2 error must also stay below 3e-3, an
order below the ~3% by which skipping the activation quantization would miss.
"""

from __future__ import annotations

import pytest
import torch

from pagedmla.ops import REFERENCE
from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE
from pagedmla.ops.block_fp8 import quantize_activations as spec_quantize

pytest.importorskip("triton")

from pagedmla.ops.triton import TRITON_BACKEND
from pagedmla.ops.triton.fp8_quant import quantize_activations

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
FP8_GPU = ON_GPU and torch.cuda.get_device_capability() >= (8, 9)


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """A [ceil(rows / bn), ceil(cols / bk)] scale grid as one float64 scale per element."""
    return (scale.double().repeat_interleave(block[0], 0)
            .repeat_interleave(block[1], 1)[:rows, :cols])


def _fake_quant(v: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """v [M, K] float32 -> (e4m3 values as float64, scale per element float64): one scale
    per row and group of `group` columns, amax / 448 in float32, a zero group scale 0.
    Computed on the CPU (CUDA's tensor / scalar multiplies by the reciprocal, which
    rounds some scales one ulp away from the kernels' IEEE division), on v's device."""
    M, K = v.shape
    pad = -K % group
    grouped = torch.nn.functional.pad(v.cpu(), (0, pad)).view(M, -1, group)
    s = grouped.abs().amax(-1, keepdim=True) / 448.0
    q = (grouped / torch.where(s == 0, 1.0, s)).to(FP8_WEIGHT_DTYPE).double()
    scale = s.double().expand_as(grouped)
    return (q.reshape(M, -1)[:, :K].to(v.device), scale.reshape(M, -1)[:, :K].to(v.device))


def _oracle(x, w13, s13, w2, s2, weights, ids, block, quantize: bool, eps: float = 0.0):
    """(expected [T, H] float64, allowed error [T, H]) of the routed experts, on DEVICE
    (float64 is slow on the CPU at DeepSeek's widths).

    quantize: emulate the activation quantization (x, then the intermediate, per bk
    group), with the slack described in the module docstring."""
    x, w13, s13, w2, s2 = (t.to(DEVICE) for t in (x, w13, s13, w2, s2))
    E, two_i, H = w13.shape
    inter, bk = two_i // 2, block[1]
    xd = x.double()
    if quantize:
        q, s = _fake_quant(x.float(), bk)
        xd = q * s
    out = torch.zeros(x.shape[0], H, dtype=torch.float64, device=DEVICE)
    slack = torch.zeros_like(out)
    for t, (row_ids, row_weights) in enumerate(zip(ids.tolist(), weights.tolist())):
        for e, weight in zip(row_ids, row_weights):
            if e >= E:
                continue
            gate_w = w13[e, :inter].double() * _expand(s13[e, 0], inter, H, block)
            up_w = w13[e, inter:].double() * _expand(s13[e, 1], inter, H, block)
            down_w = w2[e].double() * _expand(s2[e], H, inter, block)
            g, u = gate_w @ xd[t], up_w @ xd[t]
            act = g * torch.sigmoid(g) * u
            a_d, act_slack = act, torch.zeros_like(act)
            if quantize:
                # |error| of the kernel's act: eps of its terms' magnitudes (silu' < 1.1).
                err = eps * (1.1 * (gate_w.abs() @ xd[t].abs()) * u.abs()
                             + (g * torch.sigmoid(g)).abs() * (up_w.abs() @ xd[t].abs()))
                q, s = _fake_quant(act.float()[None], bk)
                q, s = q[0], s[0]
                safe = torch.where(s == 0, 1.0, s)
                # The group's scale moves with its amax, by the group's largest err.
                err = err + act.abs() * _fake_quant(err.float()[None], bk)[1][0] / safe
                # The kernel saturates at +-448 (a cast past it would be NaN).
                lo = ((act - err) / safe).clamp(-448, 448).float().to(FP8_WEIGHT_DTYPE)
                hi = ((act + err) / safe).clamp(-448, 448).float().to(FP8_WEIGHT_DTYPE)
                lo, hi = lo.double(), hi.double()
                a_d = q * s
                act_slack = torch.maximum(hi - q, q - lo) * s + err
            out[t] += weight * (down_w @ a_d)
            slack[t] += weight * (down_w.abs() @ (act_slack + eps * a_d.abs()))
    return out, slack


def _experts(E: int, H: int, inter: int, block: tuple[int, int], gen: torch.Generator):
    """Random e4m3 w13 [E, 2I, H], w2 [E, H, I] (values up to ~100) and their scales, so
    that the dequantized weights are ~1 / sqrt(width), scales varying by block."""
    def weight(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(E, rows, cols, generator=gen) * 30).to(FP8_WEIGHT_DTYPE)

    def scales(*grid: int, width: int) -> torch.Tensor:
        return (0.5 + torch.rand(*grid, generator=gen)) / (30 * width**0.5)

    bn, bk = block
    s13 = scales(E, 2, -(-inter // bn), -(-H // bk), width=H)
    s2 = scales(E, -(-H // bn), -(-inter // bk), width=inter)
    return weight(2 * inter, H), s13, weight(H, inter), s2


def _inputs(T: int, E: int, k: int, H: int, inter: int, block, seed: int, dtype):
    gen = torch.Generator().manual_seed(seed)
    w13, s13, w2, s2 = _experts(E, H, inter, block, gen)
    x = (torch.randn(T, H, generator=gen) * 2).to(dtype)
    ids = torch.randint(0, E + 1, (T, k), generator=gen)  # E: another rank's, dropped
    weights = torch.rand(T, k, generator=gen)
    return x, w13, s13, w2, s2, weights, ids


def _run(backend, x, w13, s13, w2, s2, weights, ids, block) -> torch.Tensor:
    dev = [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]
    return backend.fused_experts(*dev, block_size=block)


def _check(out: torch.Tensor, expect: torch.Tensor, slack: torch.Tensor) -> None:
    out = out.double()
    excess = ((out - expect).abs() - slack).clamp(min=0)
    assert excess.max() == 0, f"outside the slack by {excess.max():.3e}"
    rel = float((out - expect).norm() / expect.norm())
    assert rel < 3e-3, f"relative error {rel:.2e}"


BLOCKS = [(128, 128), (64, 32)]


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_reference_fused_experts_fp8_matches_oracle(block) -> None:
    """H and I not multiples of the blocks (partial edge blocks), ids >= E skipped: the
    reference dequantizes per call and computes in float32."""
    args = _inputs(5, 4, 2, 200, 72, block, seed=1, dtype=torch.float32)
    out = _run(REFERENCE, *args, block)
    expect, _ = _oracle(*args, block, quantize=False)
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_quantize_activations_small_matches_spec_bits(block) -> None:
    """The Triton quantization kernel against `block_fp8.quantize_activations` bit for
    bit: a partial last group, a zero group, huge and tiny magnitudes; NaN gives its
    group a NaN scale."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(19, 200, generator=gen) * torch.logspace(-6, 6, 19)[:, None]
    x[3, : block[1]] = 0
    x[5, 7] = float("nan")
    q, s = quantize_activations(x.to(DEVICE), block[1])
    want_q, want_s = spec_quantize(x, block[1])
    assert torch.equal(s.cpu().isnan(), want_s.isnan()) and s.cpu()[5, 0].isnan()
    finite = ~want_s.isnan()
    assert torch.equal(s.cpu()[finite], want_s[finite])
    rows_ok = finite.all(1)
    assert torch.equal(q.cpu()[rows_ok].view(torch.uint8), want_q[rows_ok].view(torch.uint8))
    assert (s.cpu()[3, 0] == 0) and (q.cpu()[3, : block[1]].float() == 0).all()


@pytest.mark.skipif(ON_GPU and not FP8_GPU, reason="fp8 dots need compute capability 8.9")
@pytest.mark.parametrize("block", BLOCKS, ids=str)
def test_fused_experts_fp8_small(block) -> None:
    """The Triton fp8 path on odd widths (H 200, I 72), a NaN in one token's x (that
    token's row is NaN, the others are not), ids >= E and an expert nobody picks."""
    x, w13, s13, w2, s2, weights, ids = _inputs(6, 5, 2, 200, 72, block, seed=3,
                                                dtype=torch.float32)
    ids[ids == 1] = 0
    x[4, 150] = float("nan")
    out = _run(TRITON_BACKEND, x, w13, s13, w2, s2, weights, ids, block)
    assert out.shape == x.shape and out.dtype == x.dtype
    nan_row = torch.zeros(6, dtype=torch.bool)
    nan_row[4] = bool((ids[4] < 5).any())
    assert torch.equal(out.isnan().all(1).cpu(), nan_row)
    assert not out[~nan_row.to(DEVICE)].isnan().any()
    keep = ~nan_row
    expect, slack = _oracle(x[keep], w13, s13, w2, s2, weights[keep], ids[keep], block,
                            quantize=True, eps=1e-3 if ON_GPU else 1e-4)
    _check(out[keep.to(DEVICE)], expect, slack)


@pytest.mark.cuda
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU of compute capability >= 8.9")
@pytest.mark.parametrize("T", [1, 8, 128, 2048])
def test_fused_experts_fp8_gpu_deepseek_widths(T) -> None:
    """DeepSeek-V3's expert widths (H 7168, I 2048, 128 x 128 blocks, top 8) on 32
    experts (a TP 8 rank's share), bf16 x, decode to prefill token counts. The oracle
    runs on a sample of tokens (float64 on the CPU is slow at these widths)."""
    block = (128, 128)
    args = _inputs(T, 32, 8, 7168, 2048, block, seed=T, dtype=torch.bfloat16)
    out = _run(TRITON_BACKEND, *args, block)
    sample = torch.arange(T)[:: max(1, T // 8)]
    x, w13, s13, w2, s2, weights, ids = args
    expect, slack = _oracle(x[sample], w13, s13, w2, s2, weights[sample], ids[sample], block,
                            quantize=True, eps=1e-3)
    # bf16 output: one more rounding (2^-9 relative) on top of the slack.
    _check(out[sample.cuda()], expect, slack + expect.abs() * 2**-8)


@pytest.mark.cuda
@pytest.mark.skipif(not FP8_GPU, reason="needs a CUDA GPU of compute capability >= 8.9")
def test_fused_experts_fp8_gpu_graph_replay_equals_eager() -> None:
    """Captured once, replayed with other routings (ids >= E among them): bit for bit the
    eager op's output (the layout and the scales live on the device)."""
    block = (128, 128)
    x, w13, s13, w2, s2, weights, ids = _inputs(8, 32, 8, 7168, 2048, block, seed=9,
                                                dtype=torch.bfloat16)
    w13, s13, w2, s2 = (t.cuda() for t in (w13, s13, w2, s2))
    static = [x.cuda(), weights.cuda(), ids.cuda()]

    def call():
        return TRITON_BACKEND.fused_experts(static[0], w13, w2, static[1], static[2], s13,
                                            s2, block_size=block)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for seed in (10, 11):
        new = _inputs(8, 32, 8, 7168, 2048, block, seed=seed, dtype=torch.bfloat16)
        for buffer, value in zip(static, (new[0], new[5], new[6])):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(out, call())
