"""The fp8_ds_mla cache (`kv_cache_dtype="fp8_ds_mla"`): its bytes entry by entry, its
scales at their edges, what reads it back, and where it is refused.

The expected bytes are worked out here from the format's definition (struct packing,
e4m3 and bfloat16 bit patterns by hand), not by the package's encoders. Both backends'
writers are checked (the Triton one under the interpreter on the CPU).
"""

from __future__ import annotations

import importlib.util
import math
import struct

import pytest
import torch

from pagedmla import LatentKVCache, MLADims
from pagedmla.cache import DS_MLA_BYTES, resolve_cache_dtype
from pagedmla.engine.args import EngineArgs
from pagedmla.ops.registry import get_backend
from pagedmla.testing import make_paged_batch
from tests.test_attention_oracle import FLOAT32_TOL, run, run_and_check

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton"))]
DS_DIMS = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64,
                  v_head_dim=32)


def _e4m3_byte(value: float) -> int:
    """The e4m3 (fn) byte of a value that e4m3 holds exactly: sign, 4 exponent bits
    (bias 7), 3 mantissa bits; exponent field 0 is subnormal (f x 2^-9)."""
    sign = 0x80 if math.copysign(1.0, value) < 0 else 0
    magnitude = abs(value)
    if magnitude == 0:
        return sign
    mantissa, exponent = math.frexp(magnitude)  # magnitude = mantissa x 2^exponent
    field = exponent - 1 + 7
    if field >= 1:
        fraction = (2 * mantissa - 1) * 8
    else:
        field, fraction = 0, magnitude / 2**-9
    assert fraction == int(fraction) and field <= 15, value
    return sign | field << 3 | int(fraction)


def _bf16_bits(value: float) -> int:
    """The bfloat16 bit pattern of a value that bfloat16 holds exactly."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    assert bits & 0xFFFF == 0, value
    return bits >> 16


def _known_token() -> tuple[torch.Tensor, torch.Tensor, list[float], list[float],
                            list[float]]:
    """kv_c [512], k_pe [64] float32 of one token with its expected e4m3 values (codes;
    the value is code x its group's scale), scales and bfloat16 rope values, worked out
    by hand (all values hold in bfloat16 too):
    group 0: amax 3 -> 3 / 448 in (2^-8, 2^-7]: scale 2^-7; values 3 (code 384), 1.0625
      x 2^-7 (a tie between codes 1 and 1.125: even, 1), 2^-16 (the smallest subnormal
      code, 2^-9) and -0.5;
    group 1: all zero -> scale 2^-126 (the floor), codes 0;
    group 2: amax 448 x 8 exactly -> scale 8 (no rounding up), code 448;
    group 3: amax 3584 x (1 + 2^-7) -> scale 16, code 224 (225.75 rounded down);
    rope: 1 + 2^-8 (a tie: even, 1), 1 + 3 x 2^-8 (a tie: even, 1 + 2^-6), -2.5, rest 0.25.
    """
    kv_c = torch.zeros(512)
    codes = [0.0] * 512
    kv_c[0], codes[0] = 3.0, 384.0
    kv_c[1], codes[1] = 1.0625 * 2**-7, 1.0
    kv_c[2], codes[2] = 2**-16, 2**-9
    kv_c[127], codes[127] = -0.5, -64.0
    kv_c[256], codes[256] = 3584.0, 448.0
    kv_c[300], codes[300] = -1.0, -0.125
    kv_c[384] = 3584.0 * (1 + 2**-7)
    codes[384] = 224.0
    kv_c[400], codes[400] = 2.0, 0.125
    scales = [2**-7, 2**-126, 8.0, 16.0]
    k_pe = torch.full((64,), 0.25)
    k_pe[0], k_pe[1], k_pe[2] = 1 + 2**-8, 1 + 3 * 2**-8, -2.5
    rope = [1.0, 1 + 2**-6, -2.5] + [0.25] * 61
    return kv_c, k_pe, codes, scales, rope


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_bytes_field_by_field(backend: str, dtype: torch.dtype) -> None:
    ops = get_backend(backend, "cpu")
    cache = LatentKVCache(3, 4, 512, 64, kv_cache_dtype="fp8_ds_mla", dtype=dtype)
    assert cache.data.shape == (3, 4, 656) and cache.data.dtype == torch.uint8
    assert cache.is_ds_mla and not cache.is_fp8 and cache.width == 576
    cache.data.fill_(0xFF)  # poison: NaN in every field
    kv_c, k_pe, codes, scales, rope = _known_token()
    # Token 1 is token 0 negated and halved: the same codes negated (-0.0 included),
    # scales halved but the zero group's (the floor).
    batch_kv = torch.stack([kv_c, -kv_c / 2, kv_c]).to(dtype)
    batch_pe = torch.stack([k_pe, -k_pe / 2, k_pe]).to(dtype)
    if dtype == torch.bfloat16:  # (bf16 inputs: the rope ties are already rounded)
        assert batch_pe[0, 1].item() == 1 + 2**-6
    slots = torch.tensor([5, 10, -1])
    ops.write_cache(cache.data, batch_kv, batch_pe, slots, cache.scale)

    flat = cache.data.view(-1, 656)
    halved = [scales[0] / 2, scales[1], scales[2] / 2, scales[3] / 2]
    for slot, sign, factor, token_scales in ((5, 1.0, 1.0, scales), (10, -1.0, 0.5, halved)):
        entry = bytes(flat[slot].tolist())
        assert len(entry) == DS_MLA_BYTES
        want_codes = bytes(_e4m3_byte(sign * c) for c in codes)
        assert entry[:512] == want_codes, [i for i in range(512)
                                           if entry[i] != want_codes[i]][:8]
        assert entry[512:528] == struct.pack("<4f", *token_scales)
        want_rope = struct.pack("<64H", *(_bf16_bits(sign * factor * r) for r in rope))
        assert entry[528:] == want_rope
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[[5, 10]] = False
    assert (flat[untouched] == 0xFF).all()

    # Read back through the gather: codes x scale, the rope values, in the model dtype.
    out = torch.empty(2, 576, dtype=dtype)
    ops.gather_cache(cache.data, cache.scale, torch.tensor([[1, 2]], dtype=torch.int32),
                     torch.tensor([1], dtype=torch.int32),
                     torch.tensor([0, 2], dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), out)
    latent = torch.tensor(codes, dtype=torch.float64).view(4, 128) * torch.tensor(
        scales, dtype=torch.float64).view(4, 1)
    want = torch.cat([latent.view(-1), torch.tensor(rope, dtype=torch.float64)])
    assert torch.equal(out[0].double(), want.to(dtype).double())  # slot 5 = position 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_and_inf_groups(backend: str) -> None:
    ops = get_backend(backend, "cpu")
    cache = LatentKVCache(1, 4, 512, 64, kv_cache_dtype="fp8_ds_mla", dtype=torch.float32)
    kv_c = torch.randn(2, 512)
    k_pe = torch.randn(2, 64)
    kv_c[0, 130] = math.nan  # group 1 of token 0
    k_pe[0, 5] = math.nan
    kv_c[1, 400] = math.inf  # group 3 of token 1
    ops.write_cache(cache.data, kv_c, k_pe, torch.tensor([0, 1]), cache.scale)
    scales = cache.data[0, :2, 512:528].contiguous().view(torch.float32)
    assert scales[0, 1].isnan() and scales[1, 3] == 2.0**127
    out = torch.empty(2, 576)
    ops.gather_cache(cache.data, cache.scale, torch.zeros(1, 1, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), out)
    nan = out.isnan()
    assert nan[0, 128:256].all() and nan[0, 512 + 5]  # the NaN's group and its rope value
    assert nan.sum() == 129
    # An infinite value saturates to code 448 under scale 2^127: read back inf again;
    # the rest of its group is below e4m3's smallest step there, 0.
    assert out[1, 400] == math.inf
    assert (out[1, 384:400] == 0).all() and (out[1, 401:512] == 0).all()
    assert torch.isfinite(out[1, :384]).all()


def test_bytes_per_token_and_refusals() -> None:
    assert LatentKVCache.bytes_per_token(512, 64, torch.uint8) == 656
    assert resolve_cache_dtype("fp8_ds_mla", torch.bfloat16, 512, 64) == torch.uint8
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_ds_mla'.*kv_lora_rank 64"):
        LatentKVCache(2, 4, 64, 16, kv_cache_dtype="fp8_ds_mla", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_ds_mla'.*qk_rope_head_dim 0"):
        LatentKVCache(2, 4, 512, 0, kv_cache_dtype="fp8_ds_mla", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'fp8_ds_mla'.*float16"):
        LatentKVCache(2, 4, 512, 64, kv_cache_dtype="fp8_ds_mla", dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_ds_mla'"):
        EngineArgs(kv_cache_dtype="fp8_ds_mla", dtype=torch.float16)
    assert EngineArgs(kv_cache_dtype="fp8_ds_mla").kv_cache_dtype == "fp8_ds_mla"
    with pytest.raises(ValueError, match="fp8_ds_mla"):
        LatentKVCache(2, 4, 64, 16, kv_cache_dtype="fp8_ds_mla_x")


# --- the attention layer over the cache (reference backend) against the oracle --------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_decode_prefill_and_chunks(dtype: torch.dtype) -> None:
    # Decodes read every key back from the cache (their new tokens too), prefills their
    # context in chunks of 16 rows: the oracle reads the same dequantized values
    # (`testing.ds_mla_entries`), so float32's tolerance holds; the cache's bytes are
    # compared exactly.
    batch = make_paged_batch(DS_DIMS, [1, 2, 5, 9], [40, 17, 5, 50], 8, dtype=dtype,
                             kv_cache_dtype="fp8_ds_mla", seed=54)
    assert batch.cache.is_ds_mla
    tol = FLOAT32_TOL if dtype == torch.float32 else 2e-2
    meta = run_and_check(batch, decode_threshold=2, workspace_rows=16, tol=tol)
    assert len(meta.prefill.context.chunks) >= 3


def test_decode_really_reads_the_quantized_entries() -> None:
    # Guard on the oracle: the decode's answer differs measurably from the one over the
    # unquantized new tokens (else the test above proves nothing of the format).
    batch = make_paged_batch(DS_DIMS, [3, 3], [3, 20], 4, kv_cache_dtype="fp8_ds_mla",
                             seed=55)
    out, _ = run(batch, decode_threshold=3)
    exact = batch.oracle(decode_threshold=0)
    assert (out.double() - exact).norm() / exact.norm() > 10 * FLOAT32_TOL
