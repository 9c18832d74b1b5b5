"""The kernels' number grids (``dsv4/ops/triton/numerics.py``) against ``dsv4/ops/numerics.py``, bit
for bit, over every code: all 16 e2m1 codes (one at a time and eight to an int32 word), all 256
e8m0 and e4m3 bytes, e2m1 and e4m3 rounding of values around every midpoint and binade (e4m3
subnormals, ties, saturation, +-inf, NaN), the power-of-two scale helpers.

CPU: Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported). With CUDA the
same checks run compiled (``test_gpu_numerics``, ``-m gpu``): a GPU's min/max and float8 casts
treat NaN and -0 in their own ways, which the interpreter cannot show.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
import triton.language as tl  # noqa: E402

from dsv4.ops import numerics as ref  # noqa: E402
from dsv4.ops.triton.numerics import (  # noqa: E402
    e2m1_code, e2m1_to_f32, e2m1x8_bf16_bits, e2m1x8_to_f16, e4m3_bits, e4m3_decode, e8m0_to_f32, exp2_biased,
    fp4_scale, fp8_round_trip, fp8_scale, mxfp4_to_bf16, neg, ordered_i32, pow2_ceil, pow2_inv, pow2_to_e8m0,
    quantize_e4m3)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128


# ----------------------------------------------------------------------------- harness kernels
@triton.jit
def _unary_kernel(x_ptr, y_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    """``y = f(x)`` elementwise for the device function named by ``OP``."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0)
    if OP == "e8m0_to_f32":
        y = e8m0_to_f32(x)
    elif OP == "e4m3_to_f32":
        y = e4m3_decode(x, tl.float32)
    elif OP == "e4m3_to_f16":
        y = e4m3_decode(x, tl.float16)
    elif OP == "e2m1_to_f32":
        y = e2m1_to_f32(x)
    elif OP == "e2m1_code":
        y = e2m1_code(x)
    elif OP == "quantize_e4m3":
        y = quantize_e4m3(x)
    elif OP == "e4m3_bits":
        y = e4m3_bits(quantize_e4m3(x))
    elif OP == "pow2_ceil":
        y = pow2_ceil(x)
    elif OP == "pow2_inv":
        y = pow2_inv(x)
    elif OP == "pow2_to_e8m0":
        y = pow2_to_e8m0(x)
    elif OP == "exp2_biased":
        y = exp2_biased(x)
    elif OP == "neg":
        y = neg(x)
    elif OP == "ordered_i32":
        y = ordered_i32(x)
    elif OP == "fp8_scale":
        y = fp8_scale(x, False)
    elif OP == "fp8_scale_pow2":
        y = fp8_scale(x, True)
    else:
        y = fp4_scale(x)
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _round_trip_kernel(x_ptr, s_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    y = fp8_round_trip(tl.load(x_ptr + i, mask=m, other=0.0), tl.load(s_ptr + i, mask=m, other=1.0))
    tl.store(y_ptr + i, y, mask=m)


@triton.jit
def _e2m1x8_kernel(w_ptr, y_ptr, n, F32: tl.constexpr, BLOCK: tl.constexpr):
    """Words ``w [n]`` (eight codes each) -> ``y [n, 8]`` in code order."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.reshape(e2m1x8_to_f16(tl.load(w_ptr + i, mask=m, other=0), F32), (BLOCK, 8))
    j = tl.arange(0, 8)
    tl.store(y_ptr + i[:, None] * 8 + j[None, :], v.to(y_ptr.dtype.element_ty), mask=m[:, None])


@triton.jit
def _mxfp4_bf16_kernel(w_ptr, s_ptr, bits_ptr, y_ptr, R: tl.constexpr, G: tl.constexpr):
    """MXFP4 words ``w [R, G, 4]`` and scale bytes ``s [R, G]`` -> the codes' bf16 bits ``[R, G * 32]``
    (:func:`e2m1x8_bf16_bits`) and the dequantized weight ``y [R, G * 32]`` (:func:`mxfp4_to_bf16`)."""
    r = tl.arange(0, R)
    g = tl.arange(0, G)
    words = tl.load(w_ptr + (r[:, None, None] * G + g[None, :, None]) * 4 + tl.arange(0, 4)[None, None, :])
    sv = tl.load(s_ptr + r[:, None] * G + g[None, :])
    k = tl.arange(0, G * 32)
    tl.store(bits_ptr + r[:, None] * (G * 32) + k[None, :], tl.reshape(e2m1x8_bf16_bits(words), (R, G * 32)))
    tl.store(y_ptr + r[:, None] * (G * 32) + k[None, :], mxfp4_to_bf16(words, sv))


def _apply(op: str, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    x = x.to(DEV).contiguous()
    y = torch.empty(x.shape, dtype=out_dtype, device=DEV)
    _unary_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), OP=op, BLOCK=BLOCK)
    return y.cpu()


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit patterns (any NaN equals any NaN: payloads are not part of the contract)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), f"NaN at {torch.nonzero(torch.isnan(got) != nan).flatten()[:8]}"
    ib = {2: torch.int16, 4: torch.int32}[got.element_size()]
    bad = (got.view(ib) != want.view(ib)) & ~nan
    where = torch.nonzero(bad).flatten()[:8].tolist()
    assert not bad.any(), f"inputs {where}: got {got[bad][:8]}, want {want[bad][:8]}"


def _around(points: torch.Tensor) -> torch.Tensor:
    """Each fp32 point, its neighbours one ulp down and up, and their negatives."""
    p = points.float()
    inf = torch.full_like(p, float("inf"))
    v = torch.cat([p, torch.nextafter(p, -inf), torch.nextafter(p, inf)])
    return torch.cat([v, -v])


def _e4m3_grid() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def _e4m3_inputs() -> torch.Tensor:
    """Values around every e4m3 value and every midpoint between neighbours (the ties), e4m3
    subnormals and below, past 448 (saturation), +-inf, NaN, -0."""
    grid = _e4m3_grid()
    grid = torch.unique(grid[torch.isfinite(grid) & (grid >= 0)])
    mids = (grid[1:] + grid[:-1]) / 2
    extra = torch.tensor([2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 1e-30, 1e-40, 464.0, 480.0, 500.0, 1e6, 3e38,
                          float("inf")])
    x = _around(torch.cat([grid, mids, extra]))
    return torch.cat([x, torch.tensor([0.0, -0.0, float("nan"), -float("nan")])])


def _e4m3_ref(x: torch.Tensor) -> torch.Tensor:
    """The reference's saturating e4m3 rounding (``numerics.fp8_quantize``)."""
    return x.clamp(-ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ----------------------------------------------------------------------------- the checks
def check_e8m0_decode() -> None:
    """All 256 e8m0 bytes: ``2^(e-127)``, ``e = 0`` the subnormal ``2^-127``, ``e = 255`` NaN."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    _same_bits(_apply("e8m0_to_f32", codes, torch.float32), ref.e8m0_to_float(codes))
    assert torch.isnan(_apply("e8m0_to_f32", codes, torch.float32)[255])


def check_e4m3_decode() -> None:
    """All 256 float8_e4m3fn bytes (0x7F / 0xFF NaN, 0x80 -0, subnormals) in fp32 and fp16. The
    decode is the hardware cast; Triton's interpreter emulates it with 0x7F / 0xFF as +-480 (no
    NaN), so there the two NaN codes are left to the GPU run. (No stored e4m3 scale is NaN: the
    weight formats refuse them at load.)"""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if DEV == "cpu":
        codes = codes[(codes & 0x7F) != 0x7F]
    want = codes.view(torch.float8_e4m3fn).float()
    _same_bits(_apply("e4m3_to_f32", codes, torch.float32), want)
    _same_bits(_apply("e4m3_to_f16", codes, torch.float16), want.half())


def check_e2m1_decode() -> None:
    """All 16 e2m1 codes (code 8 is -0, as the reference)."""
    codes = torch.arange(16, dtype=torch.int32)
    want = ref.e2m1_decode(codes)
    _same_bits(_apply("e2m1_to_f32", codes, torch.float32), want)
    assert torch.equal(want, torch.tensor(ref.E2M1_VALUES))


def check_e2m1x8_decode() -> None:
    """Every code at every one of the eight nibble positions of an int32 word (sign bit included)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.stack([torch.arange(16).roll(j) for j in range(8)], dim=1)        # [16, 8]
    codes = torch.cat([codes, torch.randint(0, 16, (200, 8), generator=g)])
    words = torch.zeros(codes.shape[0], dtype=torch.int64)
    for j in range(8):
        words |= codes[:, j].long() << (4 * j)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    want = ref.e2m1_decode(codes.to(torch.uint8)) * 2.0 ** -14
    for f32, dtype in ((False, torch.float16), (True, torch.float32)):
        y = torch.empty(codes.shape, dtype=dtype, device=DEV)
        _e2m1x8_kernel[(triton.cdiv(words.numel(), 64),)](words.to(DEV), y, words.numel(), F32=f32, BLOCK=64)
        _same_bits(y.cpu(), want.to(dtype))


def check_mxfp4_to_bf16() -> None:
    """The bf16 dequantization of MXFP4 tiles (the prefill GEMMs' operand): every code at every
    nibble position, every scale byte 0..128 (0 is 2^-127: subnormal products), equal to the
    reference's ``e2m1 * 2^(s-127)`` rounded to bf16 (exact: two significant bits)."""
    g = torch.Generator().manual_seed(1)
    R, G = 16, 16
    codes = torch.stack([torch.arange(16).roll(j) for j in range(8)], dim=1)          # [16, 8]
    codes = torch.cat([codes.repeat(R * G * 4 // 16, 1)[: R * G * 4 - 200], torch.randint(0, 16, (200, 8), generator=g)])
    words = torch.zeros(codes.shape[0], dtype=torch.int64)
    for j in range(8):
        words |= codes[:, j].long() << (4 * j)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32).reshape(R, G, 4)
    sv = torch.cat([torch.arange(129), torch.randint(0, 129, (R * G - 129,), generator=g)]).to(torch.uint8)
    sv = sv.reshape(R, G)
    bits = torch.empty(R, G * 32, dtype=torch.int16, device=DEV)
    y = torch.empty(R, G * 32, dtype=torch.bfloat16, device=DEV)
    _mxfp4_bf16_kernel[(1,)](words.to(DEV), sv.to(DEV), bits, y, R=R, G=G)
    e2m1 = ref.e2m1_decode(codes.reshape(R, G * 32).to(torch.uint8))
    _same_bits(bits.cpu().view(torch.bfloat16), (e2m1 * 2.0 ** -126).to(torch.bfloat16))
    want = (e2m1 * ref.e8m0_to_float(sv).repeat_interleave(32, dim=1)).to(torch.bfloat16)
    if DEV == "cuda":     # (the interpreter has no bf16 arithmetic; the bits above are what it can check)
        _same_bits(y.cpu(), want)


def check_e2m1_rounding() -> None:
    """e2m1 codes of values around every grid point and midpoint (ties to even), past 6, tiny
    negatives (-0), +-inf, NaN of either sign."""
    pts = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e9,
                        float("inf"), 1e-3, 1e-45])
    x = torch.cat([_around(pts), torch.tensor([-0.0, float("nan"), -float("nan"), -0.1])])
    got = _apply("e2m1_code", x, torch.int32)
    assert torch.equal(got, ref.e2m1_codes(x).to(torch.int32))


def check_e4m3_rounding() -> None:
    """``e4m3(clamp(v, +-448))``: nearest even on every binade and in the subnormals, saturation,
    +-inf -> +-448, NaN kept; the float8 byte of the result."""
    x = _e4m3_inputs()
    want = _e4m3_ref(x)
    _same_bits(_apply("quantize_e4m3", x, torch.float32), want.float())
    fin = ~torch.isnan(x)
    got_bits = _apply("e4m3_bits", x[fin], torch.int32)
    assert torch.equal(got_bits, want[fin].view(torch.uint8).to(torch.int32))


def check_pow2() -> None:
    """``2^ceil(log2 v)`` around every power of two, ``1/s`` and the e8m0 byte of powers of two,
    ``2^(e-127)`` of every normal biased exponent, the sign flip (``-0`` kept)."""
    e = torch.arange(-126, 127)
    p2 = ref.exp2_int(e)
    v = _around(p2)
    v = v[(v > 0) & (v < 2.0 ** 127)]
    v = v[v >= 2.0 ** -126]
    _same_bits(_apply("pow2_ceil", v, torch.float32), ref.pow2_ceil(v))
    _same_bits(_apply("pow2_inv", p2, torch.float32), 1.0 / p2)
    all_p2 = ref.exp2_int(torch.arange(-126, 128))
    assert torch.equal(_apply("pow2_to_e8m0", all_p2, torch.int32), ref.pow2_to_e8m0(all_p2).to(torch.int32))
    biased = torch.arange(1, 255, dtype=torch.int32)
    _same_bits(_apply("exp2_biased", biased, torch.float32), ref.exp2_int(biased - 127))
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf")])
    _same_bits(_apply("neg", x, torch.float32), -x)


def check_block_scales() -> None:
    """FP8 (``amax / 448``, with and without the power-of-two ceiling) and FP4 block scales, amax
    around the floors and across the range, as ``numerics.fp8_quantize`` / ``fp4_quantize``."""
    g = torch.Generator().manual_seed(1)
    amax = torch.cat([torch.tensor([0.0, 1e-5, 1e-4, 7e-38, 448.0, 6.0, 3e38]),
                      torch.exp(torch.randn(2000, generator=g) * 20).clamp(max=3e38)])
    amax = torch.cat([amax, torch.nextafter(amax, torch.full_like(amax, float("inf")))])
    f8 = ref.div_const(amax.clamp_min(ref.FP8_AMAX_FLOOR), ref.FP8_E4M3_MAX)
    _same_bits(_apply("fp8_scale", amax, torch.float32), f8)
    _same_bits(_apply("fp8_scale_pow2", amax, torch.float32), ref.pow2_ceil(f8))
    f4 = ref.pow2_ceil(ref.div_const(amax.clamp_min(ref.FP4_AMAX_FLOOR), ref.E2M1_MAX))
    _same_bits(_apply("fp4_scale", amax, torch.float32), f4)


def check_fp8_round_trip() -> None:
    """``e4m3(clamp(x / s)) * s`` for scales that are and are not powers of two."""
    g = torch.Generator().manual_seed(2)
    x = torch.cat([_e4m3_inputs(), torch.randn(3000, generator=g) * 100])
    s = torch.where(torch.arange(x.numel()) % 2 == 0, 2.0 ** -3, 0.37)
    y = torch.empty_like(x, device=DEV)
    _round_trip_kernel[(triton.cdiv(x.numel(), BLOCK),)](x.to(DEV), s.to(DEV), y, x.numel(), BLOCK=BLOCK)
    _same_bits(y.cpu(), _e4m3_ref(x / s).float() * s)


def check_order() -> None:
    """The ranking keys: the reference's for every value around the binades, zeros of both signs
    equal, and strictly increasing with the value (``-inf`` first, ``+inf`` last)."""
    g = torch.Generator().manual_seed(3)
    pts = torch.cat([ref.exp2_int(torch.arange(-126, 128, 7)), torch.tensor([1e-45, 3e38, float("inf")]),
                     torch.randn(500, generator=g) * 1e3])
    x = torch.cat([_around(pts), torch.tensor([0.0, -0.0])])
    got = _apply("ordered_i32", x, torch.int32)
    assert torch.equal(got, ref.ordered_int32(x))
    v, order = torch.unique(x, return_inverse=True)          # sorted distinct values (-0 and +0 are one)
    keys = torch.zeros(v.numel(), dtype=torch.int32).scatter_(0, order, got)
    assert bool((keys[1:] > keys[:-1]).all())


CHECKS = [check_e8m0_decode, check_e4m3_decode, check_e2m1_decode, check_e2m1x8_decode, check_mxfp4_to_bf16,
          check_e2m1_rounding,
          check_e4m3_rounding, check_pow2, check_block_scales, check_fp8_round_trip, check_order]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_numerics(check):
    check()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_numerics():
    """Every check compiled for the GPU (its NaN and signed-zero handling)."""
    for check in CHECKS:
        check()
