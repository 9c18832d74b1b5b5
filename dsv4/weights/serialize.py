"""On-disk spellings of quantized weights: detect a tensor group's format, and write one back.

DSV4_FACTS section 4. A linear weight ``X.weight`` may come with companions:

==========================  ===========================================================
``X.scale``                 official FP8-block scale (fp32 or e8m0), or MXFP4 scale (e8m0)
``X.weight_scale_inv``      HF spelling of the FP8-block scale
``X.weight_scale``          NVFP4 block scale (e4m3); ModelOpt FP8 per-tensor scale (fp32)
``X.weight_scale_2``        NVFP4 global scale (fp32 scalar)
``X.input_scale``           NVFP4 activation scale (fp32 scalar; unused by weight-only math)
==========================  ===========================================================

The format is read from the tensors present (``weight_scale_2`` -> NVFP4; e4m3 weight + block
scale -> FP8 block; packed bytes + ``[N, K/32]`` e8m0 scale -> MXFP4; a 16/32-bit float weight
alone -> BF16) and anything else is refused by name.
"""

from __future__ import annotations

import math

import torch

from .formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight, QuantWeight, WeightFormatError

COMPANIONS = ("scale", "weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
_PACKED = (torch.uint8, torch.int8) + ((torch.float4_e2m1fn_x2,) if hasattr(torch, "float4_e2m1fn_x2") else ())
_E8M0 = (torch.uint8,) + ((torch.float8_e8m0fnu,) if hasattr(torch, "float8_e8m0fnu") else ())


def split_name(name: str) -> tuple[str, str] | None:
    """``"a.b.weight_scale"`` -> ``("a.b", "weight_scale")`` for weights and their companions."""
    for part in ("weight",) + COMPANIONS:
        if name.endswith("." + part):
            return name[: -len(part) - 1], part
    return None


def build_weight(base: str, parts: dict[str, torch.Tensor]) -> torch.Tensor | QuantWeight:
    """The in-memory weight for ``base`` from its on-disk tensors (``parts``: suffix -> tensor).

    Returns a plain float tensor for unquantized weights, else a packed format object.
    Raises :class:`WeightFormatError` naming ``base`` when the combination is not a known format.
    """
    name = f"{base}.weight"
    w = parts.get("weight")
    if w is None:
        raise WeightFormatError(f"{name}: scale tensor(s) {sorted(parts)} without the weight")
    extra = sorted(set(parts) - {"weight"})
    if "weight_scale_2" in parts:
        if "weight_scale" not in parts or w.dtype not in _PACKED:
            raise WeightFormatError(f"{name}: NVFP4 needs packed uint8 weight + `weight_scale` (e4m3) + "
                                    f"`weight_scale_2`; found weight {w.dtype} with {extra}")
        return Nvfp4Weight(w, parts["weight_scale"], parts["weight_scale_2"], parts.get("input_scale"), name=name)
    if w.dtype == torch.float8_e4m3fn:
        scale = parts.get("scale", parts.get("weight_scale_inv"))
        if scale is None and "weight_scale" in parts and parts["weight_scale"].numel() == 1:
            # ModelOpt FP8 per-tensor scale: the same value on every 128x128 block
            n, k = w.shape[-2:]
            scale = parts["weight_scale"].float().reshape(()).expand(math.ceil(n / 128), math.ceil(k / 128))
            scale = scale.contiguous()
        if scale is None:
            raise WeightFormatError(f"{name}: FP8 e4m3 weight without a `scale` / `weight_scale_inv` tensor")
        return Fp8BlockWeight(w, scale, name=name)
    if w.dtype in _PACKED:
        scale = parts.get("scale")
        if scale is None or scale.dtype not in _E8M0:
            raise WeightFormatError(f"{name}: packed FP4 bytes need an e8m0 `scale` [N, K/32] (MXFP4) or "
                                    f"`weight_scale` + `weight_scale_2` (NVFP4); found {extra}")
        return Mxfp4Weight(w, scale, name=name)
    if w.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if extra:
            raise WeightFormatError(f"{name}: {w.dtype} weight with unexpected scale tensor(s) {extra}")
        return w
    raise WeightFormatError(f"{name}: unsupported weight dtype {w.dtype}")


def weight_tensors(base: str, w: torch.Tensor | QuantWeight, hf_scale_name: bool = False
                   ) -> dict[str, torch.Tensor]:
    """On-disk tensors of ``w`` under ``base``: official names (``.scale``), ModelOpt names for NVFP4.

    FP8-block scales are written as ``weight_scale_inv`` when ``hf_scale_name``. e8m0 scales are
    written as ``float8_e8m0fnu`` when this torch has it (safetensors ``F8_E8M0``).
    """
    if isinstance(w, torch.Tensor):
        return {f"{base}.weight": w}
    if isinstance(w, Nvfp4Weight):
        out = {f"{base}.weight": w.packed, f"{base}.weight_scale": w.block_scale,
               f"{base}.weight_scale_2": w.global_scale}
        if w.input_scale is not None:
            out[f"{base}.input_scale"] = w.input_scale
        return out
    if isinstance(w, Fp8BlockWeight):
        scale = _e8m0_out(w.scale) if w.scale_ue8m0 else w.scale
        return {f"{base}.weight": w.weight, f"{base}.{'weight_scale_inv' if hf_scale_name else 'scale'}": scale}
    if isinstance(w, Mxfp4Weight):
        return {f"{base}.weight": w.packed, f"{base}.scale": _e8m0_out(w.scale)}
    raise TypeError(f"{base}: cannot serialise {type(w).__name__}")


def _e8m0_out(bits: torch.Tensor) -> torch.Tensor:
    if hasattr(torch, "float8_e8m0fnu"):
        return bits.contiguous().view(torch.float8_e8m0fnu)
    return bits
