"""The attention output quantized to fp8 for o_proj (`ops/output_quant.py`).

The formats against float64 arithmetic, then MLAAttention writing its output quantized
(reference backend, and Triton's fused epilogues in the interpreter) against the float64
dense oracle: every dequantized value within e4m3's rounding of the oracle's (half a
step: 2^-4 of the value, or 2^-10 of the scale below e4m3's normal range) plus float32
attention error. Triton's codes must equal the specification's on the same values
where the kernels compute the same float32 values (the merge, the one-pass
quantization). The fp8 GEMM on quantized activations against the reference GEMM.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedmla import MLAAttention, MLADims, MLAMetadataBuilder
from pagedmla.ops.block_fp8 import FP8_WEIGHT_DTYPE
from pagedmla.ops.output_quant import (
    OutputQuant,
    QuantizedOutput,
    fp8_linear_quantized,
    power_of_two_scales,
    quantize_output,
)
from pagedmla.testing import make_paged_batch

# V 32: groups of 16 and 32 lie inside a head (the kernels' epilogues); 64 spans two
# heads (the fallback passes).
DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=32)
CASES = {
    "decode": ([1, 1, 1], [5, 40, 17]),
    "prompts": ([12, 7], [12, 7]),
    "chunked context": ([1, 9, 14], [30, 44, 14]),
}


def _within_e4m3(deq: torch.Tensor, ref: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Where deq is within half an e4m3 step of ref (step: each element's scale) plus
    float32 attention error."""
    bound = ref.abs() * 2.0**-4 + step * 2.0**-10 + 1e-5 * ref.abs().nan_to_num().max()
    return (deq.double() - ref).abs() <= bound


def _scale_per_element(out: QuantizedOutput) -> torch.Tensor:
    T, C = out.codes.shape
    if out.quant.group is None:
        return out.scales.double().expand(T, C)
    return out.scales.double().repeat_interleave(out.quant.group, dim=1)


def test_power_of_two_scales_against_float64() -> None:
    gen = torch.Generator().manual_seed(1)
    amax = torch.cat([torch.rand(1000, generator=gen) * 10.0 ** torch.randint(
        -30, 30, (1000,), generator=gen), 448.0 * 2.0 ** torch.arange(-20, 20).float(),
        torch.tensor([0.0, math.nan])])
    got = power_of_two_scales(amax)
    for a, s in zip(amax.tolist()[:-2], got.tolist()[:-2]):
        want = 2.0 ** math.ceil(math.log2(a / 448.0)) if a > 0 else 0.0
        assert s == want, (a, s, want)
    assert got[-2] == 0 and math.isnan(got[-1])


@pytest.mark.parametrize("group", [16, 128])
def test_group_format(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(9, 256, generator=gen) * 10.0 ** torch.randint(-3, 4, (9, 1), generator=gen)
    x[2, :group] = 0.0
    x[5, group + 3] = math.nan
    out = QuantizedOutput.empty(9, 256, OutputQuant(group=group), x.device)
    quantize_output(x, out)
    scales = out.scales
    assert scales.shape == (9, 256 // group) and scales.stride(0) == 1
    assert scales[2, 0] == 0 and out.codes[2, :group].float().eq(0).all()
    assert math.isnan(scales[5, 1]) and not scales[5, 0].isnan()
    finite = ~scales.isnan()
    mantissa = scales[finite & (scales > 0)].view(torch.int32) & 0x7FFFFF
    assert mantissa.eq(0).all()  # powers of two
    codes = out.codes.float()
    assert codes[~codes.isnan()].abs().max() <= 448
    ok = _within_e4m3(out.dequantize(), x.double(), _scale_per_element(out))
    rows = finite.repeat_interleave(group, dim=1)
    assert ok[rows].all()


def test_tensor_format_saturates() -> None:
    x = torch.tensor([[0.0, 1.0, -3.3, 1000.0, -1e6, math.nan, 1e-3, 230.0]])
    out = QuantizedOutput.empty(1, 8, OutputQuant(scale=torch.tensor([0.5])), x.device)
    quantize_output(x, out)
    deq = out.dequantize()[0]
    assert deq[3] == deq[7] == 224.0 and deq[4] == -224.0  # 448 * 0.5
    assert math.isnan(deq[5])
    assert _within_e4m3(deq[[0, 1, 2, 6]], x[0, [0, 1, 2, 6]].double(), torch.tensor(0.5)).all()


@pytest.mark.parametrize("kwargs", [dict(), dict(group=12), dict(group=8),
                                    dict(scale=torch.tensor([0.0])),
                                    dict(scale=torch.tensor([1.0, 2.0])),
                                    dict(group=16, scale=torch.tensor([1.0]))])
def test_bad_formats(kwargs) -> None:
    with pytest.raises(ValueError):
        OutputQuant(**kwargs)


def _quant(kind: str) -> OutputQuant:
    if kind == "tensor":
        return OutputQuant(scale=torch.tensor([2.0**-6]))
    return OutputQuant(group=int(kind))


def _layer(case: str, quant: OutputQuant, backend: str, seed: int):
    """(quantized output, unquantized output, oracle) of one step."""
    query_lens, seq_lens = CASES[case]
    batch = make_paged_batch(DIMS, query_lens, seq_lens, block_size=4, seed=seed)
    attn = MLAAttention(DIMS, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj,
                        backend=backend)
    builder = MLAMetadataBuilder(DIMS, block_size=4, workspace_rows=8)
    before = batch.cache.data.clone()
    out = QuantizedOutput.empty(batch.num_tokens, 128, quant, batch.q.device)
    assert attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, builder.build(batch.spec),
                out=out) is out
    batch.cache.data.copy_(before)
    plain = attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, builder.build(batch.spec))
    return out, plain, batch.oracle()


@pytest.mark.parametrize("kind", ["16", "32", "64", "tensor"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_output_quantized(case: str, backend: str, kind: str) -> None:
    out, plain, ref = _layer(case, _quant(kind), backend, seed=len(case) + len(kind))
    assert out.codes.dtype == FP8_WEIGHT_DTYPE
    assert _within_e4m3(out.dequantize(), ref, _scale_per_element(out)).all()
    if backend == "triton" and case != "decode":  # the same float32 values, quantized
        spec = QuantizedOutput.empty(*out.codes.shape, out.quant, out.codes.device)
        quantize_output(plain, spec)
        assert torch.equal(out.codes.view(torch.uint8), spec.codes.view(torch.uint8))
        assert torch.equal(out.scales, spec.scales)


def test_nan_reaches_only_its_groups() -> None:
    batch = make_paged_batch(DIMS, [1, 6], [9, 6], block_size=4, seed=3)
    batch.q[0, 1] = math.nan  # head 1 of the decode row
    attn = MLAAttention(DIMS, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj,
                        backend="triton")
    out = QuantizedOutput.empty(batch.num_tokens, 128, OutputQuant(group=16), batch.q.device)
    attn(batch.q, batch.kv_c, batch.k_pe, batch.cache,
         MLAMetadataBuilder(DIMS, block_size=4).build(batch.spec), out=out)
    nan = out.scales.isnan()
    assert nan[0, 2:4].all() and nan.sum() == 2  # head 1's two groups of 16


def test_layer_rejects_a_quantized_output_of_the_wrong_shape() -> None:
    batch = make_paged_batch(DIMS, [1], [3], block_size=4, seed=0)
    attn = MLAAttention(DIMS, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj)
    meta = MLAMetadataBuilder(DIMS, block_size=4).build(batch.spec)
    wrong = QuantizedOutput.empty(2, 128, OutputQuant(group=16), batch.q.device)
    with pytest.raises(ValueError, match=r"out\.codes must have shape"):
        attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta, out=wrong)


@pytest.mark.parametrize("kind", ["128", "tensor"])
@pytest.mark.parametrize("M", [5, 80])
def test_fp8_linear_on_quantized_activations(kind: str, M: int) -> None:
    """Triton's GEMM (its separate-x path, both tile configurations) on codes and scales
    against the reference: exact products of the same fp8 values, float32 sums."""
    from pagedmla.ops.triton import fp8_linear_quantized as triton_linear

    gen = torch.Generator().manual_seed(M)
    x = QuantizedOutput.empty(M, 256, _quant(kind), torch.device("cpu"))
    quantize_output(torch.randn(M, 256, generator=gen), x)
    weight = (torch.randn(192, 256, generator=gen) * 100).to(FP8_WEIGHT_DTYPE)
    scale_inv = torch.rand(2, 2, generator=gen) / 100
    want = fp8_linear_quantized(x, weight, scale_inv, (128, 128), torch.float32)
    got = triton_linear(x, weight, scale_inv, (128, 128), torch.float32)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_fused_epilogues_on_the_gpu(case: str) -> None:
    """bf16, V 128, groups of 128 (DeepSeek's o_proj): the fused kernels against the
    float64 oracle."""
    dims = MLADims(num_heads=16, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                   v_head_dim=128)
    query_lens, seq_lens = CASES[case]
    batch = make_paged_batch(dims, query_lens, seq_lens, block_size=64, dtype=torch.bfloat16,
                             device="cuda", seed=5)
    attn = MLAAttention(dims, softmax_scale=batch.softmax_scale, kv_b_proj=batch.kv_b_proj,
                        backend="triton")
    meta = MLAMetadataBuilder(dims, block_size=64, device="cuda", workspace_rows=64).build(
        batch.spec)
    out = QuantizedOutput.empty(batch.num_tokens, 2048, OutputQuant(group=128), "cuda")
    attn(batch.q, batch.kv_c, batch.k_pe, batch.cache, meta, out=out)
    ref = batch.oracle().cuda()
    # bf16 attention (~1e-2 of a value) on top of e4m3's rounding.
    deq = out.dequantize().double()
    assert ((deq - ref).abs() <= ref.abs() * (2.0**-4 + 2e-2) + 1e-2 * ref.abs().max()).all()
