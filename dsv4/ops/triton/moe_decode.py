"""MoE decode kernels (:mod:`dsv4.ops.triton.moe`): few (token, expert) pairs, no sort.

Decode (``T * k <= DECODE_MAX_PAIRS``), two launches for the routed experts and the shared one,
no host read, fixed shapes (CUDA-graph capturable). The shared expert is one more "expert" of
weight 1: ``T`` more slots of each grid (one token each), with its own format and width (``I / N``
under expert parallel). With act-quant, ``x`` and then ``h`` (the routed and shared experts' rows
together) are rounded per 128 block by one small launch each before the GEMV that reads them
(``moe_experts.quantized``): rounding them inside the GEMVs' K loops, as every program streams the
whole row, cost the Flash layer 72.5 -> 59.4 us at one token and 350.7 -> 316.4 us at eight, H200
(``bench/results/2026-11-29b/call1_tune.txt``):

1. ``_w13_decode_kernel``, grid ``(T*k (+ T shared) slots, I / BN)``. Each slot ``j`` owns a *chunk*: when pair
   ``j`` is the first of its expert, or the ``BM``-th, ``2BM``-th ... pair of that expert (pairs
   in index order), the program takes the next ``BM`` pairs of that expert; otherwise it exits.
   The chunk is found in registers from the ``T*k`` ids (compare, cumsum), so each expert's
   bytes are read once for up to ``BM`` tokens without any sort or extra launch. The program
   streams ``BN`` rows of W1 and W3 over all of ``D`` and writes ``h`` (SwiGLU + clamp + routing
   weight epilogue) for its pairs. The engine runs ``BM = 1`` (``moe.CONFIGS["gemv"]`` says why):
   a CUDA-core GEMV whose group scales multiply per-group partial sums, its K step's loads ordered
   by hand (``moe_experts._gemm``).
   It also zeroes the combine counters of step 2 (saves a memset launch).
2. ``_w2_decode_kernel``, grid ``(T*k (+ T shared) slots, D / BN)``: the same chunks over W2 with
   ``ĥ`` as input, fp32 rows per pair; then the combine: each program bumps a per-(token, N tile)
   counter (``atomic_add``, acq_rel) and the program that completes a token sums that token's ``k`` rows in slot order, adds the shared
   expert's row (each cast to the activation dtype first, as the reference adds the two outputs)
   and writes the output. The sum order is fixed, so results are deterministic whatever the scheduling.

No split-K: at batch 1, ``BN`` = 16 / 32 rows already gives 6 x (I/16) and 6 x (D/32) programs
(768-1344 for Flash/Pro), several per SM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import runtime
from .moe_experts import _expert_ptrs, _gemm, _w13_rows, quantized

if TYPE_CHECKING:
    from .moe import Launch


@triton.jit
def _chunk(ids_ptr, slot, e, P, BM: tl.constexpr, PP: tl.constexpr):
    """The pairs program ``slot`` handles: if ``slot`` is the 0th, BM-th, 2BM-th ... pair (in index
    order) of expert ``e``, the next ``BM`` pairs of ``e`` from ``slot`` on. Returns ``(rows [BM]
    pair indices, valid [BM], active)``. All from the ``P`` ids in registers (``PP >= P``).

    ``BM == 1`` (what the engine runs): every pair is its own chunk, nothing to rank. (Ranking
    anyway cost more than its instructions: with ``PP = 64`` (6-10 tokens of top-6) ptxas gave the
    gate/up kernel 168 registers instead of 80, and those batches ran their experts ~45% slower,
    ``results/2026-11-25c/moe_decode_tune.txt``.)"""
    if BM == 1:
        rows = tl.full((1,), 0, tl.int32) + slot
        return rows, rows >= 0, e >= 0
    idx = tl.arange(0, PP)
    ids = tl.load(ids_ptr + idx, mask=idx < P, other=-1).to(tl.int32)
    same = ids == e
    before = tl.sum((same & (idx < slot)).to(tl.int32), axis=0)
    active = (e >= 0) & (before % BM == 0)
    match = same & (idx >= slot)
    pos = tl.cumsum(match.to(tl.int32), axis=0) - 1
    sel = match[None, :] & (pos[None, :] == tl.arange(0, BM)[:, None])
    rows = tl.sum(tl.where(sel, idx[None, :], 0), axis=1)
    valid = tl.sum(sel.to(tl.int32), axis=1) > 0
    return rows, valid, active


@triton.jit(do_not_specialize=["ncnt", "P", "T"])
def _w13_decode_kernel(x_ptr, xq_ptr, xs_ptr, ids_ptr, rw_ptr, h_ptr, cnt_ptr, ncnt,
                       w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, P, E, limit,
                       sh_ptr, v1_ptr, t1_ptr, f1_ptr, v3_ptr, t3_ptr, f3_ptr, T,
                       D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                       ZB: tl.constexpr, HAS_LIMIT: tl.constexpr, XDT: tl.constexpr,
                       CDT: tl.constexpr, QDOT: tl.constexpr, SHARED: tl.constexpr = False,
                       FMT_S: tl.constexpr = 0, I_S: tl.constexpr = 1, BK_S: tl.constexpr = 128,
                       PIPE: tl.constexpr = 1):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    # zero the w2 kernel's combine counters (ZB per program)
    z = (slot * tl.num_programs(1) + pid_n) * ZB + tl.arange(0, ZB)
    tl.store(cnt_ptr + z, tl.zeros((ZB,), tl.int32), mask=z < ncnt)
    if slot < P:
        e = tl.load(ids_ptr + slot).to(tl.int32)
        rows, valid, active = _chunk(ids_ptr, slot, e, P, BM, PP)
        if active & (e < E):
            _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
                      e, rows, valid, pid_n, limit, D, I, KTOP, FMT, BM, BN, BK, HAS_LIMIT, XDT, CDT, QDOT,
                      PIPE, True)
    elif SHARED:
        # the shared expert: the slots past the pairs, BM tokens each, weight 1, its own format
        tok = (slot - P) * BM + tl.arange(0, BM)
        if pid_n * BN < I_S:
            _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, sh_ptr, v1_ptr, t1_ptr, f1_ptr, v3_ptr, t3_ptr, f3_ptr,
                      tl.full((), 0, tl.int32), tok, tok < T, pid_n, limit, D, I_S, 1, FMT_S, BM, BN, BK_S,
                      HAS_LIMIT, XDT, CDT, QDOT, PIPE, False)


@triton.jit
def _arrive_and_sum(ids_ptr, y_ptr, ys_ptr, out_ptr, cnt_ptr, tok, valid, pid_n, n_offs, nmask,
                    D: tl.constexpr, KTOP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    XDT: tl.constexpr, SHARED: tl.constexpr):
    """After a program stored its rows (of tokens ``tok``, ``valid``) for this N tile: the last
    program to finish a token's rows sums them in slot order (cast to ``XDT``), adds the shared
    expert's row (cast to ``XDT``) like the reference adds the two outputs, and writes ``out``."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr + tok * tl.num_programs(1) + pid_n,
                        tl.full((BM,), 1, tl.int32), mask=valid, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    need = tl.full((BM,), 1 if SHARED else 0, tl.int32)
    for j in tl.static_range(KTOP):
        need += (tl.load(ids_ptr + tok * KTOP + j, mask=valid, other=-1) >= 0).to(tl.int32)
    last = valid & (old == need - 1)
    acc = tl.zeros((BM, BN), tl.float32)
    for j in tl.static_range(KTOP):
        p = tok * KTOP + j
        ok = last & (tl.load(ids_ptr + p, mask=last, other=-1) >= 0)
        acc += tl.load(y_ptr + p[:, None] * D + n_offs[None, :],
                       mask=ok[:, None] & nmask[None, :], other=0.0, cache_modifier=".cg")
    res = acc.to(XDT)
    if SHARED:
        ys = tl.load(ys_ptr + tok[:, None] * D + n_offs[None, :], mask=last[:, None] & nmask[None, :],
                     other=0.0, cache_modifier=".cg")
        res = (res.to(tl.float32) + ys.to(XDT).to(tl.float32)).to(XDT)
    tl.store(out_ptr + tok[:, None] * D + n_offs[None, :], res, mask=last[:, None] & nmask[None, :])


@triton.jit(do_not_specialize=["P", "T"])
def _w2_decode_kernel(h_ptr, hq_ptr, hs_ptr, ids_ptr, y_ptr, out_ptr, cnt_ptr,
                      w2_ptr, s2_ptr, g2_ptr, P, E,
                      sh_ptr, shq_ptr, shs_ptr, ys_ptr, v2_ptr, t2_ptr, f2_ptr, T,
                      D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                      KP2: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr, QDOT: tl.constexpr,
                      SHARED: tl.constexpr = False, FMT_S: tl.constexpr = 0, I_S: tl.constexpr = 1,
                      BK_S: tl.constexpr = 128, PIPE: tl.constexpr = 1):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_offs = pid_n * BN + tl.arange(0, BN)
    nmask = n_offs < D
    if slot < P:
        e = tl.load(ids_ptr + slot).to(tl.int32)
        rows, valid, active = _chunk(ids_ptr, slot, e, P, BM, PP)
        if active & (e < E):
            p2, q2 = _expert_ptrs(w2_ptr, s2_ptr, e, D, I, FMT)
            y, _unused = _gemm(h_ptr, hq_ptr, hs_ptr, rows, valid, p2, q2, p2, q2, n_offs, nmask, I, D,
                               FMT, BM, BN, BK, CDT, False, QDOT, PIPE)
            if FMT == 3:
                y = y * tl.load(g2_ptr + e)
            tl.store(y_ptr + rows[:, None] * D + n_offs[None, :], y,
                     mask=valid[:, None] & nmask[None, :])
            _arrive_and_sum(ids_ptr, y_ptr, ys_ptr, out_ptr, cnt_ptr, rows // KTOP, valid, pid_n, n_offs, nmask,
                            D, KTOP, BM, BN, XDT, SHARED)
    elif SHARED:
        tok = (slot - P) * BM + tl.arange(0, BM)
        valid = tok < T
        y, _unused = _gemm(sh_ptr, shq_ptr, shs_ptr, tok, valid, v2_ptr, t2_ptr, v2_ptr, t2_ptr, n_offs, nmask,
                           I_S, D, FMT_S, BM, BN, BK_S, CDT, False, QDOT, PIPE)
        if FMT_S == 3:
            y = y * tl.load(f2_ptr)
        tl.store(ys_ptr + tok[:, None] * D + n_offs[None, :], y, mask=valid[:, None] & nmask[None, :])
        _arrive_and_sum(ids_ptr, y_ptr, ys_ptr, out_ptr, cnt_ptr, tok, valid, pid_n, n_offs, nmask,
                        D, KTOP, BM, BN, XDT, SHARED)
    # a token none of whose slots holds an expert still gets its zero row (by its slot 0); with the
    # shared expert every token's row is written by its last arrival
    if not SHARED:
        if (slot % KTOP) == 0:
            t = slot // KTOP
            jj = tl.arange(0, KP2)
            tid = tl.load(ids_ptr + t * KTOP + jj, mask=jj < KTOP, other=-1)
            if tl.max(tid, axis=0) < 0:
                tl.store(out_ptr + t * D + n_offs, tl.zeros((BN,), XDT), mask=nmask)


def run(L: Launch) -> None:
    """The two decode launches of one MoE call (the second also sums each token's rows into ``L.out``)."""
    (bn1, bk1, nw1, ns1, pp1), (bn2, bk2, nw2, ns2, pp2) = L.w13, L.w2
    nt1, nt2 = triton.cdiv(L.I, bn1), triton.cdiv(L.D, bn2)
    assert L.BM == 1 and not L.qdot, "the decode kernels run one pair a program"
    common = dict(FMT=L.fmt, BM=1, XDT=L.xdt, CDT=L.xdt, QDOT=False)
    ncnt = L.T * nt2
    cnt = runtime.empty((ncnt,), torch.int32, L.x.device)       # zeroed by the first kernel
    zb = triton.next_power_of_2(triton.cdiv(ncnt, L.P * nt1))
    pp = max(triton.next_power_of_2(L.P), 2)
    x = L.xin[0]
    (d1, s1, g1), (d3, s3, g3), (d2, s2, g2) = L.weights
    S = L.shared
    if S is not None:
        # the shared expert: T more slots of both grids (one token each), its own format and width
        (v1, t1, f1), (v3, t3, f3), (v2, t2, f2) = S.weights
        slots = L.P + L.T
        sh1 = dict(SHARED=True, FMT_S=S.fmt, I_S=S.I, BK_S=128 if S.fmt < 2 else bk1)
        sh2 = dict(sh1, BK_S=128 if S.fmt < 2 else bk2)
        sh_in, sh_out = S.h, S.y
    else:
        v1 = t1 = f1 = v3 = t3 = f3 = v2 = t2 = f2 = d1              # never read
        slots, sh1, sh2, sh_in, sh_out = L.P, {}, {}, L.h, L.y
    _w13_decode_kernel[(slots, nt1)](
        x, x, x, L.ids, L.rw, L.h, cnt, ncnt, d1, s1, g1, d3, s3, g3, L.P, L.E, L.limit,
        sh_in, v1, t1, f1, v3, t3, f3, L.T,
        D=L.D, I=L.I, KTOP=L.k, BN=bn1, BK=bk1, PP=pp, ZB=zb, HAS_LIMIT=L.limit > 0,
        PIPE=pp1, num_warps=nw1, num_stages=ns1, **common, **sh1)
    h, sh_h = _rounded_h(L)
    _w2_decode_kernel[(slots, nt2)](
        h, h, h, L.ids, L.y, L.out, cnt, d2, s2, g2, L.P, L.E,
        sh_h, sh_h, sh_h, sh_out, v2, t2, f2, L.T,
        D=L.D, I=L.I, KTOP=L.k, BN=bn2, BK=bk2, PP=pp, KP2=max(triton.next_power_of_2(L.k), 2),
        PIPE=pp2, num_warps=nw2, num_stages=ns2, **common, **sh2)


def _rounded_h(L: Launch) -> tuple[torch.Tensor, torch.Tensor]:
    """The down GEMV's inputs ``(ĥ of the pairs, ĥ of the shared expert's rows)`` (without a shared
    expert the second is a placeholder): with act-quant rounded per 128 block, in one launch when
    the shared rows follow the pairs' in one buffer (``SharedLaunch.h_all``, same width); rows of
    empty pairs are skipped."""
    S = L.shared
    if not L.act_quant:
        return L.h, L.h if S is None else S.h
    if S is None:
        h = quantized(L.h, True, L.pow2, False, L.q_dtype, ids=L.ids)[0]
        return h, h
    if S.h_all is not None:
        both = quantized(S.h_all, True, L.pow2, False, L.q_dtype, ids=L.ids)[0]
        return both[:L.P], both[L.P:]
    return (quantized(L.h, True, L.pow2, False, L.q_dtype, ids=L.ids)[0],
            quantized(S.h, True, L.pow2, False, L.q_dtype)[0])
