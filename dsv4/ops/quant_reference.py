"""Reference matmul on quantized weights: y = x @ dequant(W).T (DSV4_FACTS section 4).

The executable spec for the fused dequant-GEMM kernels. It reads the weight in its checkpoint
format (dsv4.weights.formats) and expands at most `tile_rows` output rows to fp32 at a time,
so the whole matrix is never materialized; products accumulate in fp32 and the result is
cast back to the activation dtype. Weight-only: an NVFP4 `input_scale` is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4.weights.formats import Bf16Weight, QuantWeight

__all__ = ["quant_linear", "DEFAULT_TILE_ROWS"]

DEFAULT_TILE_ROWS = 1024


def quant_linear(x: torch.Tensor, w: QuantWeight | torch.Tensor,
                 tile_rows: int = DEFAULT_TILE_ROWS) -> torch.Tensor:
    """y = x @ dequant(w).T.

    x: float [..., K]. w: a 2-D weight (N, K) or a plain tensor [N, K] -> returns [..., N];
    a stacked weight (E, N, K) takes x [E, ..., K] (row group e uses expert e) -> [E, ..., N].
    Bf16Weight and plain tensors go straight to F.linear (weight cast to x.dtype); quantized
    weights are dequantized `tile_rows` rows at a time in fp32. Returns x.dtype.
    """
    if tile_rows <= 0:
        raise ValueError(f"quant_linear: tile_rows must be positive, got {tile_rows}")
    if isinstance(w, torch.Tensor):
        _check_in_features(x, tuple(w.shape), w.shape[-1], None)
        if w.dim() != 2:
            raise ValueError(f"quant_linear: plain weight must be 2-D [N, K], got {tuple(w.shape)}")
        return F.linear(x, w.to(x.dtype))
    if not isinstance(w, QuantWeight):
        raise TypeError(f"quant_linear: unsupported weight type {type(w).__name__}")
    _check_in_features(x, w.shape, w.in_features, w.name)
    if w.is_stacked:
        e = w.shape[0]
        if x.dim() < 2 or x.shape[0] != e:
            raise ValueError(f"quant_linear: stacked weight {w.name or ''} {w.shape} needs x of "
                             f"shape [{e}, ..., {w.in_features}], got {tuple(x.shape)}")
        return torch.stack([_linear_2d(x[i], w.expert(i), tile_rows) for i in range(e)])
    return _linear_2d(x, w, tile_rows)


def _linear_2d(x: torch.Tensor, w: QuantWeight, tile_rows: int) -> torch.Tensor:
    """x [..., K] @ dequant(w [N, K]).T -> [..., N] in x.dtype, one row tile at a time."""
    if isinstance(w, Bf16Weight):
        return F.linear(x, w.weight.to(x.dtype))
    n, k = w.shape
    x2 = x.reshape(-1, k).float()  # [M, K]
    out = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)  # [M, N]
    for start in range(0, n, tile_rows):
        stop = min(start + tile_rows, n)
        tile = w.dequantize_rows(start, stop, torch.float32)  # [stop-start, K]
        out[:, start:stop] = x2 @ tile.T
    return out.to(x.dtype).reshape(*x.shape[:-1], n)


def _check_in_features(x: torch.Tensor, w_shape: tuple[int, ...], k: int,
                       name: str | None) -> None:
    if x.shape[-1] != k:
        who = f" {name}" if name else ""
        raise ValueError(f"quant_linear: in_features mismatch, x has shape {tuple(x.shape)} "
                         f"but weight{who} has shape {tuple(w_shape)} (K = {k})")
