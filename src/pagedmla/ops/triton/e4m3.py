"""e4m3 (the fp8 cache's format) to and from wider types, in inline PTX for the Gluon
kernels: `e4m3_bits_to` widens codes to bf16/fp16 by placing their bits,
`float_to_e4m3` rounds float32 values to codes. Each call takes four values, packed in a
32-bit word. `tests/test_e4m3_widening.py` checks the widening's PTX text against
PyTorch's decoding on the CPU."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

# e4m3 -> 16-bit by placing the bits and one exact multiply by a power of two (the
# exponent biases differ by 120 for bf16, 8 for fp16), four values per call. The
# hardware's conversions (cvt e4m3x2 -> f16x2, then f16 -> bf16) issue at a quarter of
# the integer rate and made the fp8 tile's widening, not its copy, the bottleneck.
# Subnormals come out exact; an e4m3 NaN reads as +-480 in the first two forms (the
# cache writer saturates, so only a NaN model input can put one there). Two forms:
# - split sign: each code to the high byte of its lane, the sign masked off, the rest
#   shifted right and masked, the two or-ed (ptxas: five instructions per pair);
# - copied sign: a byte permute puts each code in the low byte of its lane and copies
#   its sign bit over the high byte (selectors 0x9180 / 0xB3A2), so one left shift puts
#   exponent and mantissa in place under the sign, and one mask clears what lies
#   between (four per pair; ptxas makes the shift an integer multiply-add).
# The 64-row kernel's widener, its bottleneck, uses the second (the fewer instructions);
# the 16-row fp8 kernel's q and P splits use the first.
_SPLIT_SIGN = """{{
.reg .b32 t, u, k;
mov.b32 k, {one};
prmt.b32 t, $2, 0, 0x1404;
shr.b32 u, t, {shift};
and.b32 u, u, {mask};
and.b32 t, t, 0x80008000;
or.b32 t, t, u;
mul.rn.{ty}x2 $0, t, k;
prmt.b32 t, $2, 0, 0x3424;
shr.b32 u, t, {shift};
and.b32 u, u, {mask};
and.b32 t, t, 0x80008000;
or.b32 t, t, u;
mul.rn.{ty}x2 $1, t, k;
}}"""
_COPIED_SIGN = """{{
.reg .b32 t, k;
mov.b32 k, {one};
prmt.b32 t, $2, 0, 0x9180;
shl.b32 t, t, {shift};
and.b32 t, t, {mask};
mul.rn.{ty}x2 $0, t, k;
prmt.b32 t, $2, 0, 0xB3A2;
shl.b32 t, t, {shift};
and.b32 t, t, {mask};
mul.rn.{ty}x2 $1, t, k;
}}"""
# The copied-sign form without the multiply: the values come out 2^-120 (bf16) or 2^-8
# (fp16) of the codes', exact (subnormal 16-bit values included); the caller scales.
# It keeps NaN (the 64-row kernel widens cached latents, where a NaN model input
# leaves NaN codes): y = (word | 0x80808080) + 0x01010101 clears the top bit of a byte
# whose code is +-NaN (low seven bits all ones), and a byte permute copies each byte's
# top bit over its lane, whose complement or-ed in makes the lane 0xFFFF, a NaN. The
# carry out of a NaN byte can flag the code above it in the same word too: harmless,
# since the NaN already makes that cache row's score NaN. Four more instructions per
# word (or, add, two permutes; ptxas folds the not and or into the mask's).
_COPIED_SIGN_RAW = """{{
.reg .b32 t, y, n;
or.b32 y, $2, 0x80808080;
add.u32 y, y, 0x01010101;
prmt.b32 t, $2, 0, 0x9180;
shl.b32 t, t, {shift};
and.b32 t, t, {mask};
prmt.b32 n, y, 0, 0x9988;
not.b32 n, n;
or.b32 $0, t, n;
prmt.b32 t, $2, 0, 0xB3A2;
shl.b32 t, t, {shift};
and.b32 t, t, {mask};
prmt.b32 n, y, 0, 0xBBAA;
not.b32 n, n;
or.b32 $1, t, n;
}}"""
_BF16 = dict(one="0x7B807B80", ty="bf16")
_F16 = dict(one="0x5C005C00", ty="f16")
_SPLIT_BF16 = gl.constexpr(_SPLIT_SIGN.format(shift=4, mask="0x07F007F0", **_BF16))
_SPLIT_F16 = gl.constexpr(_SPLIT_SIGN.format(shift=1, mask="0x3F803F80", **_F16))
_COPIED_BF16 = gl.constexpr(_COPIED_SIGN.format(shift=4, mask="0x87F087F0", **_BF16))
_COPIED_F16 = gl.constexpr(_COPIED_SIGN.format(shift=7, mask="0xBF80BF80", **_F16))
_RAW_BF16 = gl.constexpr(_COPIED_SIGN_RAW.format(shift=4, mask="0x87F087F0"))
_RAW_F16 = gl.constexpr(_COPIED_SIGN_RAW.format(shift=7, mask="0xBF80BF80"))
# log2 of what the raw form's values must be multiplied by.
RAW_EXP_BF16 = 120
RAW_EXP_F16 = 8


@gluon.jit
def e4m3_bits_to(bits, dtype: gl.constexpr, COPIED_SIGN: gl.constexpr = False,
                 RAW: gl.constexpr = False):
    """uint8 e4m3 codes -> dtype (bf16 or fp16) values, same shape and layout, in the
    split-sign form or (COPIED_SIGN) the copied-sign one; RAW: the copied-sign form's
    values before the multiply, 2^-RAW_EXP_* of the codes'."""
    BF16: gl.constexpr = dtype == gl.bfloat16
    if RAW:
        asm: gl.constexpr = _RAW_BF16 if BF16 else _RAW_F16
    elif COPIED_SIGN:
        asm: gl.constexpr = _COPIED_BF16 if BF16 else _COPIED_F16
    else:
        asm: gl.constexpr = _SPLIT_BF16 if BF16 else _SPLIT_F16
    wide = gl.inline_asm_elementwise(asm, "=r,=r,r", [bits], dtype=dtype.value, is_pure=True,
                                     pack=4)
    return wide

# float32 -> e4m3 (round to nearest, saturating), four values into one 32-bit word. In
# PTX because Triton 3.6's own conversions between e4m3 and float32, which go through
# 16-bit registers, give wrong values or store wrong bytes for half of the elements in
# the 16-row fp8 kernel's layouts; the way back is `e4m3_bits_to`.
_FROM_F32 = gl.constexpr("""{
.reg .b16 lo, hi;
cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
mov.b32 $0, {lo, hi};
}""")


@gluon.jit
def float_to_e4m3(x):
    """x (float32) as e4m3 codes (uint8), rounded to nearest."""
    return gl.inline_asm_elementwise(_FROM_F32, "=r,r,r,r,r", [x], dtype=gl.uint8,
                                     is_pure=True, pack=4)
