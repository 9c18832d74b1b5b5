"""Shared pieces of the small-op kernels (:mod:`dsv4.ops.triton.small`): input checks, row views,
and the FP8 / FP4 / power-of-two rounding of :mod:`dsv4.ops.numerics` as Triton device functions.

The rounding is written with integer bit operations and exact float arithmetic only (no float8
cast, no approximate division), so it gives the same bits on an H100 and in Triton's CPU
interpreter as the torch reference (whose float8 cast is round-to-nearest-even):

- ``pow2_ceil(v)``: the exponent field plus one if any mantissa bit is set (``numerics.pow2_ceil``).
- ``round_e4m3(v)``: ``v`` (already clamped to +-448) rounded to the e4m3 grid, nearest-even, sign
  kept; the quantum is ``2^(e-3)`` in the normal range and ``2^-9`` below ``2^-6``, and the
  rounding to an integer multiple is the ``(t + 2^23) - 2^23`` idiom (exact for ``0 <= t < 2^22``).
- ``e2m1_code(v)``: ``numerics.e2m1_codes``: count the midpoints below ``|v|``, ties to the even code.

Kernels that must equal an elementwise fp32 reference bit for bit are launched with
``enable_fp_fusion=False`` (no multiply-add contraction on the GPU; the interpreter never fuses).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import KernelUnsupported


class KernelInputError(KernelUnsupported):
    """A small-op kernel was handed inputs it does not implement (shape, dtype, layout)."""


def check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise KernelInputError(f"{op} (triton): {msg}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(op: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        check(t.dtype in FLOAT_DTYPES, op, f"{name} has dtype {t.dtype}; needs float32, float16 or bfloat16")


#: tests set this: outputs are allocated filled with NaN (floats) / 0xFF (integers), so a test can
#: see that every element was written
POISON = False


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer (poisoned under :data:`POISON`)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON:
        if t.is_floating_point():
            t.fill_(float("nan"))
        else:
            t.view(torch.uint8).fill_(0xFF) if t.element_size() == 1 else t.fill_(-1)
    return t


def rows(x: torch.Tensor, inner: int) -> torch.Tensor:
    """``x`` as ``[R, inner]`` with a unit inner stride and one row stride (a view when the layout
    allows, else a contiguous copy: same values, one extra copy)."""
    x2 = x.reshape(-1, inner)
    if inner > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    return x2


def row_stride(x2: torch.Tensor) -> int:
    """The row stride of a ``[R, inner]`` view (any value works for a single row)."""
    return x2.stride(0) if x2.shape[0] > 1 else x2.shape[1]


def pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter: few programs)."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def broadcast_rows(table: torch.Tensor, lead: tuple[int, ...], width: int, op: str, name: str
                   ) -> tuple[torch.Tensor, int]:
    """A per-row table (cos/sin ``[..., width]``) broadcast against rows of shape ``lead``, as a
    contiguous ``[R / G, width]`` plus ``G``: row ``r`` reads table row ``r // G``.

    Covers tables broadcast over trailing lead dims (e.g. ``cos [B, S, 1, rd/2]`` against heads);
    any other broadcast is expanded to one table row per row first (same values)."""
    check(table.shape[-1] == width, op, f"{name} has last dim {table.shape[-1]}; needs {width}")
    tshape = (1,) * (len(lead) + 1 - table.dim()) + tuple(table.shape[:-1])
    check(len(tshape) == len(lead) and all(t in (1, n) for t, n in zip(tshape, lead)), op,
          f"{name} of shape {tuple(table.shape)} does not broadcast against rows {tuple(lead)}")
    k = len(lead)
    while k > 0 and tshape[k - 1] == 1:
        k -= 1
    if tuple(tshape[:k]) == tuple(lead[:k]):
        g = math.prod(lead[k:])
        return table.reshape(-1, width).contiguous(), g
    return table.reshape(*tshape, width).expand(*lead, width).reshape(-1, width).contiguous(), 1


# ----------------------------------------------------------------------------- device functions
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
def fp8_scale(amax, POW2: tl.constexpr):
    """Scale of an FP8 block: ``max(amax, 1e-4) / 448``, rounded up to a power of two when ``POW2``."""
    s = tl.div_rn(tl.maximum(amax, 1e-4), 448.0)
    if POW2:
        s = pow2_ceil(s)
    return s


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
def e4m3_bits(r):
    """The float8_e4m3fn byte (as int32) of an fp32 value ``r`` already on the e4m3 grid."""
    bits = r.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    normal = e >= 121
    big_e = tl.where(normal, e - 120, 0)
    mant = tl.where(normal, (bits >> 20) & 7, (tl.abs(r) * 512.0).to(tl.int32))
    return ((bits >> 24) & 0x80) | (big_e << 3) | mant


@triton.jit
def fp8_round_trip(x, s):
    """``x`` through e4m3 with scale ``s``: ``e4m3(clamp(x / s, -448, 448)) * s`` (fp32)."""
    q = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)
    return round_e4m3(q) * s


@triton.jit
def fp4_scale(amax):
    """Power-of-two scale of an FP4 block: ``2^ceil(log2(max(amax, 6 * 2^-126) / 6))``."""
    return pow2_ceil(tl.div_rn(tl.maximum(amax, 7.052966104933725e-38), 6.0))


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
def e2m1_value(c):
    """The fp32 value of an e2m1 code (``numerics.e2m1_decode``)."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, exp2_biased(tl.maximum(e, 1) + 126) * (1.0 + 0.5 * m))
    return tl.where((c & 8) != 0, neg(mag), mag)
