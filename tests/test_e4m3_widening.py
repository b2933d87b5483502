"""The fp8 Hopper kernels widen e4m3 codes with inline PTX (`e4m3`'s split-sign
and copied-sign forms, and the copied-sign form without its multiply, for bf16 and
fp16). The interpreter cannot run inline assembly,
so on the CPU these tests execute the kernels' PTX text with a small model of the six
instructions it uses (PTX ISA semantics of prmt, shl, shr, and, or, not, add and
mul.rn on 16-bit pairs) and compare every code, in every byte position of a word, with PyTorch's
own e4m3 decoding. The kernels themselves are checked on the GPU by
`test_triton_decode_hopper.test_decode_gpu_hopper_fp8_widening_is_exact`."""

from __future__ import annotations

import re

import pytest
import torch

from pagedmla.ops.triton import e4m3

MASK32 = 0xFFFFFFFF
# (form, dtype) -> (the asm, log2 of the factor its values are short of the codes')
FORMS = {
    ("split", torch.bfloat16): (e4m3._SPLIT_BF16, 0),
    ("split", torch.float16): (e4m3._SPLIT_F16, 0),
    ("copied", torch.bfloat16): (e4m3._COPIED_BF16, 0),
    ("copied", torch.float16): (e4m3._COPIED_F16, 0),
    ("raw", torch.bfloat16): (e4m3._RAW_BF16, e4m3.RAW_EXP_BF16),
    ("raw", torch.float16): (e4m3._RAW_F16, e4m3.RAW_EXP_F16),
}


def _prmt(a: int, b: int, selector: int) -> int:
    """prmt.b32 (default mode): byte i of the result is byte (nibble i & 7) of {b, a},
    or that byte's sign bit copied over all eight bits when nibble i has bit 3 set."""
    source = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 0xF
        byte = source[nibble & 7]
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _words(values: list[int]) -> torch.Tensor:
    """Unsigned 32-bit register values as an int32 tensor (same bits)."""
    return torch.tensor([v - (1 << 32) if v >> 31 else v for v in values], dtype=torch.int32)


def _mul_pairs(a: int, b: int, dtype: torch.dtype) -> int:
    """mul.rn.{bf16,f16}x2: lane-wise product of two 16-bit pairs, rounded to nearest."""
    lanes = _words([a, b]).view(dtype).double()
    product = (lanes[:2] * lanes[2:]).to(dtype)
    return int(product.view(torch.int32).item()) & MASK32


def _run(asm: str, word: int, dtype: torch.dtype) -> tuple[int, int]:
    """Execute the asm block on input register $2 = word; returns ($0, $1)."""
    regs: dict[str, int] = {"$2": word}

    def value(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0)

    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [x.strip() for x in args.split(",")]
        if op == "mov.b32":
            regs[dst] = value(src[0])
        elif op == "prmt.b32":
            regs[dst] = _prmt(value(src[0]), value(src[1]), value(src[2]))
        elif op == "shl.b32":
            regs[dst] = (value(src[0]) << value(src[1])) & MASK32
        elif op == "shr.b32":
            regs[dst] = value(src[0]) >> value(src[1])
        elif op == "and.b32":
            regs[dst] = value(src[0]) & value(src[1])
        elif op == "or.b32":
            regs[dst] = value(src[0]) | value(src[1])
        elif op == "not.b32":
            regs[dst] = ~value(src[0]) & MASK32
        elif op == "add.u32":
            regs[dst] = (value(src[0]) + value(src[1])) & MASK32
        elif re.fullmatch(r"mul\.rn\.(bf16|f16)x2", op):
            regs[dst] = _mul_pairs(value(src[0]), value(src[1]), dtype)
        else:
            raise AssertionError(f"instruction {op!r} is not modelled")
    return regs["$0"], regs["$1"]


def _widen(asm: str, codes: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Four codes (one 32-bit word, code 0 in the low byte) -> their four 16-bit values."""
    return _words(list(_run(asm, int.from_bytes(bytes(codes), "little"), dtype))
                  ).view(dtype).float()


@pytest.mark.parametrize("form,dtype", list(FORMS), ids=lambda x: str(x).split(".")[-1])
def test_widening_ptx_decodes_every_code(form: str, dtype: torch.dtype) -> None:
    asm, exponent = FORMS[(form, dtype)]
    generator = torch.Generator().manual_seed(14)
    # Every code in every byte position: codes in order, then shuffled words.
    order = torch.cat([torch.arange(256), torch.randperm(256, generator=generator),
                       torch.randperm(256, generator=generator),
                       torch.randperm(256, generator=generator)])
    codes = order.to(torch.uint8)
    want = codes.view(torch.float8_e4m3fn).float()
    got = torch.cat([_widen(asm.value, codes[i:i + 4].tolist(), dtype)
                     for i in range(0, len(codes), 4)])
    # The raw form's values, exact 16-bit numbers (subnormal ones included), times a
    # power of two: exact in float64.
    got = (got.double() * 2.0 ** exponent).float()
    finite = want.isfinite()
    if form == "raw":
        # NaN codes read as NaN; so may the other codes of a word that holds one.
        assert got[~finite].isnan().all()
        finite = ~(~finite).view(-1, 4).any(1, keepdim=True).expand(-1, 4).reshape(-1)
        assert 0.9 < finite.float().mean() < 1  # words with NaN are few
    # Compared as bits through float32: signed zeros and subnormals must match exactly.
    assert torch.equal(got[finite].view(torch.int32), want[finite].view(torch.int32))
    if form != "raw":
        # The NaN codes (never written: the cache writer saturates) read as +-480.
        assert torch.equal(got[~finite].abs(), torch.full_like(got[~finite], 480.0))
