"""The MoE router as Triton kernels (``dsv4.ops.router``): the gate's projection, scores, top-k
(or the hash table) and weights, what :func:`dsv4.ops.reference.router` composes (DSV4_FACTS
section 2, "MoE"):

    logits = x gate^T                 fp32 accumulation, the input never rounded
    scores = sqrt(softplus(logits))  (or sigmoid, softmax)
    ids    = tid2eid[token_id]        hash layers: the table lookup
           = top-k of scores + bias   the others: k rounds of (max, lowest index at the max)
    w      = scores[ids] / (sum + 1e-20) * routed_scaling_factor

Decode (up to ``GATE_MAX_TOKENS`` tokens, a plain gate weight): one launch. ``_gate_router_kernel``,
grid ``(expert tiles, K splits)``, writes fp32 partial logits; the last split of each expert tile to
arrive sums that tile's partials (an arrival counter a tile, re-armed by that program), and the last
tile to finish routes every token at once (one more counter). H100, Flash (bench/router_bench.py):
8.0 / 9.4 / 11.6 us at 1 / 4 / 8 tokens, where a last program routing the tokens one after another
took 8.3 / 17.6 / 30.0 us.
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
from .numerics import ordered_key
from .small_util import KernelInputError, check, check_float, pow2, row_stride, rows

_FUNCS = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_MAX_EXPERTS = 1024
#: tokens up to which the gate's projection runs in the routing kernel (decode); above, a GEMM first
GATE_MAX_TOKENS = 8
#: the fused kernel's tiles: experts per program, K per step, K splits (H100, bench/router_bench.py:
#: 4 to 32 splits within 10% of each other; 16 keep Flash's 256 programs in one wave at <= 156 registers)
_GATE_BE, _GATE_BK, _GATE_SPLITS = 16, 128, 16


@triton.jit
def _log1p(y):
    """``log(1 + y)`` to an ulp or so for ``y >= 0`` (Goldberg's form: the rounding of ``1 + y``
    cancels), without libdevice (Triton's interpreter has none)."""
    u = 1.0 + y
    return tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, u - 1.0))


@triton.jit
def _route_rows(x, e, t, tm, s_ptr, ss, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale,
                FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                HASH: tl.constexpr, BIAS: tl.constexpr, R: tl.constexpr):
    """Tokens ``t [R]``'s routing (rows ``tm`` real) from their fp32 logits ``x [R, EP]`` (``e [EP]``
    the expert indices), all rows at once; ``s_ptr`` (row stride ``ss``) is this program's scratch
    for the scores (the picks' weights are read back from it). Every row runs the same arithmetic
    whatever the other rows (the weights summed in pick order), so a token routes the same bits in
    any batch. A pick is one max over (score + bias, lower index first) keys."""
    em = (e < E)[None, :]
    if FUNC == 0:
        s = tl.sqrt_rn(tl.where(x > 20.0, x, _log1p(tl.exp(x))))
    elif FUNC == 1:
        s = tl.sigmoid(x)
    else:
        ex = tl.where(em, tl.exp(x - tl.max(tl.where(em, x, -float("inf")), axis=1)[:, None]), 0.0)
        s = tl.div_rn(ex, tl.sum(ex, axis=1)[:, None])
    rows = t.to(tl.int64)[:, None] * ss
    tl.debug_barrier()          # (the scratch may hold the logits x: every thread has read them)
    tl.store(s_ptr + rows + e[None, :], s, mask=tm[:, None] & em)
    j = tl.arange(0, KP)[None, :]
    jm = tm[:, None] & (j < K)
    if HASH:
        tok = tl.load(tok_ptr + t, mask=tm, other=0)
        ids = tl.load(table_ptr + tok[:, None] * K + j, mask=jm, other=0).to(tl.int32)
    else:
        sel = s
        if BIAS:
            sel = s + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :]
        key = tl.where(em, ordered_key(sel, e[None, :]), -9223372036854775808)
        ids = tl.zeros([R, KP], tl.int32)
        for i in tl.static_range(K):
            best = tl.max(key, axis=1)
            pick = (4294967295 - (best & 4294967295)).to(tl.int32)
            ids = tl.where(j == i, pick[:, None], ids)
            key = tl.where(e[None, :] == pick[:, None], -9223372036854775808, key)
    tl.debug_barrier()          # the scores stored above, read back by other threads
    w = tl.load(s_ptr + rows + ids, mask=jm, other=0.0)                          # scores[ids]
    total = tl.zeros([R], tl.float32)
    for i in tl.static_range(K):
        total += tl.sum(tl.where(j == i, w, 0.0), axis=1)                         # in pick order
    w = tl.div_rn(w, total[:, None] + 1e-20) * scale
    tl.store(w_ptr + t[:, None] * K + j, w, mask=jm)
    tl.store(ids_ptr + t[:, None] * K + j, ids.to(tl.int64), mask=jm)


@triton.jit
def _router_kernel(logits_ptr, sl, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale,
                   FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                   HASH: tl.constexpr, BIAS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) + tl.zeros([1], tl.int64)
    e = tl.arange(0, EP)
    x = tl.load(logits_ptr + t[:, None] * sl + e[None, :], mask=(e < E)[None, :], other=0.0).to(tl.float32)
    _route_rows(x, e, t, t >= 0, logits_ptr, sl, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale, FUNC, K,
                KP, EP, HASH, BIAS, 1)


@triton.jit(do_not_specialize=["T"])
def _gate_router_kernel(x_ptr, sx, g_ptr, part_ptr, logit_ptr, cnt_ptr, bias_ptr, table_ptr, tok_ptr, w_ptr,
                        ids_ptr, T, E, D, KCHUNK, scale,
                        FUNC: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                        HASH: tl.constexpr, BIAS: tl.constexpr, TP: tl.constexpr, BE: tl.constexpr,
                        BK: tl.constexpr, SP: tl.constexpr, PREC: tl.constexpr, RT: tl.constexpr):
    """The gate's projection split over (expert tiles, K splits), fp32 partials. The last split of
    an expert tile to arrive sums the tile's partials in split order into the logits; the last
    tile to finish routes every token at once (``_route_rows``). ``cnt_ptr[0]`` counts tiles,
    ``cnt_ptr[1 + tile]`` a tile's splits; each is re-armed by the program that completes it."""
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
    arrived = tl.atomic_add(cnt_ptr + 1 + pid_e, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        # (RT >= T rows from here on, not TP: the routing's [RT, EP] tiles set the registers and the time)
        r = tl.arange(0, RT)
        rm = r < T
        # the partials summed one split after another (an order no layout changes: any RT, the same bits)
        m2 = rm[:, None] & em[None, :]
        tile = tl.zeros([RT, BE], tl.float32)
        for sp in tl.static_range(SP):
            tile += tl.load(part_ptr + (sp * TP + r[:, None]) * EP + e[None, :],
                            mask=m2 & (sp < tl.num_programs(1)), other=0.0, cache_modifier=".cg")
        tl.store(logit_ptr + r[:, None] * EP + e[None, :], tile, mask=rm[:, None] & em[None, :])
        tl.atomic_xchg(cnt_ptr + 1 + pid_e, 0, sem="relaxed", scope="gpu")      # ready for the next call
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            ee = tl.arange(0, EP)
            x = tl.load(logit_ptr + r[:, None] * EP + ee[None, :], mask=rm[:, None] & (ee < E)[None, :], other=0.0,
                        cache_modifier=".cg")
            _route_rows(x, ee, r, rm, logit_ptr, EP, bias_ptr, table_ptr, tok_ptr, w_ptr, ids_ptr, E, scale, FUNC,
                        K, KP, EP, HASH, BIAS, RT)
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")


def _route_rows_block(T: int, func: str) -> int:
    """Rows the decode kernel routes at once for ``T`` tokens. A row's routing is the same
    arithmetic in any block (maxima, one-term sums, sums in a fixed order) except softmax's sum over
    the experts, a tree whose shape follows the layout: softmax routes every batch in one block
    size, so that a token's bits never depend on its batch (H100, Pro: 8 rows cost 22 us a call
    against 11 us for one)."""
    return pow2(GATE_MAX_TOKENS) if func == "softmax" else max(1, pow2(T))


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
            counters = runtime.counters(x.device, 1 + triton.cdiv(E, _GATE_BE), "router")
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
        # decode: the projection and the routing in one launch (a few tokens: the last program routes them
        # all). One row block (16) for the MMA whatever T: the same arithmetic for each token
        splits = max(1, min(_GATE_SPLITS, triton.cdiv(D, _GATE_BK)))
        kchunk = triton.cdiv(triton.cdiv(D, splits), _GATE_BK) * _GATE_BK
        splits = triton.cdiv(D, kchunk)
        tp = max(16, pow2(T))
        part = runtime.empty((splits, tp, pow2(E)), torch.float32, x.device)
        logits = runtime.empty((tp, pow2(E)), torch.float32, x.device)
        _gate_router_kernel[(triton.cdiv(E, _GATE_BE), splits)](
            x2, row_stride(x2), weight, part, logits, counters, *tables, w, ids, T, E, D, kchunk, float(scale),
            TP=tp, BE=_GATE_BE, BK=_GATE_BK, SP=pow2(splits), RT=_route_rows_block(T, func),
            PREC="ieee" if x.dtype == torch.float32 else None, num_warps=4, **route)
        return w, ids
    # prefill (or a packed gate): the projection by the linear op, then one program a token
    from .. import linear
    logits = linear(x2, weight, False, True, torch.float32)
    _router_kernel[(T,)](logits, logits.stride(0), *tables, w, ids, E, float(scale),
                         num_warps=4 if E > 512 else 2, **route)
    return w, ids


REGISTRATIONS = [("router", None, router_triton)]
