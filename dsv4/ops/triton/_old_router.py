"""The MoE router as Triton kernels (``dsv4.ops.router``): the gate's projection, scores, top-k
(or the hash table) and weights, what :func:`dsv4.ops.reference.router` composes (DSV4_FACTS
section 2, "MoE"):

    logits = x gate^T                 fp32 accumulation, the input never rounded
    scores = sqrt(softplus(logits))  (or sigmoid, softmax)
    ids    = tid2eid[token_id]        hash layers: the table lookup
           = top-k of scores + bias   the others: k rounds of (max, lowest index at the max)
    w      = scores[ids] / (sum + 1e-20) * routed_scaling_factor

Decode (up to ``GATE_MAX_TOKENS`` tokens, a plain gate weight): one launch. ``_gate_router_kernel``,
grid ``(expert tiles, K splits)``, writes fp32 partial logits; the last program to arrive (an
arrival counter, re-armed by that program) sums them in split order and routes every token.
Prefill (or a packed gate): the projection by ``dsv4.ops.linear``, then ``_router_kernel``, one
program a token. Softplus is torch's: ``x`` above 20, else ``log1p(exp(x))`` (to an ulp or so).
The picks come out in descending order of ``scores + bias`` like ``torch.topk``; an exact tie goes
to the lower expert index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .small_util import KernelInputError, check, check_float, pow2, row_stride, rows

_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_MAX_EXPERTS = 1024
#: tokens up to which the gate's projection runs in the routing kernel (decode); above, a GEMM first
GATE_MAX_TOKENS = 8
#: the fused kernel's tiles: experts per program, K per step, K splits
_GATE_BE, _GATE_BK, _GATE_SPLITS = 16, 128, 8


@triton.jit
def _log1p(y):
    """``log(1 + y)`` to an ulp or so for ``y >= 0`` (Goldberg's form: the rounding of ``1 + y``
    cancels), without libdevice (Triton's interpreter has none)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, u - 1.0))


@triton.jit
def _route_row(x, e, t, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale,
               FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
               HASH: tl.constexpr, BIAS: tl.constexpr):
    """Token ``t``'s routing from its fp32 logits ``x [EP]`` (``e`` their expert indices)."""
    em = e < E
    if FUNC == 0:
        s = tl.sqrt_rn(tl.where(x > 20.0, x, _log1p(tl.exp(x))))
    elif FUNC == 1:
        s = tl.sigmoid(x)
    else:
        ex = tl.where(em, tl.exp(x - tl.max(tl.where(em, x, -float("inf")), axis=0)), 0.0)
        s = tl.div_rn(ex, tl.sum(ex, axis=0))
    j = tl.arange(0, KP)
    jm = j < K
    if HASH:
        tok = tl.load(tok_ptr + t)
        ids = tl.load(table_ptr + tok * K + j, mask=jm, other=0).to(tl.int32)
    else:
        sel = s
        if BIAS:
            sel = s + tl.load(bias_ptr + e, mask=em, other=0.0)
        sel = tl.where(em, sel, -float("inf"))
        ids = tl.zeros([KP], tl.int32)
        for i in tl.static_range(K):
            top = tl.max(sel, axis=0)
            pick = tl.min(tl.where(sel == top, e, EP), axis=0)
            ids = tl.where(j == i, pick, ids)
            sel = tl.where(e == pick, -float("inf"), sel)
    w = tl.sum(tl.where(e[None, :] == ids[:, None], s[None, :], 0.0), axis=1)          # scores[ids]
    w = tl.where(jm, w, 0.0)
    w = tl.div_rn(w, tl.sum(w, axis=0) + 1e-20) * scale
    tl.store(w_ptr + t * K + j, w, mask=jm)
    tl.store(ids_ptr + t * K + j, ids.to(tl.int64), mask=jm)


@triton.jit
def _router_kernel(logits_ptr, sl, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale,
                   FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                   HASH: tl.constexpr, BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, EP)
    x = tl.load(logits_ptr + t * sl + e, mask=e < E, other=0.0).to(tl.float32)
    _route_row(x, e, t, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale, FUNC, K, KP, EP, HASH, BIAS)


@triton.jit(do_not_specialize=["T"])
def _gate_router_kernel(x_ptr, sx, g_ptr, part_ptr, cnt_ptr, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr,
                        T, E, D, KCHUNK, scale,
                        FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                        HASH: tl.constexpr, BIAS: tl.constexpr, TP: tl.constexpr, BE: tl.constexpr,
                        BK: tl.constexpr, SP: tl.constexpr, PREC: tl.constexpr):
    """The gate's projection split over (expert tiles, K splits), fp32 partials; the last program to
    arrive sums them in split order and routes every token (``_route_row``)."""
    pid_e = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = tl.arange(0, TP)
    tm = t < T
    e = pid_e * BE + tl.arange(0, BE)
    em = e < E
    acc = tl.zeros([TP, BE], tl.float32)
    k_lo = pid_s * KCHUNK
    kk = 0
    while kk < KCHUNK:              # (while, not range: Triton's interpreter under numpy 2.4 needs it)
        k = k_lo + kk + tl.arange(0, BK)
        km = k < D
        xv = tl.load(x_ptr + t[:, None].to(tl.int64) * sx + k[None, :], mask=tm[:, None] & km[None, :], other=0.0)
        gv = tl.load(g_ptr + e[:, None].to(tl.int64) * D + k[None, :], mask=em[:, None] & km[None, :], other=0.0)
        acc = tl.dot(xv, tl.trans(gv.to(xv.dtype)), acc, input_precision=PREC)
        kk += BK
    tl.store(part_ptr + (pid_s * TP + t)[:, None] * EP + e[None, :], acc, mask=tm[:, None] & em[None, :])
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) * tl.num_programs(1) - 1:
        ee = tl.arange(0, EP)
        sp = tl.arange(0, SP)
        m2 = (sp < tl.num_programs(1))[:, None] & (ee < E)[None, :]
        tt = 0
        while tt < T:
            x = tl.sum(tl.load(part_ptr + (sp[:, None] * TP + tt) * EP + ee[None, :], mask=m2, other=0.0,
                               cache_modifier=".cg"), axis=0)
            _route_row(x, ee, tt, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale, FUNC, K, KP, EP,
                       HASH, BIAS)
            tt += 1
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")       # ready for the next call


def router_triton(x: torch.Tensor, weight: object, func: str, k: int, bias: torch.Tensor | None = None,
                  tid2eid: torch.Tensor | None = None, token_ids: torch.Tensor | None = None,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    op = "router"
    check(func in _FUNCS, op, f"scoring function {func!r}; implemented: {', '.join(_FUNCS)}")
    E, D = weight.shape[-2], weight.shape[-1]
    check(len(weight.shape) == 2 and x.shape[-1] == D, op,
          f"x {tuple(x.shape)} and gate weight {tuple(weight.shape)} do not match ([T, D], [E, D])")
    check_float(op, x=x)
    x2 = rows(x, D)
    T = x2.shape[0]
    check(0 < k <= E <= _MAX_EXPERTS, op, f"top-{k} of {E} experts; the kernel holds 1..{_MAX_EXPERTS}")
    hashed = tid2eid is not None
    check(hashed == (token_ids is not None), op, "give tid2eid and token_ids together")
    if hashed:
        check(tid2eid.dim() == 2 and tid2eid.shape[1] == k and tid2eid.is_contiguous()
              and tid2eid.dtype in (torch.int32, torch.int64), op,
              f"tid2eid {tid2eid.dtype} {tuple(tid2eid.shape)}; needs a contiguous int [vocab, {k}] table")
        check(token_ids.numel() == T and token_ids.dtype in (torch.int32, torch.int64), op,
              f"token_ids {token_ids.dtype} {tuple(token_ids.shape)}; needs {T} int ids")
        token_ids = token_ids.reshape(T).contiguous()
    if bias is not None:
        check(tuple(bias.shape) == (E,) and bias.dtype == torch.float32, op,
              f"bias {bias.dtype} {tuple(bias.shape)}; needs fp32 ({E},)")
        bias = bias.contiguous()
    plain = isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16, torch.float32) \
        and weight.is_contiguous()
    fused = plain and T <= GATE_MAX_TOKENS and weight.dtype == x.dtype
    counters = None
    if fused:
        try:
            counters = runtime.counters(x.device, 1, "router")
        except runtime.CounterError as e:
            raise KernelInputError(str(e)) from None
    w = runtime.empty((T, k), torch.float32, x.device)
    ids = runtime.empty((T, k), torch.int64, x.device)
    if T == 0:
        return w, ids
    dummy = w
    route = dict(FUNC=_FUNCS[func], K=k, KP=pow2(k), EP=pow2(E), HASH=hashed, BIAS=bias is not None)
    tables = (bias if bias is not None else dummy, tid2eid if hashed else dummy, token_ids if hashed else dummy)
    if fused:
        # decode: the projection and the routing in one launch (a few tokens: the last program routes them all)
        splits = max(1, min(_GATE_SPLITS, triton.cdiv(D, _GATE_BK)))
        kchunk = triton.cdiv(triton.cdiv(D, splits), _GATE_BK) * _GATE_BK
        splits = triton.cdiv(D, kchunk)
        tp = max(16, pow2(T))
        part = runtime.empty((splits, tp, pow2(E)), torch.float32, x.device)
        _gate_router_kernel[(triton.cdiv(E, _GATE_BE), splits)](
            x2, row_stride(x2), weight, part, counters, *tables, w, ids, T, E, D, kchunk, float(scale),
            TP=tp, BE=_GATE_BE, BK=_GATE_BK, SP=pow2(splits),
            PREC="ieee" if x.dtype == torch.float32 else None, num_warps=4, **route)
        return w, ids
    # prefill (or a packed gate): the projection by the linear op, then one program a token
    from .. import linear
    logits = linear(x2, weight, False, True, torch.float32)
    _router_kernel[(T,)](logits, logits.stride(0), *tables, w, ids, E, float(scale),
                         num_warps=4 if E > 512 else 2, **route)
    return w, ids


REGISTRATIONS = [("router", None, router_triton)]
