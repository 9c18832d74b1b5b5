"""The compressor's window pooling and the clamped SwiGLU as Triton kernels.

- ``compress_windows``: grid ``(windows, channel blocks)``; a program holds the window's ``m``
  gate/kv rows (CSA: the previous window's ``a`` halves and this window's ``b`` halves, ``2m`` slots)
  for ``BC`` channels, takes the softmax over the slots per channel and the weighted sum, fp32.
- ``swiglu``: ``silu(min(g, L)) * clamp(u, -L, L)``, elementwise, one pass.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime
from .small_util import check, check_float, pow2, row_stride, rows


@triton.jit
def _compress_kernel(kv_ptr, skv, g_ptr, sg, pkv_ptr, spkv, pg_ptr, spg, y_ptr, M, W, C, COFF,
                     OVERLAP: tl.constexpr, MP: tl.constexpr, BC: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    i = tl.arange(0, MP)[:, None]
    m = (i < M) & (c < C)[None, :]
    off = i * W + COFF + c[None, :]
    g = tl.load(g_ptr + r * sg + off, mask=m, other=-float("inf")).to(tl.float32)
    kv = tl.load(kv_ptr + r * skv + off, mask=m, other=0.0).to(tl.float32)
    mx = tl.max(g, axis=0)
    if OVERLAP:
        poff = i * C + c[None, :]
        pg = tl.load(pg_ptr + r * spg + poff, mask=m, other=-float("inf")).to(tl.float32)
        pkv = tl.load(pkv_ptr + r * spkv + poff, mask=m, other=0.0).to(tl.float32)
        mx = tl.maximum(mx, tl.max(pg, axis=0))
    mx = tl.where(c < C, mx, 0.0)                      # (padding channels: no -inf - -inf)
    if OVERLAP:
        pe = tl.exp(pg - mx[None, :])
        e = tl.exp(g - mx[None, :])
        den = tl.sum(pe, axis=0) + tl.sum(e, axis=0)
        den = tl.where(c < C, den, 1.0)
        y = tl.sum(tl.div_rn(pe, den[None, :]) * pkv, axis=0) + tl.sum(tl.div_rn(e, den[None, :]) * kv, axis=0)
    else:
        e = tl.exp(g - mx[None, :])
        den = tl.where(c < C, tl.sum(e, axis=0), 1.0)
        y = tl.sum(tl.div_rn(e, den[None, :]) * kv, axis=0)
    tl.store(y_ptr + r * C + c, y, mask=c < C)


def compress_windows_triton(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None = None,
                            prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    op = "compress_windows"
    check_float(op, kv=kv, gate=gate)
    check(kv.shape == gate.shape and kv.dim() >= 2, op, f"kv {tuple(kv.shape)} and gate {tuple(gate.shape)} "
          "must be equal [..., m, width]")
    overlap = prev_kv is not None
    check(overlap == (prev_gate is not None), op, "give both prev_kv and prev_gate, or neither")
    M, W = kv.shape[-2], kv.shape[-1]
    lead = tuple(kv.shape[:-2])
    C = W
    if overlap:
        check(W % 2 == 0, op, f"overlapping windows need an even width, got {W}")
        C = W // 2
        want = (*lead, M, C)
        check(tuple(prev_kv.shape) == want and tuple(prev_gate.shape) == want, op,
              f"prev_kv {tuple(prev_kv.shape)} / prev_gate {tuple(prev_gate.shape)}; need {want}")
        check_float(op, prev_kv=prev_kv, prev_gate=prev_gate)
    check(M <= 1024, op, f"windows of {M} rows; at most 1024")
    y = runtime.empty((*lead, C), torch.float32, kv.device)
    R = math.prod(lead)
    if R == 0 or C == 0:
        return y
    kv2, g2 = rows(kv, M * W), rows(gate, M * W)
    pk2 = rows(prev_kv, M * C) if overlap else kv2
    pg2 = rows(prev_gate, M * C) if overlap else g2
    mp = pow2(M)
    bc = max(16, min(pow2(C), 4096 // (mp * (2 if overlap else 1))))
    _compress_kernel[(R, triton.cdiv(C, bc))](kv2, row_stride(kv2), g2, row_stride(g2), pk2, row_stride(pk2), pg2,
                                              row_stride(pg2), y, M, W, C, C if overlap else 0, OVERLAP=overlap,
                                              MP=mp, BC=bc, num_warps=4)
    return y


@triton.jit(do_not_specialize=["n"])
def _swiglu_kernel(g_ptr, u_ptr, y_ptr, n, limit, CLAMP: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    g = tl.load(g_ptr + i, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + i, mask=m, other=0.0).to(tl.float32)
    if CLAMP:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    s = tl.div_rn(g, 1.0 + tl.exp(-g))
    y = s.to(y_ptr.dtype.element_ty).to(tl.float32) * u
    tl.store(y_ptr + i, y.to(y_ptr.dtype.element_ty), mask=m)


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    op = "swiglu"
    check_float(op, gate=gate, up=up)
    check(gate.shape == up.shape and gate.dtype == up.dtype, op,
          f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    g, u = gate.contiguous(), up.contiguous()
    y = runtime.empty(gate.shape, gate.dtype, gate.device)
    n = g.numel()
    if n:
        _swiglu_kernel[(triton.cdiv(n, 1024),)](g, u, y, n, float(limit), CLAMP=limit > 0, BLOCK=1024, num_warps=4)
    return y


REGISTRATIONS = [
    ("compress_windows", None, compress_windows_triton),
    ("swiglu", None, swiglu_triton),
]
