"""The number grids of :mod:`dsv4.ops.numerics` as Triton device functions: every kernel decodes
and rounds e2m1, e8m0 and e4m3 through here, so they agree with each other and with the reference
on every code (``tests/test_triton_numerics.py`` checks each function against its torch twin over
all codes).

Written with integer bit operations and exact float arithmetic only (no float8 rounding cast, no
approximate division), so the bits are the same on a GPU and in Triton's CPU interpreter:

- e8m0 byte ``e`` -> ``2^(e-127)``; ``e = 0`` is the fp32 subnormal ``2^-127``, ``e = 255`` NaN
  (``numerics.e8m0_to_float``).
- e2m1 code -> value: the code's three magnitude bits placed at the bottom of an fp16 exponent are
  ``e2m1 * 2^-14`` exactly (code 1, 0.5, is the fp16 subnormal ``2^-15``); bit 3 is the sign, so
  code 8 is ``-0`` (``numerics.e2m1_decode``).
- e2m1 rounding: count the midpoints below ``|v|``, ties to the even code (``numerics.e2m1_codes``).
- e4m3 rounding (``torch``'s float8 cast after the reference's clamp to +-448): the quantum is
  ``2^(e-3)`` in the normal range and ``2^-9`` below ``2^-6``; rounding to an integer multiple is the
  ``(t + 2^23) - 2^23`` idiom (nearest even, exact for ``0 <= t < 2^22``). NaN stays NaN, +-inf
  saturates to +-448.
- power-of-two scales from the float's bits: ``2^ceil(log2 v)``, ``1/s``, the e8m0 byte of ``s``.
- order: the int32 keys top-k and argmax kernels rank fp32 values by (``numerics.ordered_int32``).

Kernels that must equal an elementwise fp32 reference bit for bit are launched with
``enable_fp_fusion=False`` (no multiply-add contraction on the GPU; the interpreter never fuses).
"""

from __future__ import annotations

import triton
import triton.language as tl


# ----------------------------------------------------------------------------- order
@triton.jit
def ordered_i32(v):
    """int32 keys in the order of fp32 ``v`` (``-0 == +0``): ``numerics.ordered_int32``."""
    bits = v.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def ordered_key(v, ids):
    """int64 keys in the order of (fp32 ``v``, then the lower int ``ids`` first): NaN above +inf,
    ``-0 == +0``, as ``torch.topk`` / ``torch.argmax`` rank; one max reduction is an argmax."""
    ordered = tl.where(v != v, 2147483647, ordered_i32(v))
    return (ordered.to(tl.int64) << 32) | (4294967295 - ids.to(tl.int64))


# ----------------------------------------------------------------------------- powers of two
@triton.jit
def exp2_biased(e):
    """``2^(e - 127)`` as fp32 for a biased exponent ``e`` in [1, 254] (int32)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def neg(x):
    """``-x`` for fp32 by flipping the sign bit (Triton's unary minus is ``0 - x``: it loses ``-0``)."""
    return (x.to(tl.int32, bitcast=True) ^ -2147483648).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil(v):
    """The smallest power of two ``>= v`` for positive normal fp32 ``v``, exactly (from the bits)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return exp2_biased(e)


@triton.jit
def pow2_inv(s):
    """``1 / s`` for a normal power of two ``s``, exactly (from the bits)."""
    return exp2_biased(254 - ((s.to(tl.int32, bitcast=True) >> 23) & 0xFF))


@triton.jit
def pow2_to_e8m0(s):
    """The e8m0 byte (int32) of a normal power of two ``s`` (``numerics.pow2_to_e8m0``)."""
    return (s.to(tl.int32, bitcast=True) >> 23) & 0xFF


# ----------------------------------------------------------------------------- decoders
@triton.jit
def e8m0_to_f32(e):
    """e8m0 bytes (any integer type, values 0..255) -> fp32 ``2^(e-127)``: ``e = 0`` is the
    subnormal ``2^-127``, ``e = 255`` is NaN (``numerics.e8m0_to_float``)."""
    e = e.to(tl.int32)
    f = tl.where(e == 0, 0x00400000, e << 23).to(tl.float32, bitcast=True)     # e = 255: +inf
    return tl.fma(f, 0.0, f)                  # inf * 0 + inf = NaN; exactly f for every finite f


@triton.jit
def e4m3_decode(b, OUT: tl.constexpr):
    """float8_e4m3fn bytes (uint8) -> their values in ``OUT`` (exact in fp16 and fp32; the codes
    0x7F / 0xFF are NaN)."""
    return b.to(tl.float8e4nv, bitcast=True).to(OUT)


@triton.jit
def e2m1_to_f32(c):
    """e2m1 codes (int32, low 4 bits; bit 3 the sign) -> fp32 values, exactly, ``-0`` for code 8."""
    h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.uint16)
    return h.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def e2m1x8_to_f16(w, F32: tl.constexpr):
    """Eight e2m1 codes per int32 word (code ``j`` in bits ``4j .. 4j+3``) -> ``[..., 2, 2, 2]``
    (code ``j = 4*i2 + 2*i1 + i0`` at ``[..., i2, i1, i0]``) holding ``e2m1 * 2^-14`` exactly, as
    fp16 (fp32 with ``F32``). Each pair of codes ``(j, j+4)`` becomes one fp16x2 word by masks and
    shifts: sign to bit 15, the three magnitude bits to fp16 bits 9..11 (as in :func:`e2m1_to_f32`)."""
    p0 = ((w & 0x00070007) << 9) | ((w & 0x00080008) << 12)
    p1 = ((w & 0x00700070) << 5) | ((w & 0x00800080) << 8)
    p2 = ((w & 0x07000700) << 1) | ((w & 0x08000800) << 4)
    p3 = ((w & 0x70007000) >> 3) | (w & -2147450880)            # -2147450880 = 0x80008000
    l0 = p0.to(tl.int16).to(tl.float16, bitcast=True)
    l1 = p1.to(tl.int16).to(tl.float16, bitcast=True)
    l2 = p2.to(tl.int16).to(tl.float16, bitcast=True)
    l3 = p3.to(tl.int16).to(tl.float16, bitcast=True)
    h0 = (p0 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h1 = (p1 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h2 = (p2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h3 = (p3 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    if F32:
        l0, l1, l2, l3 = l0.to(tl.float32), l1.to(tl.float32), l2.to(tl.float32), l3.to(tl.float32)
        h0, h1, h2, h3 = h0.to(tl.float32), h1.to(tl.float32), h2.to(tl.float32), h3.to(tl.float32)
    return tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))


@triton.jit
def e2m1x8_bf16_bits(w):
    """Eight e2m1 codes per int32 word -> ``[..., 2, 2, 2]`` int16 (the layout of
    :func:`e2m1x8_to_f16`): the bits of bf16 ``e2m1 * 2^-126``, exactly. The three magnitude bits
    go to bf16 bits 6..8 (the exponent's low two bits and the mantissa's top bit: code 1, 0.5, is
    the subnormal ``2^-127``), the sign to bit 15; pairs of codes ``(j, j+4)`` one int32 each."""
    p0 = ((w & 0x00070007) << 6) | ((w & 0x00080008) << 12)
    p1 = ((w & 0x00700070) << 2) | ((w & 0x00800080) << 8)
    p2 = ((w & 0x07000700) >> 2) | ((w & 0x08000800) << 4)
    p3 = ((w >> 6) & 0x01C001C0) | (w & -2147450880)            # -2147450880 = 0x80008000
    return tl.join(tl.join(tl.join(p0.to(tl.int16), (p0 >> 16).to(tl.int16)),
                           tl.join(p2.to(tl.int16), (p2 >> 16).to(tl.int16))),
                   tl.join(tl.join(p1.to(tl.int16), (p1 >> 16).to(tl.int16)),
                           tl.join(p3.to(tl.int16), (p3 >> 16).to(tl.int16))))


@triton.jit
def e8m0_bf16_bits_126(e):
    """e8m0 bytes ``e <= 128`` -> int16 bits of bf16 ``2^(e-127) * 2^126 = 2^(e-1)``: times
    :func:`e2m1x8_bf16_bits`' values it is the MXFP4 weight, exactly (two significant bits, no
    rounding; subnormal results included). Bytes above 128 overflow: callers check."""
    return ((e.to(tl.int32) + 126) << 7).to(tl.int16)


@triton.jit
def mxfp4_to_bf16(words, scale_bytes):
    """MXFP4 words ``[R, G, 4]`` (8 codes each, 32 a group) and their e8m0 scale bytes ``[R, G]``
    (each ``<= 128``) -> the weight as bf16 ``[R, G * 32]``, exactly, with one bf16 multiply a
    value and no float conversion (the dequantized tiles of the bf16 MMA paths)."""
    R: tl.constexpr = words.shape[0]
    G: tl.constexpr = words.shape[1]
    w = tl.reshape(e2m1x8_bf16_bits(words).to(tl.bfloat16, bitcast=True), (R, G, 32))
    s = e8m0_bf16_bits_126(scale_bytes).to(tl.bfloat16, bitcast=True)
    return tl.reshape(w * s[:, :, None], (R, G * 32))


# ----------------------------------------------------------------------------- rounding
@triton.jit
def e2m1_code(v):
    """e2m1 code (int32, bit 3 = sign) of fp32 ``v`` (already scaled): nearest, ties to the even
    code, saturating at 6, sign kept (``-0.1 -> -0``)."""
    mag = tl.abs(v)
    code = ((mag > 0.25).to(tl.int32) + (mag > 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag > 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag > 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32))
    tie = ((mag == 0.25) | (mag == 0.75) | (mag == 1.25) | (mag == 1.75) | (mag == 2.5) | (mag == 3.5)
           | (mag == 5.0))
    code = code + (tie & ((code & 1) == 1)).to(tl.int32)
    return code + ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def round_e4m3(v):
    """fp32 ``v`` with ``|v| <= 448`` rounded to the nearest e4m3 value (ties to even), sign kept."""
    bits = v.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF                                  # biased exponent of |v|
    qe = tl.maximum(e, 121) - 3                               # quantum 2^(e-3), 2^-9 below 2^-6
    t = tl.abs(v) * exp2_biased(254 - qe)                    # |v| / quantum, exact
    r = (t + 8388608.0) - 8388608.0                           # nearest integer, ties to even
    out = r * exp2_biased(qe)
    return (out.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_e4m3(v):
    """``e4m3(clamp(v, -448, 448))`` as fp32 (the reference's ``clamp(...).to(float8_e4m3fn)``):
    saturating, NaN kept (a plain ``tl.maximum`` on a GPU would turn NaN into -448)."""
    c = tl.minimum(tl.maximum(v, -448.0, propagate_nan=tl.PropagateNan.ALL), 448.0,
                   propagate_nan=tl.PropagateNan.ALL)
    return round_e4m3(c)


@triton.jit
def e4m3_bits(r):
    """The float8_e4m3fn byte (as int32) of an fp32 value ``r`` already on the e4m3 grid."""
    bits = r.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    normal = e >= 121
    big_e = tl.where(normal, e - 120, 0)
    mant = tl.where(normal, (bits >> 20) & 7, (tl.abs(r) * 512.0).to(tl.int32))
    return ((bits >> 24) & 0x80) | (big_e << 3) | mant


# ----------------------------------------------------------------------------- block scales
@triton.jit
def fp8_scale(amax, POW2: tl.constexpr):
    """Scale of an FP8 block: ``max(amax, 1e-4) / 448``, rounded up to a power of two when ``POW2``."""
    s = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if POW2:
        s = pow2_ceil(s)
    return s


@triton.jit
def fp8_round_trip(x, s):
    """``x`` through e4m3 with scale ``s``: ``e4m3(clamp(x / s, -448, 448)) * s`` (fp32)."""
    return quantize_e4m3(tl.div_rn(x, s)) * s


@triton.jit
def fp4_scale(amax):
    """Power-of-two scale of an FP4 block: ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``."""
    return pow2_ceil(tl.div_rn(tl.maximum(amax, 7.052966104933725e-38), 6.0))
