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
``dsv4.ops.reference``), ``rope_qnorm`` (query path: per-head norm then RoPE) and ``q_kv_prepare``
from ``dsv4.ops.reference_fused``: the two row ops on ``wq_a || wkv``'s output in one launch
(``_q_kv_kernel``, grid ``(programs, 2)``): ``q_norm`` of the query's low-rank rows, and the K=V
path (RMSNorm + RoPE + the cache's rounding, and at decode the window store: the rows encoded into
the ring as ``RowStore.write`` encodes them).
Elementwise stages are exact (``enable_fp_fusion=False``); the norm's mean is a sum in another
order than torch's, so a norm can differ from the reference by an ulp of its statistic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .numerics import e4m3_bits, fp8_round_trip, fp8_scale, neg, pow2_to_e8m0, quantize_e4m3
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


@triton.jit
def _ring_rows_store(yv, col, rm, NOPE, D, r64, slot_ptr, srow_ptr, rows_per_slot, data_ptr, scale_ptr, NSCALE,
                     FP8: tl.constexpr, POW2: tl.constexpr, NBP: tl.constexpr):
    """Write the output rows' non-rope dims ``yv [ROWS, NBP, QBLK]`` (fp32 of the values as output;
    the rope dims are the caller's)
    into a ``RowStore`` at ``(slot, row)`` of each row, encoded as ``RowStore.write`` does: FP8
    codes + a scale per 64 from these values (``FP8``), or a cast. Returns the rows' flat targets."""
    tgt = tl.load(slot_ptr + r64, mask=rm, other=0).to(tl.int64) * rows_per_slot + \
        tl.load(srow_ptr + r64, mask=rm, other=0).to(tl.int64)
    m3 = rm[:, None, None] & (col < NOPE)
    if FP8:
        sc = fp8_scale(tl.max(tl.abs(tl.where(col < NOPE, yv, 0.0)), axis=2), POW2)             # [ROWS, NBP]
        q = quantize_e4m3(tl.div_rn(yv, sc[:, :, None]))
        tl.store(data_ptr + tgt[:, None, None] * NOPE + col, e4m3_bits(q).to(tl.uint8), mask=m3)
        blk = tl.arange(0, NBP)[None, :]
        sm = rm[:, None] & (blk < NSCALE)
        if POW2:
            tl.store(scale_ptr + tgt[:, None] * NSCALE + blk, pow2_to_e8m0(sc).to(tl.uint8), mask=sm)
        else:
            tl.store(scale_ptr + tgt[:, None] * NSCALE + blk, sc, mask=sm)
    else:
        tl.store(data_ptr + tgt[:, None, None] * D + col, yv.to(data_ptr.dtype.element_ty), mask=m3)
    return tgt


@triton.jit(do_not_specialize=["R"])
def _row_kernel(x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
                slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
                NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, FP8: tl.constexpr,
                POW2: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr, QBLK: tl.constexpr,
                BR2: tl.constexpr, STORE: tl.constexpr):
    _rows(tl.program_id(0), x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
          slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
          NORM, ROPE, INVERSE, FP8, POW2, ROWS, NBP, QBLK, BR2, STORE)


@triton.jit(do_not_specialize=["R", "Rk"])
def _q_kv_kernel(x_ptr, sx, w_ptr, y_ptr, sy, R, D, Df, eps,
                 xk_ptr, sxk, wk_ptr, cos_ptr, sin_ptr, yk_ptr, syk, Rk, Dk, Dkf, NOPE, RD2, G, epsk,
                 slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
                 ROWS: tl.constexpr, NBP: tl.constexpr, FP8: tl.constexpr, POW2: tl.constexpr,
                 ROWSK: tl.constexpr, NBPK: tl.constexpr, QBLK: tl.constexpr, BR2: tl.constexpr,
                 STORE: tl.constexpr):
    """The two rows of ``wq_a || wkv`` in one launch: ``program_id(1) == 0`` RMS-norms the query's
    low-rank rows (``rms_norm``), ``1`` prepares the K=V rows (``kv_prepare``, with the store)."""
    if tl.program_id(1) == 0:
        _rows(tl.program_id(0), x_ptr, sx, w_ptr, x_ptr, x_ptr, y_ptr, sy, R, D, Df, D, 1, 1, eps,
              x_ptr, x_ptr, 1, x_ptr, x_ptr, x_ptr, 1,
              2, False, False, False, False, ROWS, NBP, QBLK, 1, False)
    else:
        _rows(tl.program_id(0), xk_ptr, sxk, wk_ptr, cos_ptr, sin_ptr, yk_ptr, syk, Rk, Dk, Dkf, NOPE, RD2, G, epsk,
              slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
              2, True, False, FP8, POW2, ROWSK, NBPK, QBLK, BR2, STORE)


@triton.jit
def _rows(pid, x_ptr, sx, w_ptr, cos_ptr, sin_ptr, y_ptr, sy, R, D, Df, NOPE, RD2, G, eps,
          slot_ptr, srow_ptr, rows_per_slot, s_data, s_scale, s_rope, NSCALE,
          NORM: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr, FP8: tl.constexpr,
          POW2: tl.constexpr, ROWS: tl.constexpr, NBP: tl.constexpr, QBLK: tl.constexpr,
          BR2: tl.constexpr, STORE: tl.constexpr):
    """Program ``pid``'s ``ROWS`` rows (the stages of the module docstring)."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    YDT: tl.constexpr = y_ptr.dtype.element_ty
    r = pid * ROWS + tl.arange(0, ROWS)
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
    tgt = r64
    if STORE:
        # the ring row of each token (a decode step: its row holds pos - W, which no query sees)
        tgt = _ring_rows_store(xn.to(YDT).to(tl.float32), col, rm, NOPE, D, r64, slot_ptr, srow_ptr, rows_per_slot,
                               s_data, s_scale, NSCALE, FP8, POW2, NBP)
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
        if STORE:
            if FP8:     # the store keeps the rope dims apart, as the output dtype
                pr = s_rope + tgt[:, None] * (D - NOPE) + 2 * i
            else:
                pr = s_data + tgt[:, None] * D + ea
            RT = pr.dtype.element_ty
            tl.store(pr, ra.to(XDT).to(YDT).to(RT), mask=m2)
            tl.store(pr + 1, rb.to(XDT).to(YDT).to(RT), mask=m2)


def _launch(op: str, x: torch.Tensor, out_dtype: torch.dtype, **kw) -> torch.Tensor:
    """One ``_row_kernel`` launch for ``x``'s rows (see :func:`_plan`); returns the output."""
    y, args, consts, programs, warps = _plan(op, x, out_dtype, **kw)
    if programs:
        _row_kernel[(programs,)](*args, **consts, num_warps=warps, enable_fp_fusion=False)
    return y


def _plan(op: str, x: torch.Tensor, out_dtype: torch.dtype, *, norm: int = 0, weight=None, eps: float = 0.0,
          cos=None, sin=None, inverse: bool = False, fp8_nope: int | None = None, pow2_scales: bool = True,
          store=None, slot_idx=None, row_idx=None) -> tuple[torch.Tensor, tuple, dict, int, int]:
    """Check the inputs of a row op and allocate its output: ``(y, the kernel's arguments, its
    constexprs, programs (0: no rows), warps)``."""
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
    st = (x2, x2, 1, x2, x2, x2, 1)       # pointers and sizes the kernel never reads without STORE
    if store is not None:
        check(cos is not None and tuple(slot_idx.shape) == lead and tuple(row_idx.shape) == lead, op,
              f"storing rows needs RoPE and slot / row indices of shape {lead}, got {tuple(slot_idx.shape)} / "
              f"{tuple(row_idx.shape)}")
        check(not slot_idx.is_floating_point() and not row_idx.is_floating_point(), op, "indices must be integers")
        for t in store.tensors():
            check(t.is_contiguous() and t.device == x.device, op, "store tensors must be contiguous, on x's device")
        if fp8_nope is None:
            check(store.data.dtype == out_dtype, op, f"plain store of {store.data.dtype}; rows are {out_dtype}")
            st = (slot_idx.reshape(-1), row_idx.reshape(-1), store.data.shape[1], store.data, store.data, store.data, 1)
        else:
            check(store.rope.dtype == out_dtype and store.scale.shape[-1] == triton.cdiv(nope, _FP8_BLOCK), op,
                  f"fp8 store: rope part {store.rope.dtype} (rows are {out_dtype}), {store.scale.shape[-1]} scales")
            st = (slot_idx.reshape(-1), row_idx.reshape(-1), store.data.shape[1], store.data.view(torch.uint8),
                  store.scale, store.rope, store.scale.shape[-1])
        st = (st[0].contiguous(), st[1].contiguous(), *st[2:])
    nbp = pow2(triton.cdiv(D, _FP8_BLOCK))
    tile = nbp * _FP8_BLOCK
    # rows per program: one while a row each leaves every SM two programs or fewer, else a full
    # 4096-value tile of rows. Two choices, not one per row count: every variant is a compile,
    # and prompt lengths (and the row counts derived from them) vary without end
    big = max(1, 4096 // tile)
    n_rows = big if R >= 2 * runtime.sm_count(x.device) * big else 1
    dummy = x2
    args = (x2, row_stride(x2), weight if weight is not None else dummy, cos if cos is not None else dummy,
            sin if sin is not None else dummy, y, D, R, D, float(D), nope, max(rd2, 1), g, float(eps), *st)
    consts = dict(NORM=norm, ROPE=cos is not None, INVERSE=bool(inverse), FP8=fp8_nope is not None,
                  POW2=bool(pow2_scales), ROWS=n_rows, NBP=nbp, QBLK=_FP8_BLOCK, BR2=pow2(max(rd2, 1)),
                  STORE=store is not None)
    return y, args, consts, triton.cdiv(R, n_rows), 8 if n_rows * tile >= 4096 else 4


# ----------------------------------------------------------------------------- ops
def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rms_norm", x, x.dtype, norm=2, weight=weight, eps=eps)


def rms_norm_unweighted_triton(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rms_norm_unweighted", x, x.dtype, norm=1, eps=eps)


def apply_rope_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return _launch("apply_rope", x, x.dtype, cos=cos, sin=sin, inverse=inverse)


def rope_qnorm_triton(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch("rope_qnorm", q, q.dtype, norm=1, eps=eps, cos=cos, sin=sin)


def q_kv_prepare_triton(qa: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv: torch.Tensor,
                        kv_weight: torch.Tensor, kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, store: object,
                        slot_idx: torch.Tensor | None = None, row_idx: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Both row ops after ``wq_a || wkv`` in one launch; see :func:`dsv4.ops.reference_fused.q_kv_prepare`."""
    op = "q_kv_prepare"
    layout = getattr(store, "layout", None)
    check(layout in ("plain", "fp8"), op, f"store layout {layout!r}; implemented: 'plain', 'fp8'")
    check(store.dim == kv.shape[-1], op, f"store rows hold {store.dim} values; kv has {kv.shape[-1]}")
    check(qa.shape[:-1] == kv.shape[:-1], op, f"qa {tuple(qa.shape)} and kv {tuple(kv.shape)}: one row each a token")
    at = dict(store=store, slot_idx=slot_idx, row_idx=row_idx) if slot_idx is not None else {}
    if layout == "fp8":
        check(store.scale.dtype == (torch.uint8 if store.pow2 else torch.float32), op,
              f"fp8 store with pow2={store.pow2} has {store.scale.dtype} scales")
        at.update(fp8_nope=store.data.shape[-1], pow2_scales=store.pow2)
    yq, qargs, qc, qprog, qwarps = _plan(op, qa, qa.dtype, norm=2, weight=q_weight, eps=q_eps)
    yk, kargs, kc, kprog, kwarps = _plan(op, kv, store.dtype, norm=2, weight=kv_weight, eps=kv_eps, cos=cos, sin=sin,
                                         **at)
    if qprog:
        x2, sx, w, _, _, y, sy, R, D, Df, _, _, _, eps = qargs[:14]
        _q_kv_kernel[(max(qprog, kprog), 2)](
            x2, sx, w, y, sy, R, D, Df, eps, *kargs,
            ROWS=qc["ROWS"], NBP=qc["NBP"], FP8=kc["FP8"], POW2=kc["POW2"], ROWSK=kc["ROWS"], NBPK=kc["NBP"],
            QBLK=_FP8_BLOCK, BR2=kc["BR2"], STORE=kc["STORE"], num_warps=max(qwarps, kwarps), enable_fp_fusion=False)
    return yq, yk


REGISTRATIONS = [
    ("rms_norm", None, rms_norm_triton),
    ("rms_norm_unweighted", None, rms_norm_unweighted_triton),
    ("apply_rope", None, apply_rope_triton),
    ("rope_qnorm", None, rope_qnorm_triton),
    ("q_kv_prepare", None, q_kv_prepare_triton),
]
