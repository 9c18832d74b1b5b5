"""Row kernels: RMSNorm (weighted / per-head unweighted), RoPE, and their fusions with the FP8
round trip of the KV cache, one launch each.

One kernel, ``_row_kernel``, serves every op here; constexpr flags pick the stages. A program
owns ``ROWS`` rows, each held as a ``[NBP, QBLK]`` tile (``QBLK`` = the FP8 block, 64, so the
per-block amax of the FP8 round trip is one reduction over the last axis):

    x row --(NORM: rsqrt(mean x^2 + eps), weighted or unweighted)--> x.dtype
          --(nope dims: FP8 round trip per 64 when FP8)--> out.dtype
          --(last rd dims: interleaved-pair rotation by cos/sin, fp32)--> x.dtype -> out.dtype

The rope pairs are re-read from memory as ``[ROWS, rd/2]`` even/odd tiles (an L1 hit) and go
through the same normalisation arithmetic, so no register shuffles are needed.

Ops: ``rms_norm``, ``rms_norm_unweighted``, ``apply_rope`` (the references in
``dsv4.ops.reference``), ``rope_qnorm`` (query path: per-head norm then RoPE) and ``kv_prepare``
(K=V path: RMSNorm + RoPE + the cache's rounding) from ``dsv4.ops.reference_fused``.
Elementwise stages are exact (``enable_fp_fusion=False``); the norm's mean is a sum in another
order than torch's, so a norm can differ from the reference by an ulp of its statistic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .numerics import fp8_round_trip, fp8_scale, neg
from .small_util import broadcast_rows, check, check_float, pow2, row_stride, rows

_FP8_BLOCK = 64
_MAX_ROW = 16384


@triton.jit
def _normalize(x, w, inv, NORM: tl.constexpr, XDT: tl.constexpr):
    """The normalised values in the input dtype (``x``, ``w`` fp32; ``inv`` broadcast to ``x``)."""
    if NORM == 1:
        x = x * inv
    elif NORM == 2:
        x = w * (x * inv)
    return x.to(XDT).to(tl.float32)


@triton.jit(do_not_specialize=["R"])
def _row_kernel(x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
                NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, FP8: tl.constexpr,
                POW2: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr, QBLK: tl.constexpr,
                BR2: tl.constexpr):
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    YDT: tl.constexpr = y_ptr.dtype.element_ty
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rm = r < R
    r64 = r.to(tl.int64)
    col = tl.arange(0, NBP)[None, :, None] * QBLK + tl.arange(0, QBLK)[None, None, :]   # [1, NBP, QBLK]
    m3 = rm[:, None, None] & (col < D)
    x = tl.load(x_ptr + r64[:, None, None] * sx + col, mask=m3, other=0.0).to(tl.float32)
    inv = tl.zeros([ROWS], tl.float32)
    w = x
    if NORM != 0:
        ss = tl.sum(tl.sum(x * x, axis=2), axis=1)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, Df) + eps))
        if NORM == 1:
            inv = inv.to(XDT).to(tl.float32)     # rms_norm_unweighted multiplies in x.dtype
        if NORM == 2:
            w = tl.load(w_ptr + col, mask=col < D, other=0.0).to(tl.float32)
    xn = _normalize(x, w, inv[:, None, None], NORM, XDT)
    if FP8:
        amax = tl.max(tl.abs(tl.where(col < NOPE, xn, 0.0)), axis=2)                   # [ROWS, NBP]
        xn = fp8_round_trip(xn, fp8_scale(amax, POW2)[:, :, None])
    tl.store(y_ptr + r64[:, None, None] * sy + col, xn.to(YDT), mask=m3 & (col < NOPE))
    if ROPE:
        i = tl.arange(0, BR2)[None, :]
        m2 = rm[:, None] & (i < RD2)
        ea = NOPE + 2 * i
        pa = x_ptr + r64[:, None] * sx + ea
        a = tl.load(pa, mask=m2, other=0.0).to(tl.float32)
        b = tl.load(pa + 1, mask=m2, other=0.0).to(tl.float32)
        wa = a
        wb = b
        if NORM == 2:
            wa = tl.load(w_ptr + ea, mask=m2, other=0.0).to(tl.float32)
            wb = tl.load(w_ptr + ea + 1, mask=m2, other=0.0).to(tl.float32)
        a = _normalize(a, wa, inv[:, None], NORM, XDT)
        b = _normalize(b, wb, inv[:, None], NORM, XDT)
        t = (r64 // G)[:, None] * RD2 + i
        c = tl.load(cos_ptr + t, mask=m2, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t, mask=m2, other=0.0).to(tl.float32)
        if INVERSE:
            s = neg(s)
        ra = a * c - b * s
        rb = a * s + b * c
        py = y_ptr + r64[:, None] * sy + ea
        tl.store(py, ra.to(XDT).to(YDT), mask=m2)
        tl.store(py + 1, rb.to(XDT).to(YDT), mask=m2)


def _launch(op: str, x: torch.Tensor, out_dtype: torch.dtype, *, norm: int = 0, weight=None, eps: float = 0.0,
            cos=None, sin=None, inverse: bool = False, fp8_nope: int | None = None, pow2_scales: bool = True
            ) -> torch.Tensor:
    check_float(op, x=x)
    D = x.shape[-1]
    check(x.dim() >= 1 and D >= 1, op, f"x has shape {tuple(x.shape)}")
    check(D <= _MAX_ROW, op, f"rows of {D} values; this kernel holds at most {_MAX_ROW} per row")
    lead = tuple(x.shape[:-1])
    x2 = rows(x, D)
    R = x2.shape[0]
    y = runtime.empty(x.shape, out_dtype, x.device)
    rd2 = 0
    g = 1
    if cos is not None:
        rd2 = cos.shape[-1]
        check(sin.shape == cos.shape, op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
        check(0 < 2 * rd2 <= D, op, f"rope dims {2 * rd2} (2 * cos.shape[-1]) do not fit in the last dim {D}")
        check_float(op, cos=cos, sin=sin)
        cos, g = broadcast_rows(cos, lead, rd2, op, "cos")
        sin, _ = broadcast_rows(sin, lead, rd2, op, "sin")
    nope = D - 2 * rd2
    if fp8_nope is not None:
        check(fp8_nope == nope, op, f"the store keeps {fp8_nope} FP8 dims but the rope leaves {nope}")
    if weight is not None:
        check(tuple(weight.shape) == (D,), op, f"weight has shape {tuple(weight.shape)}; needs ({D},)")
        check_float(op, weight=weight)
        weight = weight.contiguous()
    if R == 0:
        return y
    nbp = pow2(triton.cdiv(D, _FP8_BLOCK))
    tile = nbp * _FP8_BLOCK
    # rows per program: one while a row each leaves every SM two programs or fewer, else a full
    # 4096-value tile of rows. Two choices, not one per row count: every variant is a compile,
    # and prompt lengths (and the row counts derived from them) vary without end
    big = max(1, 4096 // tile)
    n_rows = big if R >= 2 * runtime.sm_count(x.device) * big else 1
    dummy = x2
    _row_kernel[(triton.cdiv(R, n_rows),)](
        x2, row_stride(x2), weight if weight is not None else dummy, cos if cos is not None else dummy,
        sin if sin is not None else dummy, y, D, R, D, float(D), nope, max(rd2, 1), g, float(eps),
        NORM=norm, ROPE=cos is not None, INVERSE=bool(inverse), FP8=fp8_nope is not None, POW2=bool(pow2_scales),
        ROWS=n_rows, NBP=nbp, QBLK=_FP8_BLOCK, BR2=pow2(max(rd2, 1)),
        num_warps=8 if n_rows * tile >= 4096 else 4, enable_fp_fusion=False)
    return y


# ----------------------------------------------------------------------------- ops
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rms_norm", x, x.dtype, norm=2, weight=weight, eps=eps)


def rms_norm_unweighted_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rms_norm_unweighted", x, x.dtype, norm=1, eps=eps)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return _launch("apply_rope", x, x.dtype, cos=cos, sin=sin, inverse=inverse)


def rope_qnorm_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rope_qnorm", q, q.dtype, norm=1, eps=eps, cos=cos, sin=sin)


def kv_prepare_triton(kv: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      store: object) -> torch.Tensor:
    op = "kv_prepare"
    layout = getattr(store, "layout", None)
    check(layout in ("plain", "fp8"), op, f"store layout {layout!r}; implemented: 'plain', 'fp8'")
    check(store.dim == kv.shape[-1], op, f"store rows hold {store.dim} values; kv has {kv.shape[-1]}")
    if layout == "plain":
        return _launch(op, kv, store.dtype, norm=2, weight=weight, eps=eps, cos=cos, sin=sin)
    check(store.scale.dtype == (torch.uint8 if store.pow2 else torch.float32), op,
          f"fp8 store with pow2={store.pow2} has {store.scale.dtype} scales")
    return _launch(op, kv, store.dtype, norm=2, weight=weight, eps=eps, cos=cos, sin=sin,
                   fp8_nope=store.data.shape[-1], pow2_scales=store.pow2)


REGISTRATIONS = [
    ("rms_norm", None, rms_norm_triton),
    ("rms_norm_unweighted", None, rms_norm_unweighted_triton),
    ("apply_rope", None, apply_rope_triton),
    ("rope_qnorm", None, rope_qnorm_triton),
    ("kv_prepare", None, kv_prepare_triton),
]
