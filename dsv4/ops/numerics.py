"""The FP8 / FP4 / e8m0 number grids and their rounding, in one place (DSV4_FACTS sections 2b, 4).

Everything that rounds to a low-precision grid or reads one back goes through here: the weight
formats (``dsv4.weights.formats``), the QAT simulation of the KV cache and the indexer, the
activation quantization of DeepSeek's FP8/FP4 linears, and the packed cache storage.

Every function is plain elementwise torch with no lookup table copied from the host and no host
read of a device value, so all of them run inside a captured CUDA graph and on the ``meta``
device. Grids:

- e4m3 (``torch.float8_e4m3fn``): max 448; torch's cast rounds to nearest even.
- e2m1 (FP4): magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; code bit 3 is the sign; two codes a byte,
  the lower index in the LOW nibble.
- e8m0 / ue8m0: a power of two ``2^(e - 127)`` stored as its exponent byte ``e`` (255 = NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: activation quantization and the FP8 KV simulation floor ``amax`` here (DeepSeek's ``act_quant``)
FP8_AMAX_FLOOR = 1e-4
#: FP4 (e2m1) scales floor ``amax`` at ``6 * 2^-126`` so the scale is the smallest normal float
FP4_AMAX_FLOOR = 6.0 * 2.0 ** -126
#: e2m1 code -> value, for tests and docs (kernels and the functions below decode arithmetically)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


# ----------------------------------------------------------------------------- order
def ordered_int32(v: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the fp32 values ``v`` (``-0 == +0``; ``-inf`` lowest and ``+inf``
    highest of the numbers): the float's bits with the magnitude bits of the negatives flipped. Top-k
    and argmax kernels compare these, with the index in a low half, to rank exactly."""
    bits = (v.float() + 0.0).contiguous().view(torch.int32)      # + 0.0 turns -0 into +0 (a tie)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


# ----------------------------------------------------------------------------- powers of two
def pow2_ceil_exponent(v: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` for positive normal fp32 ``v``, exactly, from the float's bits:
    the exponent field, plus one if any mantissa bit is set. Returns int32 (unbiased).

    ``exp2(ceil(log2(v)))`` in floating point lands one step low just above a power of two; the
    bits do not.
    """
    bits = v.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127
    return exponent + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def exp2_int(e: torch.Tensor) -> torch.Tensor:
    """``2^e`` as fp32 for integer ``e`` in [-126, 127], built from bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def div_const(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c``, correctly rounded on every device. PyTorch's CUDA division by a Python scalar
    multiplies by the scalar's rounded reciprocal (``amax / 448`` then differs from the CPU's and
    the kernels' by an ulp on some blocks, which moves a quantized value by a whole e4m3 step);
    dividing by a tensor divides."""
    return t / torch.full_like(t, c)


def pow2_ceil(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``>= v`` for positive normal fp32 ``v`` (exact)."""
    return exp2_int(pow2_ceil_exponent(v))


def e8m0_to_float(bits: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent bytes (uint8, or ``float8_e8m0fnu`` viewed as uint8) -> fp32 ``2^(e-127)``.

    Exact, including ``e = 0`` (``2^-127``, an fp32 subnormal); ``e = 255`` gives NaN.
    """
    if bits.dtype != torch.uint8:
        bits = bits.view(torch.uint8)
    e = bits.to(torch.int32)
    out = torch.where(e == 0, torch.full_like(e, 0x00400000), e << 23)
    return torch.where(e == 255, torch.full_like(e, 0x7FC00000), out).view(torch.float32)


def pow2_to_e8m0(v: torch.Tensor) -> torch.Tensor:
    """Exact normal powers of two (fp32) -> their e8m0 byte (no check; see ``formats.float_to_e8m0``)."""
    return ((v.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


# ----------------------------------------------------------------------------- e2m1
def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values (already scaled into [-6, 6]) to e2m1 codes: nearest, ties to the even
    code, saturating at +-6, sign kept (``-0.1 -> -0``). Returns uint8 codes in [0, 15]."""
    x = x.float()
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.int32)
    tie = torch.zeros_like(mag, dtype=torch.bool)
    for mid in _E2M1_MIDPOINTS:
        code += (mag > mid).to(torch.int32)
        tie |= mag == mid
    code = code + (tie & (code % 2 == 1)).to(torch.int32)  # a tie sits at the lower code: go even
    return (code + 8 * torch.signbit(x).to(torch.int32)).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e2m1 codes (uint8, low 4 bits) -> values. Arithmetic, no table: for magnitude code
    ``c = 2e + m``, the value is ``0.5 m`` when ``e = 0``, else ``2^(e-1) (1 + m/2)``."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, (c & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, exp2_int(e - 1) * (1.0 + 0.5 * m))
    return torch.where((c & 8) != 0, -mag, mag).to(dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code, saturating), fp32."""
    return e2m1_decode(e2m1_codes(x))


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes ``[..., K]`` (K even) -> bytes ``[..., K/2]``, lower index in the low nibble."""
    pairs = codes.unflatten(-1, (codes.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Bytes ``[..., K/2]`` (uint8, int8 or float4_e2m1fn_x2) -> uint8 codes ``[..., K]``."""
    p = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    return torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- blocks
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """fp32 ``[..., n]`` -> ``[..., ceil(n / block), block]``; a ragged last block is zero-padded
    (zeros never change a block's amax)."""
    n = x.shape[-1]
    pad = -n % block
    xf = F.pad(x.float(), (0, pad)) if pad else x.float()
    return xf.unflatten(-1, (xf.shape[-1] // block, block))


def fp8_quantize(x: torch.Tensor, block: int, pow2: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., n]`` to e4m3 with one scale per ``block`` values of the last dim.

    ``amax = max(|x_block|, 1e-4)``; ``scale = amax / 448``, rounded up to a power of two when
    ``pow2`` (ue8m0 scales); ``q = e4m3(clamp(x / scale, -448, 448))``. This is DeepSeek's
    ``act_quant`` (block 128) and the KV cache's FP8 simulation (block 64). A ragged last block
    gets its own scale. Returns ``q`` float8_e4m3fn ``[..., n]`` and ``scale`` fp32
    ``[..., ceil(n / block)]``.
    """
    n = x.shape[-1]
    xb = _blocks(x, block).float()     # in fp32, as DeepSeek's kernels: a bf16 scale or quotient would round
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)
    scale = div_const(amax, FP8_E4M3_MAX)
    if pow2:
        scale = pow2_ceil(scale)
    q = (xb / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2)[..., :n], scale.squeeze(-1)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, block: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp8_quantize`: ``q [..., n]`` times its block's fp32 scale, in fp32, cast
    to ``dtype``. ``scale`` may also be e8m0 bytes (uint8)."""
    if scale.dtype == torch.uint8:
        scale = e8m0_to_float(scale)
    n = q.shape[-1]
    qb = _blocks(q, block)
    return (qb * scale.unsqueeze(-1)).flatten(-2)[..., :n].to(dtype)


def fp4_quantize(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., n]`` (n even) to e2m1 with one power-of-two scale per ``block`` values.

    ``amax = max(|x_block|, 6 * 2^-126)``, ``scale = 2^ceil(log2(amax / 6))``. Returns packed
    bytes uint8 ``[..., n / 2]`` and the scales as e8m0 bytes uint8 ``[..., ceil(n / block)]``.
    """
    n = x.shape[-1]
    xb = _blocks(x, block).float()
    amax = xb.abs().amax(-1, keepdim=True).clamp_min(FP4_AMAX_FLOOR)
    scale = pow2_ceil(div_const(amax, E2M1_MAX))
    codes = e2m1_codes(xb / scale).flatten(-2)[..., :n]
    return pack_e2m1(codes), pow2_to_e8m0(scale.squeeze(-1))


_BYTE_LUTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def e2m1_byte_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[256, 2]``: the two e2m1 values of each packed byte (low nibble first), in ``dtype``.

    Built on the device from ``arange`` (no host copy) and cached per (device, dtype); the first
    call must happen outside CUDA-graph capture (a warm-up forward does it).
    """
    key = (torch.device(device), dtype)
    if key not in _BYTE_LUTS:
        codes = unpack_e2m1(torch.arange(256, device=device).to(torch.uint8)).view(256, 2)
        _BYTE_LUTS[key] = e2m1_decode(codes, dtype)
    return _BYTE_LUTS[key]


def fp4_values(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed bytes ``[..., n/2]`` (uint8 / int8 / float4_e2m1fn_x2) -> e2m1 values ``[..., n]``
    (one table lookup per byte)."""
    p = packed if packed.dtype == torch.uint8 else packed.view(torch.uint8)
    return e2m1_byte_table(p.device, dtype)[p.int()].flatten(-2)


def fp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`fp4_quantize`: packed ``[..., n/2]`` + e8m0 scales -> values ``[..., n]``.

    e2m1 values times a power of two are exact in bf16 (same exponent range as fp32), so a bf16
    result is computed in bf16 (half the traffic); any other dtype through fp32.
    """
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    values = fp4_values(packed, work)
    n = values.shape[-1]
    s = e8m0_to_float(scale).to(work).unsqueeze(-1)
    if n % block == 0:
        return (values.view(*values.shape[:-1], n // block, block) * s).view(values.shape).to(dtype)
    vb = F.pad(values, (0, -n % block)).unflatten(-1, (-(-n // block), block))
    return (vb * s).flatten(-2)[..., :n].to(dtype)


# ----------------------------------------------------------------------------- simulations
def fp8_sim(x: torch.Tensor, block: int = 64, pow2: bool = True) -> torch.Tensor:
    """Round ``x`` through FP8 e4m3 with a scale per ``block`` (the KV cache's QAT simulation);
    returns the dequantized values in ``x.dtype``."""
    q, scale = fp8_quantize(x, block, pow2)
    return fp8_dequantize(q, scale, block, x.dtype)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round ``x`` through FP4 e2m1 with a power-of-two scale per ``block`` (the indexer's QAT
    simulation); returns the dequantized values in ``x.dtype``."""
    packed, scale = fp4_quantize(x, block)
    return fp4_dequantize(packed, scale, block, x.dtype)


def act_quant_sim(x: torch.Tensor, block: int = 128, pow2: bool = True) -> torch.Tensor:
    """DeepSeek's activation quantization before an FP8/FP4 linear (DSV4_FACTS 2b), as values:
    ``x`` rounded to e4m3 with a scale per 1x``block`` tile, returned in ``x.dtype``.

    With power-of-two scales the values are exact in bf16, so a matmul of them against a
    dequantized FP8/FP4 weight with fp32 accumulation equals the official blockwise FP8 product
    up to fp32 summation order.
    """
    return fp8_sim(x, block, pow2)
