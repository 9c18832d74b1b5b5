"""Quantized weight types: weights keep their checkpoint format in memory (DESIGN decision 2).

Implements the formats of DSV4_FACTS section 4:

    Bf16Weight      weight [N, K] (bf16/fp16/fp32)                       w
    Fp8BlockWeight  weight e4m3 [N, K], scale [ceil(N/128), ceil(K/128)]  w * s[n//128, k//128]
    Mxfp4Weight     packed u8 [N, K/2], scale e8m0 [N, K/32]               e2m1 * 2^(e-127)
    Nvfp4Weight     packed u8 [N, K/2], block_scale e4m3 [N, K/16],
                    global_scale fp32 scalar, input_scale fp32 | None     e2m1 * bs * gs

Every type also accepts a leading expert dim (`[E, N, K/2]`, ...) for the routed experts of
a layer: `shape` is then `(E, N, K)`, `expert(e)` gives one expert, `stack([...])` builds one.

FP4 bit layout: two e2m1 codes per byte, the element with the lower index in the LOW nibble;
code bit 3 is the sign, codes 0..7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6. Packed bytes are accepted
as uint8, int8 or torch.float4_e2m1fn_x2 and stored as uint8; e8m0 scales are accepted as
torch.float8_e8m0fnu or uint8 and stored as uint8 exponent bits (value 2^(e-127), 255 = NaN is
rejected). Scales are validated on construction (one host sync, at load time); the bulk
weight data is not scanned.
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any, Callable, ClassVar, Self, Sequence

import torch

from ..errors import Dsv4Error
from ..ops import numerics

__all__ = [
    "WeightFormatError", "QuantWeight", "Bf16Weight", "Fp8BlockWeight", "Mxfp4Weight",
    "Nvfp4Weight", "E2M1_VALUES", "round_to_e2m1", "pack_fp4", "unpack_fp4",
    "e8m0_to_float", "float_to_e8m0", "FormatCode",
]


class WeightFormatError(Dsv4Error, ValueError):
    """A tensor does not match the declared weight format (message names the tensor)."""


FP8_E4M3_MAX = numerics.FP8_E4M3_MAX
FP4_E2M1_MAX = numerics.E2M1_MAX
E2M1_VALUES = torch.tensor(numerics.E2M1_VALUES)  # code -> value, float32 [16]
_FP4_PACKED_DTYPES = (torch.uint8, torch.int8) + (
    (torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ()
)
_E8M0_DTYPES = (torch.uint8,) + (
    (torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ()
)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_E2M1_RMS = math.sqrt(sum(v * v for v in numerics.E2M1_VALUES[:8]) / 8)  # RMS of uniform e2m1 codes


# ----------------------------------------------------------------------------- bit helpers
# The grids and their rounding live in dsv4.ops.numerics; these wrappers add the checks a
# weight-format API owes its callers (dtypes named in errors, off-grid values refused).

def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code), saturating at +-6.

    x: any float [...]. Returns float32 [...] on the e2m1 grid, sign kept (-0.1 -> -0.0).
    """
    return numerics.round_e2m1(x)


def pack_fp4(values: torch.Tensor) -> torch.Tensor:
    """Pack e2m1 values two per byte, lower index in the low nibble.

    values: float [..., K], K even, every value exactly on the e2m1 grid (use round_to_e2m1).
    Returns uint8 [..., K/2]. Raises WeightFormatError for odd K or off-grid values.
    """
    if values.shape[-1] % 2:
        raise WeightFormatError(f"pack_fp4: last dim must be even, got shape {tuple(values.shape)}")
    v = values.float()
    codes = numerics.e2m1_codes(v)
    if not torch.equal(numerics.e2m1_decode(codes), v):
        raise WeightFormatError("pack_fp4: values are not on the e2m1 grid (call round_to_e2m1)")
    return numerics.pack_e2m1(codes)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack e2m1 bytes: uint8/int8/float4_e2m1fn_x2 [..., K/2] -> float32 values [..., K]."""
    p = _as_uint8(packed, None, "packed FP4 data", _FP4_PACKED_DTYPES)
    return numerics.e2m1_decode(numerics.unpack_e2m1(p))


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """e8m0 exponent bits (uint8 or float8_e8m0fnu) [...] -> float32 2^(e-127) [...].

    Exact, including e=0 (2^-127, an fp32 subnormal); e=255 gives NaN (constructors reject it).
    """
    return numerics.e8m0_to_float(_as_uint8(t, None, "e8m0 scale", _E8M0_DTYPES))


def float_to_e8m0(t: torch.Tensor) -> torch.Tensor:
    """Exact powers of two in [2^-127, 2^127] (float [...]) -> uint8 e8m0 bits [...].

    Raises WeightFormatError for anything else (use a rounding rule first, e.g. ceil(log2)).
    """
    mant, exp = torch.frexp(t.float())
    code = exp.long() + 126  # t = 0.5 * 2^exp = 2^(exp-1)
    if not bool(((mant == 0.5) & (code >= 0) & (code <= 254)).all()):
        raise WeightFormatError("float_to_e8m0: values must be powers of two in [2^-127, 2^127]")
    return code.to(torch.uint8)


def _ceil_pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """ceil(log2(x)) for x > 0, computed exactly from frexp. float32 [...] -> int64 [...]."""
    mant, exp = torch.frexp(x)
    return exp.long() - (mant == 0.5).long()


# ----------------------------------------------------------------------------- validation

def _any(mask: torch.Tensor) -> bool:
    """``mask.any()`` read on the host. False on the ``meta`` device: header-only checks of a
    checkpoint build the same weights from data-less tensors, where only shapes can be checked."""
    return not mask.is_meta and bool(mask.any())


def _err(name: str | None, msg: str) -> WeightFormatError:
    return WeightFormatError(f"{name or '<unnamed weight>'}: {msg}")


def _dtype_str(dtypes: Sequence[torch.dtype]) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else f"one of ({', '.join(names)})"


def _require_dtype(t: Any, dtypes: Sequence[torch.dtype], name: str | None, what: str,
                   hint: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise _err(name, f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise _err(name, f"{what} must be {_dtype_str(dtypes)}, got {t.dtype}{hint}")


def _as_uint8(t: Any, name: str | None, what: str, dtypes: Sequence[torch.dtype]) -> torch.Tensor:
    """Reinterpret the bits of an accepted byte-sized dtype as uint8 (no copy)."""
    _require_dtype(t, dtypes, name, what)
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _as_e8m0(t: Any, name: str | None, what: str) -> torch.Tensor:
    """e8m0 scale (float8_e8m0fnu or uint8) -> uint8 exponent bits; code 255 (NaN) rejected."""
    bits = _as_uint8(t, name, what, _E8M0_DTYPES)
    if _any(bits == 255):
        raise _err(name, f"{what} contains e8m0 code 255 (NaN)")
    return bits


def _require_rank(t: torch.Tensor, name: str | None, what: str) -> None:
    if t.dim() not in (2, 3):
        raise _err(name, f"{what} must be 2-D [N, .] or 3-D [E, N, .], got shape {tuple(t.shape)}")


def _require_shape(t: torch.Tensor, want: tuple[int, ...], name: str | None, what: str,
                   layout: str) -> None:
    if tuple(t.shape) != want:
        raise _err(name, f"{what} has shape {tuple(t.shape)}, expected {want} ({layout})")


def _require_device(tensors: Sequence[torch.Tensor | None], name: str | None) -> None:
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise _err(name, f"tensors are on different devices: {sorted(map(str, devices))}")


def _check_float_scale(t: torch.Tensor, name: str | None, what: str) -> None:
    if _any(~torch.isfinite(t)):
        raise _err(name, f"{what} contains NaN or Inf")
    if _any(t < 0):
        raise _err(name, f"{what} contains negative values")


def _check_finite_input(w: torch.Tensor, name: str | None) -> None:
    _require_dtype(w, _FLOAT_DTYPES, name, "weight to quantize")
    _require_rank(w, name, "weight to quantize")
    if not bool(torch.isfinite(w).all()):
        raise _err(name, "weight to quantize contains NaN or Inf")


def _expand_cols(s: torch.Tensor, block: int, k: int) -> torch.Tensor:
    """Per-block scales [..., R, ceil(K/block)] -> per-element [..., R, K]."""
    return s.repeat_interleave(block, dim=-1)[..., :k]


# ----------------------------------------------------------------------------- base class

class FormatCode(enum.IntEnum):
    """Which kernel path a weight takes: the ``FMT`` constexpr of the Triton kernels
    (:meth:`QuantWeight.kernel_operands` gives it with the tensors the kernel reads)."""

    FP8_F32 = 0        # FP8 e4m3, fp32 block scales
    FP8_UE8M0 = 1      # FP8 e4m3, e8m0 (power-of-two) block scales
    MXFP4 = 2          # e2m1 codes, e8m0 scale per 32
    NVFP4 = 3          # e2m1 codes, e4m3 scale per 16, fp32 global scale
    BF16 = 4           # unquantized



class QuantWeight:
    """Common behaviour of the weight types: a few named tensors with optional expert dim.

    Subclasses declare `_tensors` (attribute names, all with the same leading dims; None
    allowed) and `_attrs` (plain attributes that must agree to stack) and implement `shape`,
    `dtype_name` and `dequantize_rows`.
    """

    _tensors: ClassVar[tuple[str, ...]] = ()
    _attrs: ClassVar[tuple[str, ...]] = ()
    name: str | None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Self:
        """The same weight with `fn` applied to every tensor (inputs already validated)."""
        out = copy.copy(self)
        for k in self._tensors:
            t = getattr(self, k)
            setattr(out, k, None if t is None else fn(t))
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, K), or (E, N, K) when stacked; K counts elements, not bytes."""
        raise NotImplementedError

    @property
    def dtype_name(self) -> str:
        raise NotImplementedError

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        raise NotImplementedError

    def kernel_operands(self) -> tuple[FormatCode, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(code, data, scale, global_scale)``: what a kernel reads, as stored (no copy);
        ``None`` where the format has no such tensor."""
        raise NotImplementedError

    @property
    def is_stacked(self) -> bool:
        return len(self.shape) == 3

    @property
    def num_experts(self) -> int | None:
        return self.shape[0] if self.is_stacked else None

    @property
    def out_features(self) -> int:
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def device(self) -> torch.device:
        return getattr(self, self._tensors[0]).device

    @property
    def nbytes(self) -> int:
        """Bytes held by all owned tensors (data plus scales)."""
        ts = [getattr(self, k) for k in self._tensors]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device: torch.device | str) -> Self:
        """A copy of this weight with every tensor on `device` (format unchanged)."""
        return self._map(lambda t: t.to(device))

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The whole weight as `dtype` [N, K] or [E, N, K] (fp32 math, one rounding to `dtype`).

        The reference ops use it per call on the weight they multiply (never at load time); it
        reads no device value on the host and allocates only the result and its temporaries.
        """
        return self.dequantize_rows(0, self.out_features, dtype)

    # -- the tensors as module buffers (dsv4.model.common.Linear registers them) --------------
    #: attribute -> state_dict / on-disk suffix (official and ModelOpt spellings)
    _disk_names: ClassVar[dict[str, str]] = {}

    def tensors(self) -> dict[str, torch.Tensor]:
        """The owned tensors under their on-disk suffixes (``weight``, ``scale``, ...); None omitted."""
        return {disk: getattr(self, attr) for attr, disk in self._disk_names.items()
                if getattr(self, attr) is not None}

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> Self:
        """The same weight over other tensors of the same roles (keys as :meth:`tensors`), not
        validated: for tensors that were this weight's, moved or sliced by a trusted caller."""
        out = copy.copy(self)
        for attr, disk in self._disk_names.items():
            if disk in tensors:
                setattr(out, attr, tensors[disk])
        return out

    def select_experts(self, ids: torch.Tensor) -> Self:
        """A stacked weight of the experts ``ids`` (int64 [n], on the weight's device), in order:
        ``index_select`` on every tensor, no host read, no validation (graph-capturable)."""
        if not self.is_stacked:
            raise _err(self.name, f"select_experts needs a stacked [E, N, K] weight, shape is {self.shape}")
        return self._map(lambda t: t.index_select(0, ids))

    @classmethod
    def _unchecked(cls, name: str | None = None, **attrs: Any) -> Self:
        """An instance over trusted tensors, without validation (random weights, slicing)."""
        out = cls.__new__(cls)
        out.name = name
        for k in cls._tensors:
            setattr(out, k, attrs.pop(k, None))
        for k, v in attrs.items():
            setattr(out, k, v)
        return out

    def slice_experts(self, start: int, stop: int) -> Self:
        """Experts ``[start, stop)`` of a stacked weight (views)."""
        if not self.is_stacked or not 0 <= start < stop <= self.shape[0]:
            raise _err(self.name, f"slice_experts({start}, {stop}) on shape {self.shape}")
        return self._map(lambda t: t[start:stop])

    def expert(self, e: int) -> Self:
        """The 2-D weight of expert `e` of a stacked weight (views, no copy)."""
        if not self.is_stacked:
            raise _err(self.name, f"expert({e}) needs a stacked [E, N, K] weight, shape is "
                       f"{self.shape}")
        if not 0 <= e < self.shape[0]:
            raise _err(self.name, f"expert index {e} out of range [0, {self.shape[0]})")
        return self._map(lambda t: t[e])

    @classmethod
    def stack(cls, weights: Sequence[Self], name: str | None = None) -> Self:
        """Stack 2-D weights of identical shape and format into one [E, N, K] weight."""
        if not weights:
            raise _err(name, "stack() needs at least one weight")
        first = weights[0]
        for i, w in enumerate(weights):
            if type(w) is not cls or w.is_stacked or w.shape != first.shape:
                raise _err(name, f"stack(): item {i} is {w!r}, expected a 2-D {cls.__name__} "
                           f"of shape {first.shape}")
            if w._signature() != first._signature():
                raise _err(name, f"stack(): item {i} differs from item 0 in scale dtype, "
                           "block size, device or input_scale presence")
        out = copy.copy(first)
        out.name = name if name is not None else first.name
        for k in cls._tensors:
            ts = [getattr(w, k) for w in weights]
            setattr(out, k, None if ts[0] is None else torch.stack(ts))
        return out

    def _signature(self) -> tuple:
        ts = [getattr(self, k) for k in self._tensors]
        return (*[getattr(self, k) for k in self._attrs],
                *[None if t is None else (t.dtype, t.device) for t in ts])

    def _check_rows(self, start: int, stop: int) -> None:
        if not 0 <= start <= stop <= self.out_features:
            raise _err(self.name, f"row range [{start}, {stop}) outside [0, {self.out_features}]")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, shape={self.shape}, {self.dtype_name})"


# ----------------------------------------------------------------------------- BF16

class Bf16Weight(QuantWeight):
    """An unquantized weight: float [N, K] or [E, N, K] (bf16, fp16, fp32 or fp64)."""

    _tensors = ("weight",)
    _disk_names = {"weight": "weight"}

    def __init__(self, weight: torch.Tensor, *, name: str | None = None) -> None:
        _require_dtype(weight, _FLOAT_DTYPES, name, "Bf16Weight weight",
                       " (quantized data belongs in Fp8BlockWeight / the FP4 types)")
        _require_rank(weight, name, "weight")
        self.name, self.weight = name, weight

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def dtype_name(self) -> str:
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float64: "fp64"}[self.weight.dtype]

    def kernel_operands(self) -> tuple[FormatCode, torch.Tensor, None, None]:
        return FormatCode.BF16, self.weight, None, None

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows [start, stop) as `dtype`: [stop-start, K] or [E, stop-start, K]."""
        self._check_rows(start, stop)
        return self.weight[..., start:stop, :].to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                 name: str | None = None) -> Self:
        """Cast a float [N, K] / [E, N, K] weight to `dtype` (round to nearest even)."""
        _check_finite_input(w, name)
        return cls(w.to(dtype), name=name)


# ----------------------------------------------------------------------------- FP8 block

class Fp8BlockWeight(QuantWeight):
    """FP8 e4m3 weight with one scale per block x block tile (DeepSeek's FP8 block format).

    weight: float8_e4m3fn [N, K] or [E, N, K]. scale: [..., ceil(N/block), ceil(K/block)],
    float32, or e8m0 (float8_e8m0fnu / uint8 bits; stored as uint8). Ragged edge blocks are
    allowed. Dequantized value: weight[n, k] * scale[n // block, k // block].
    """

    _tensors = ("weight", "scale")
    _attrs = ("block",)
    _disk_names = {"weight": "weight", "scale": "scale"}

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, *, block: int = 128,
                 name: str | None = None) -> None:
        _require_dtype(weight, (torch.float8_e4m3fn,), name, "FP8 block weight")
        _require_rank(weight, name, "FP8 weight")
        _require_dtype(scale, (torch.float32, *_E8M0_DTYPES), name, "FP8 block scale")
        if scale.dtype == torch.float32:
            _check_float_scale(scale, name, "FP8 block scale")
        else:
            scale = _as_e8m0(scale, name, "FP8 block scale")
        *lead, n, k = weight.shape
        want = (*lead, math.ceil(n / block), math.ceil(k / block))
        _require_shape(scale, want, name, "FP8 block scale",
                       f"[ceil(N/{block}), ceil(K/{block})] for weight {tuple(weight.shape)}")
        _require_device([weight, scale], name)
        self.name, self.weight, self.scale, self.block = name, weight, scale, block

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def scale_ue8m0(self) -> bool:
        """True when scales are power-of-two e8m0 (uint8 bits), False for float32."""
        return self.scale.dtype == torch.uint8

    @property
    def dtype_name(self) -> str:
        return "fp8_e4m3_block" + ("_ue8m0" if self.scale_ue8m0 else "")

    def kernel_operands(self) -> tuple[FormatCode, torch.Tensor, torch.Tensor, None]:
        """float8_e4m3fn data; fp32 or e8m0 (uint8) block scales (``block`` is the caller's check)."""
        return (FormatCode.FP8_UE8M0 if self.scale_ue8m0 else FormatCode.FP8_F32), self.weight, self.scale, None

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows [start, stop) as `dtype`: [stop-start, K] or [E, stop-start, K] (fp32 math)."""
        self._check_rows(start, stop)
        rows = torch.arange(start, stop, device=self.scale.device) // self.block
        s = self.scale.index_select(-2, rows)  # [..., R, ceil(K/block)]
        s = e8m0_to_float(s) if self.scale_ue8m0 else s
        w = self.weight[..., start:stop, :].float()  # [..., R, K]
        return (w * _expand_cols(s, self.block, w.shape[-1])).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Whole weight as `dtype`: one broadcast multiply over [.., N/b, b, K/b, b] tiles when the
        blocks are whole (ragged edges take the row-wise path)."""
        *lead, n, k = self.shape
        b = self.block
        if n % b or k % b:
            return self.dequantize_rows(0, n, dtype)
        # power-of-two scales times e4m3 values are exact in bf16: stay in bf16 (half the traffic)
        work = torch.bfloat16 if (dtype == torch.bfloat16 and self.scale_ue8m0) else torch.float32
        s = (e8m0_to_float(self.scale) if self.scale_ue8m0 else self.scale).to(work)
        w = self.weight.to(work).view(*lead, n // b, b, k // b, b)
        return (w * s.unsqueeze(-1).unsqueeze(-3)).view(*lead, n, k).to(dtype)

    @classmethod
    def random(cls, shape: tuple[int, ...], std: float, device: torch.device | str,
               generator: torch.Generator | None = None, *, ue8m0: bool = True, block: int = 128,
               name: str | None = None) -> Self:
        """Random weights with element std ~``std`` made directly on ``device`` in this format
        (benchmarks at real geometry: no BF16 copy, one expert at a time)."""
        *lead, n, k = shape
        weight = torch.empty(*shape, dtype=torch.float8_e4m3fn, device=device)
        for w in (weight.view(-1, n, k) if lead else weight.view(1, n, k)):
            w.copy_(torch.randn(n, k, device=device, generator=generator, dtype=torch.bfloat16) * 64)
        exp = round(math.log2(std / 64))
        sshape = (*lead, math.ceil(n / block), math.ceil(k / block))
        if ue8m0:
            scale = torch.full(sshape, exp + 127, dtype=torch.uint8, device=device)
        else:
            scale = torch.full(sshape, 2.0 ** exp, dtype=torch.float32, device=device)
        return cls._unchecked(name, weight=weight, scale=scale, block=block)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, ue8m0: bool = False, block: int = 128,
                 name: str | None = None) -> Self:
        """Round-to-nearest FP8 block quantization of float [N, K] / [E, N, K].

        scale = amax / 448 per block (ue8m0: rounded up to a power of two, stored as e8m0);
        an all-zero block gets scale 1.
        """
        _check_finite_input(w, name)
        *lead, n, k = w.shape
        nb, kb = math.ceil(n / block), math.ceil(k / block)
        x = torch.nn.functional.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
        amax = x.view(*lead, nb, block, kb, block).abs().amax(dim=(-3, -1))  # [..., nb, kb]
        amax = torch.where(amax > 0, amax, torch.full_like(amax, FP8_E4M3_MAX))
        scale = numerics.div_const(amax, FP8_E4M3_MAX)
        if ue8m0:
            scale = torch.ldexp(torch.ones_like(scale), _ceil_pow2_exponent(scale).clamp(-127, 127))
        full = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :n, :k]
        q = (w.float() / full).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return cls(q, float_to_e8m0(scale) if ue8m0 else scale, block=block, name=name)


# ----------------------------------------------------------------------------- FP4 formats

def _fp4_quant_input(w: torch.Tensor, name: str | None) -> None:
    _check_finite_input(w, name)
    if w.shape[-1] % 2:
        raise _err(name, f"FP4 needs an even K (two values per byte), got shape {tuple(w.shape)}")


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """float [..., K] -> [..., ceil(K/block), block], zero padded."""
    k = x.shape[-1]
    nb = math.ceil(k / block)
    return torch.nn.functional.pad(x, (0, nb * block - k)).view(*x.shape[:-1], nb, block)


class _Fp4Weight(QuantWeight):
    """Shared by the FP4 formats: `packed` uint8 [..., N, K/2] holds two e2m1 codes a byte."""

    packed: torch.Tensor
    dtype_name: ClassVar[str]

    @staticmethod
    def _packed_arg(packed: Any, name: str | None) -> torch.Tensor:
        p = _as_uint8(packed, name, "packed FP4 weight", _FP4_PACKED_DTYPES)
        _require_rank(p, name, "packed FP4 weight")
        return p

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def _values(self, start: int, stop: int) -> torch.Tensor:
        """e2m1 values of rows [start, stop): float32 [..., R, K]."""
        self._check_rows(start, stop)
        return unpack_fp4(self.packed[..., start:stop, :])


class Mxfp4Weight(_Fp4Weight):
    """MXFP4 (OCP microscaling): e2m1 values with one e8m0 scale per 32 along K.

    packed: uint8 (or int8 / float4_e2m1fn_x2) [N, K/2] or [E, N, K/2].
    scale: e8m0 (float8_e8m0fnu or uint8; stored as uint8) [..., N, ceil(K/32)].
    Dequantized value: e2m1[n, k] * 2^(scale[n, k // 32] - 127).
    """

    _tensors = ("packed", "scale")
    _disk_names = {"packed": "weight", "scale": "scale"}
    dtype_name = "mxfp4"

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, *,
                 name: str | None = None) -> None:
        packed = self._packed_arg(packed, name)
        scale = _as_e8m0(scale, name, "MXFP4 scale")
        *lead, n, kh = packed.shape
        _require_shape(scale, (*lead, n, math.ceil(2 * kh / 32)), name, "MXFP4 scale",
                       f"[N, ceil(K/32)] for packed {tuple(packed.shape)}, K = {2 * kh}")
        _require_device([packed, scale], name)
        self.name, self.packed, self.scale = name, packed, scale

    def kernel_operands(self) -> tuple[FormatCode, torch.Tensor, torch.Tensor, None]:
        """uint8 packed codes and e8m0 (uint8) scales per 32."""
        return FormatCode.MXFP4, self.packed, self.scale, None

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows [start, stop) as `dtype`: [stop-start, K] or [E, stop-start, K] (fp32 math)."""
        v = self._values(start, stop)  # [..., R, K]
        s = e8m0_to_float(self.scale[..., start:stop, :])  # [..., R, ceil(K/32)]
        return (v * _expand_cols(s, 32, v.shape[-1])).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Whole weight as `dtype` (packed bytes decoded in fp32, times the e8m0 scale per 32)."""
        return numerics.fp4_dequantize(self.packed, self.scale, 32, dtype)

    @classmethod
    def random(cls, shape: tuple[int, ...], std: float, device: torch.device | str,
               generator: torch.Generator | None = None, *, name: str | None = None) -> Self:
        """Random e2m1 codes (RMS 2.93) with one e8m0 scale giving element std ~``std``."""
        *lead, n, k = shape
        packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device, generator=generator)
        exp = round(math.log2(std / _E2M1_RMS))
        scale = torch.full((*lead, n, math.ceil(k / 32)), exp + 127, dtype=torch.uint8, device=device)
        return cls._unchecked(name, packed=packed, scale=scale)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, name: str | None = None) -> Self:
        """Round-to-nearest MXFP4 of float [N, K] / [E, N, K] (K even).

        scale = 2^ceil(log2(amax / 6)) per 32 values (all-zero block: 1); values = RNE e2m1.
        """
        _fp4_quant_input(w, name)
        xb = _blocks(w.float(), 32)  # [..., N, nb, 32]
        amax = xb.abs().amax(-1)  # [..., N, nb]
        exp = torch.where(amax > 0, _ceil_pow2_exponent(numerics.div_const(amax, FP4_E2M1_MAX)),
                          torch.zeros_like(amax, dtype=torch.long)).clamp(-127, 127)
        scale = torch.ldexp(torch.ones_like(amax), exp)
        q = round_to_e2m1(xb / scale[..., None]).flatten(-2)[..., : w.shape[-1]]
        return cls(pack_fp4(q), (exp + 127).to(torch.uint8), name=name)


class Nvfp4Weight(_Fp4Weight):
    """NVFP4 (ModelOpt): e2m1 values, one e4m3 scale per 16 along K, one fp32 global scale.

    packed: uint8 (or int8 / float4_e2m1fn_x2) [N, K/2] or [E, N, K/2].
    block_scale (`weight_scale`): float8_e4m3fn [..., N, ceil(K/16)].
    global_scale (`weight_scale_2`): float32, shape () or [E] when stacked ([1] accepted).
    input_scale: float32 like global_scale, or None; activation scale, never used here.
    Dequantized value: e2m1[n, k] * block_scale[n, k // 16] * global_scale.
    """

    _tensors = ("packed", "block_scale", "global_scale", "input_scale")
    _disk_names = {"packed": "weight", "block_scale": "weight_scale", "global_scale": "weight_scale_2",
                   "input_scale": "input_scale"}
    dtype_name = "nvfp4"

    def __init__(self, packed: torch.Tensor, block_scale: torch.Tensor,
                 global_scale: torch.Tensor | float,
                 input_scale: torch.Tensor | float | None = None, *,
                 name: str | None = None) -> None:
        packed = self._packed_arg(packed, name)
        *lead, n, kh = packed.shape
        _require_dtype(block_scale, (torch.float8_e4m3fn,), name, "NVFP4 block scale")
        _require_shape(block_scale, (*lead, n, math.ceil(2 * kh / 16)), name, "NVFP4 block scale",
                       f"[N, ceil(K/16)] for packed {tuple(packed.shape)}, K = {2 * kh}")
        bits = block_scale.view(torch.uint8)
        if _any((bits & 0x7F) == 0x7F):
            raise _err(name, "NVFP4 block scale contains NaN (e4m3 code 0x7F/0xFF)")
        if _any(bits > 0x80):
            raise _err(name, "NVFP4 block scale contains negative values")
        global_scale = self._scalar(global_scale, lead, packed.device, name, "NVFP4 global scale")
        if input_scale is not None:
            input_scale = self._scalar(input_scale, lead, packed.device, name, "NVFP4 input scale")
        _require_device([packed, block_scale, global_scale, input_scale], name)
        self.name, self.packed, self.block_scale = name, packed, block_scale
        self.global_scale, self.input_scale = global_scale, input_scale

    def kernel_operands(self) -> tuple[FormatCode, torch.Tensor, torch.Tensor, torch.Tensor]:
        """uint8 packed codes, float8_e4m3fn scales per 16, fp32 global scale (``()`` or ``[E]``)."""
        return FormatCode.NVFP4, self.packed, self.block_scale, self.global_scale

    @staticmethod
    def _scalar(t: torch.Tensor | float, lead: list[int], device: torch.device,
                name: str | None, what: str) -> torch.Tensor:
        """Per-weight fp32 scalar -> shape () (2-D weight) or [E] (stacked; broadcast)."""
        if isinstance(t, (int, float)):
            t = torch.tensor(float(t), dtype=torch.float32, device=device)
        _require_dtype(t, (torch.float32,), name, what)
        if t.numel() == 1 and t.dim() <= 1:
            t = t.reshape(()).expand(*lead).contiguous() if lead else t.reshape(())
        elif tuple(t.shape) != tuple(lead):
            raise _err(name, f"{what} has shape {tuple(t.shape)}, expected () or {tuple(lead)}")
        _check_float_scale(t, name, what)
        return t

    def dequantize_rows(self, start: int, stop: int,
                        dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Rows [start, stop) as `dtype`: [stop-start, K] or [E, stop-start, K] (fp32 math)."""
        v = self._values(start, stop)  # [..., R, K]
        bs = self.block_scale[..., start:stop, :].float()  # [..., R, ceil(K/16)]
        g = self.global_scale.float()[..., None, None]  # [..., 1, 1]
        return (v * _expand_cols(bs, 16, v.shape[-1]) * g).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """Whole weight as `dtype`: e2m1 * e4m3 block scale (per 16) * global scale, fp32 math."""
        *lead, n, kh = self.packed.shape
        k = 2 * kh
        v = numerics.fp4_values(self.packed)  # [..., N, K] fp32
        if k % 16:
            return self.dequantize_rows(0, n, dtype)
        bs = self.block_scale.float().unsqueeze(-1)  # [..., N, K/16, 1]
        g = self.global_scale.float()[..., None, None, None]
        # (v * bs) * g, the same rounding order as dequantize_rows
        return (v.view(*lead, n, k // 16, 16) * bs * g).view(*lead, n, k).to(dtype)

    @classmethod
    def random(cls, shape: tuple[int, ...], std: float, device: torch.device | str,
               generator: torch.Generator | None = None, *, name: str | None = None) -> Self:
        """Random e2m1 codes, e4m3 block scales of 1 and a global scale giving element std ~``std``."""
        *lead, n, k = shape
        packed = torch.randint(0, 256, (*lead, n, k // 2), dtype=torch.uint8, device=device, generator=generator)
        block = torch.ones(*lead, n, math.ceil(k / 16), device=device).to(torch.float8_e4m3fn)
        gs = torch.full(tuple(lead), std / _E2M1_RMS, dtype=torch.float32, device=device)
        return cls._unchecked(name, packed=packed, block_scale=block, global_scale=gs, input_scale=None)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, input_scale: torch.Tensor | float | None = None,
                 name: str | None = None) -> Self:
        """Round-to-nearest NVFP4 of float [N, K] / [E, N, K] (K even; per expert if 3-D).

        global_scale = amax / (6 * 448) (all-zero weight: 1); block_scale = e4m3(amax_block /
        (6 * global_scale)); values = RNE e2m1 of w / (block_scale * global_scale), saturating.
        """
        _fp4_quant_input(w, name)
        x = w.float()
        amax = x.abs().flatten(-2).amax(-1)  # [] or [E]
        gs = torch.where(amax > 0, amax / (FP4_E2M1_MAX * FP8_E4M3_MAX), torch.ones_like(amax))
        xb = _blocks(x, 16)  # [..., N, nb, 16]
        g = gs[..., None, None]
        bs = (xb.abs().amax(-1) / (FP4_E2M1_MAX * g)).to(torch.float8_e4m3fn)  # [..., N, nb]
        denom = bs.float()[..., None] * g[..., None]
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        q = round_to_e2m1(torch.where(denom > 0, xb / safe, torch.zeros_like(xb)))
        packed = pack_fp4(q.flatten(-2)[..., : w.shape[-1]])
        return cls(packed, bs, gs, input_scale, name=name)
