"""MoE decode kernels (:mod:`dsv4.ops.triton.moe`): few (token, expert) pairs, no sort.

Decode (``T * k <= DECODE_MAX_PAIRS``), three launches at most, no host read, fixed shapes
(CUDA-graph capturable):

1. ``_w13_decode_kernel``, grid ``(T*k slots, I / BN)``. Each slot ``j`` owns a *chunk*: when pair
   ``j`` is the first of its expert, or the ``BM``-th, ``2BM``-th ... pair of that expert (pairs
   in index order), the program takes the next ``BM`` pairs of that expert; otherwise it exits.
   The chunk is found in registers from the ``T*k`` ids (compare, cumsum), so each expert's
   bytes are read once for up to ``BM`` tokens without any sort or extra launch. The program
   streams ``BN`` rows of W1 and W3 over all of ``D`` and writes ``h`` (SwiGLU + clamp + routing
   weight epilogue) for its pairs. The engine runs ``BM = 1`` (``moe.CONFIGS["gemv"]`` says why): a
   CUDA-core GEMV whose group scales multiply per-group partial sums.
   It also zeroes the combine counters of step 2 (saves a memset launch).
2. ``_w2_decode_kernel``, grid ``(T*k slots, D / BN)``: the same chunks over W2 with ``ĥ`` as
   input (quantized per 128 in the prologue of each K block), fp32 rows per pair; then the
   combine: each program bumps a per-(token, N tile) counter (``atomic_add``, acq_rel) and the
   program that completes a token sums that token's ``k`` rows in slot order and writes the
   output. The sum order is fixed, so results are deterministic whatever the scheduling.

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
    pair indices, valid [BM], active)``. All from the ``P`` ids in registers (``PP >= P``)."""
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


@triton.jit(do_not_specialize=["ncnt", "P"])
def _w13_decode_kernel(x_ptr, xq_ptr, xs_ptr, ids_ptr, rw_ptr, h_ptr, cnt_ptr, ncnt,
                       w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, P, E, limit,
                       D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                       ZB: tl.constexpr, HAS_LIMIT: tl.constexpr, XDT: tl.constexpr,
                       CDT: tl.constexpr, QDOT: tl.constexpr, PIPE: tl.constexpr = 1):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    # zero the w2 kernel's combine counters (ZB per program)
    z = (slot * tl.num_programs(1) + pid_n) * ZB + tl.arange(0, ZB)
    tl.store(cnt_ptr + z, tl.zeros((ZB,), tl.int32), mask=z < ncnt)
    e = tl.load(ids_ptr + slot).to(tl.int32)
    rows, valid, active = _chunk(ids_ptr, slot, e, P, BM, PP)
    if active & (e < E):
        _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
                  e, rows, valid, pid_n, limit, D, I, KTOP, FMT, BM, BN, BK, HAS_LIMIT, XDT, CDT, QDOT,
                  PIPE)


@triton.jit(do_not_specialize=["P"])
def _w2_decode_kernel(h_ptr, hq_ptr, hs_ptr, ids_ptr, y_ptr, out_ptr, cnt_ptr,
                      w2_ptr, s2_ptr, g2_ptr, P, E,
                      D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                      KP2: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr, QDOT: tl.constexpr,
                      PIPE: tl.constexpr = 1):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_offs = pid_n * BN + tl.arange(0, BN)
    nmask = n_offs < D
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
        # the last program to finish a token's rows (for this N tile) sums them in slot order
        tok = rows // KTOP
        tl.debug_barrier()
        old = tl.atomic_add(cnt_ptr + tok * tl.num_programs(1) + pid_n,
                            tl.full((BM,), 1, tl.int32), mask=valid, sem="acq_rel", scope="gpu")
        tl.debug_barrier()
        need = tl.zeros((BM,), tl.int32)
        for j in tl.static_range(KTOP):
            need += (tl.load(ids_ptr + tok * KTOP + j, mask=valid, other=-1) >= 0).to(tl.int32)
        last = valid & (old == need - 1)
        acc = tl.zeros((BM, BN), tl.float32)
        for j in tl.static_range(KTOP):
            p = tok * KTOP + j
            ok = last & (tl.load(ids_ptr + p, mask=last, other=-1) >= 0)
            acc += tl.load(y_ptr + p[:, None] * D + n_offs[None, :],
                           mask=ok[:, None] & nmask[None, :], other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + tok[:, None] * D + n_offs[None, :], acc.to(XDT),
                 mask=last[:, None] & nmask[None, :])
    # a token none of whose slots holds an expert still gets its zero row (by its slot 0)
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
    common = dict(FMT=L.fmt, BM=L.BM, XDT=L.xdt, CDT=L.xdt, QDOT=L.qdot)
    ncnt = L.T * nt2
    cnt = runtime.empty((ncnt,), torch.int32, L.x.device)       # zeroed by the first kernel
    zb = triton.next_power_of_2(triton.cdiv(ncnt, L.P * nt1))
    pp = max(triton.next_power_of_2(L.P), 2)
    xh, xq, xs = L.xin
    (d1, s1, g1), (d3, s3, g3), (d2, s2, g2) = L.weights
    _w13_decode_kernel[(L.P, nt1)](
        xh, xq, xs, L.ids, L.rw, L.h, cnt, ncnt, d1, s1, g1, d3, s3, g3, L.P, L.E, L.limit,
        D=L.D, I=L.I, KTOP=L.k, BN=bn1, BK=bk1, PP=pp, ZB=zb, HAS_LIMIT=L.limit > 0,
        PIPE=pp1, num_warps=nw1, num_stages=ns1, **common)
    hh, hq, hs = quantized(L.h, L.act_quant, L.pow2, L.qdot, L.q_dtype, L.ids)
    _w2_decode_kernel[(L.P, nt2)](
        hh, hq, hs, L.ids, L.y, L.out, cnt, d2, s2, g2, L.P, L.E,
        D=L.D, I=L.I, KTOP=L.k, BN=bn2, BK=bk2, PP=pp, KP2=max(triton.next_power_of_2(L.k), 2),
        PIPE=pp2, num_warps=nw2, num_stages=ns2, **common)
