"""MoE prefill kernels (:mod:`dsv4.ops.triton.moe`): many (token, expert) pairs, sorted by expert.

Prefill: pairs are sorted by expert on the device (two kernels: counts per expert, then a stable
counting sort and tiles of ``BM`` rows per expert with a host-known upper bound on the tile count,
so still no host read);
``_w13_grouped_kernel`` / ``_w2_grouped_kernel`` run one ``(tile, N tile)`` per program with
``tl.dot``: FP8-block experts with ``act_quant`` on FP8 tensor cores (e4m3 x e4m3 per 128 block,
fp32 promotion with both scales, DeepSeek's W8A8); FP4 experts on BF16 tensor cores with exactly
dequantized operands (per-32 / per-16 weight scales would otherwise need a promotion per 32
values); then ``_combine_kernel``. MXFP4 experts with power-of-two act-quant scales run on the
dequantized operands, the gate/up GEMM from 24 pairs an expert on in ``_w13_wt_kernel``: the same
products transposed, the decoded weight rows on the MMA's M side (:func:`_gemm_wt`). (The down GEMM
stays untransposed: transposed, its decoded weights, the MMA's register operand, were overwritten by
the next K step while the MMA could still run, in every variant Triton 3.6 compiled
(``bench/wgmma_hazards.py``); with each K step retired it raced no more but was no faster, H200,
8192 tokens: 3.22 against 3.19 ms, results/2026-11-28g/call2_moe_8192.txt.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from . import runtime
from .moe_experts import _expert_ptrs, _gemm, _load_rows, _mx_bf16_tile, _swiglu, _w13_rows, _weight_tile, quantized

if TYPE_CHECKING:
    from .moe import Launch

#: columns of ``out`` per program of the combine
COMBINE_BN = 512


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, D: tl.constexpr, KTOP: tl.constexpr,
                    BN: tl.constexpr, XDT: tl.constexpr):
    """``out[t] = sum_j y[t*k + j]`` over the slots holding an expert, j in order; zeros else."""
    t = tl.program_id(0)
    n_offs = tl.program_id(1) * BN + tl.arange(0, BN)
    nmask = n_offs < D
    acc = tl.zeros((BN,), tl.float32)
    for j in tl.static_range(KTOP):
        p = t * KTOP + j
        ok = tl.load(ids_ptr + p) >= 0
        acc += tl.load(y_ptr + p.to(tl.int64) * D + n_offs, mask=nmask & ok, other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * D + n_offs, acc.to(XDT), mask=nmask)


@triton.jit
def _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM: tl.constexpr):
    """Expert and pair indices (``rows [BM]``, ``valid``) of this program's tile."""
    t = tl.program_id(0)
    e = tl.load(tile_e_ptr + t).to(tl.int32)
    r0 = tl.load(tile_r0_ptr + t).to(tl.int32)
    r1 = tl.load(tile_r1_ptr + t).to(tl.int32)
    r = r0 + tl.arange(0, BM)
    valid = r < r1
    rows = tl.load(order_ptr + r, mask=valid, other=0).to(tl.int32)
    return e, rows, valid


@triton.jit
def _w13_grouped_kernel(x_ptr, xq_ptr, xs_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                        rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, limit,
                        D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr,
                        QDOT: tl.constexpr, PIPE: tl.constexpr = 1, MXB: tl.constexpr = False):
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM)
    if e >= 0:
        _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
                  e, rows, valid, tl.program_id(1), limit, D, I, KTOP, FMT, BM, BN, BK, HAS_LIMIT, XDT, CDT, QDOT,
                  PIPE, MXB=MXB)


@triton.jit
def _w2_grouped_kernel(h_ptr, hq_ptr, hs_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                       y_ptr, w2_ptr, s2_ptr, g2_ptr,
                       D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr,
                       QDOT: tl.constexpr, PIPE: tl.constexpr = 1, MXB: tl.constexpr = False):
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM)
    if e >= 0:
        n_offs = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n_offs < D
        p2, q2 = _expert_ptrs(w2_ptr, s2_ptr, e, D, I, FMT)
        y, _unused = _gemm(h_ptr, hq_ptr, hs_ptr, rows, valid, p2, q2, p2, q2, n_offs, nmask, I, D,
                           FMT, BM, BN, BK, CDT, False, QDOT, PIPE, MXB=MXB)
        if FMT == 3:
            y = y * tl.load(g2_ptr + e)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * D + n_offs[None, :], y,
                 mask=valid[:, None] & nmask[None, :])


@triton.jit
def _mx_tile(w_ptr, s_ptr, n_offs, nmask, k0, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, CDT: tl.constexpr, MXB: tl.constexpr):
    """Rows ``n_offs`` x columns ``[k0, k0 + BK)`` of an MXFP4 expert, ``e2m1 * 2^(s-127)`` as
    ``CDT`` ``[BN, BK]`` (exact in bf16 / fp32: two significant bits, an 8-bit exponent)."""
    if MXB:
        return _mx_bf16_tile(w_ptr, s_ptr, n_offs, nmask, k0, K, N, BN, BK)
    w, s = _weight_tile(w_ptr, s_ptr, n_offs, nmask, k0, K, N, 2, BN, BK, False)
    return tl.reshape(w * s[:, :, None], (BN, BK)).to(CDT)


@triton.jit
def _dot_t(w, a, acc, CDT: tl.constexpr):
    """``acc += w @ a^T``: ``[BN, BK] x [BT, BK] -> [BN, BT]``, weight rows on the MMA's M side."""
    if CDT == tl.float32:
        return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(a.to(CDT)), acc)


@triton.jit
def _retired(acc, unit, ASM: tl.constexpr):
    """``acc`` once the MMA that produced it has finished: any use of an MMA's result outside
    another MMA makes Triton wait for it. ``ASM``: the use is an empty register move per value,
    which ptxas folds away (no instruction); else (Triton's interpreter, which runs no PTX) ``acc *
    unit`` with ``unit`` 1.0 at run time, one multiply per value.

    The move instead of the multiply: the 256-pair gate/up kernel's K step 443 -> 315 instructions
    (``bench/ptxas_regs.py --prefill --sass``), no race (``bench/wgmma_hazards.py``); H200, Flash
    layer, 8192 tokens 5.62 -> 5.46 ms, 4096 tokens (128-pair tiles) 3.73 -> 3.59 ms
    (``results/2026-11-28h/call3_moe_*.txt``)."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return acc * unit


@triton.jit
def _gemm_wt(a_ptr, a_rows, a_valid, wa_ptr, sa_ptr, wb_ptr, sb_ptr, n0, unit,
             K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
             CDT: tl.constexpr, PIPE: tl.constexpr, MXB: tl.constexpr, ASM: tl.constexpr = False):
    """``[Wa[n]; Wb[n]] @ A[a_rows]^T`` over all of ``K``, fp32 ``[2 BN, BT]``: two MXFP4 experts'
    rows ``n = n0 .. n0 + BN - 1`` (gate ``Wa``, then up ``Wb``) times a tile's dequantized inputs
    ``x̂`` (exact in bf16 / fp32 like the weights ``e2m1 * 2^(s-127)``: one dot per K tile).

    The transpose of :func:`.moe_experts._gemm`'s product: the decoded weight tile is the MMA's
    left operand, which Hopper's wgmma takes from registers (only the right one must sit in shared
    memory), and the tile's pairs are its N side. Faster for 128-pair tiles (bench/moe_prefill_tune.py,
    H100, Flash layer, 4096 tokens: 8.74 -> 6.11 ms for both GEMMs; see ``moe.CONFIGS``).

    Gate and up rows are stacked into one ``[2 BN, BK]`` left operand, one MMA a K step. (As two
    products of ``BN`` rows, with 8 warps each warpgroup took half the pairs and so decoded and held
    both tiles whole: 255 registers and spills, ncu at 8192 tokens, results/2026-11-28f.)

    Each K step's product is retired (:func:`_retired`) before the next step decodes its tile. Left
    in flight, Triton 3.6's pipelined MMA had its register operand overwritten by the next tile
    (bench/wgmma_hazards.py)."""
    r = tl.arange(0, 2 * BN)
    up = r >= BN
    rows = n0 + r % BN
    rmask = rows < N
    wp = tl.where(up, wb_ptr, wa_ptr)
    sp = tl.where(up, sb_ptr, sa_ptr)
    acc = tl.zeros((2 * BN, BT), tl.float32)
    for k0 in tl.range(0, K, BK, num_stages=PIPE):
        a = _load_rows(a_ptr, a_rows, a_valid, k0, K, BK, K % BK == 0)
        acc = _retired(_dot_t(_mx_tile(wp[:, None, None], sp[:, None], rows, rmask, k0, K, N, 2 * BN, BK, CDT, MXB),
                              a, acc, CDT), unit, ASM)
    return acc


@triton.jit
def _w13_wt_kernel(x_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, rw_ptr, h_ptr,
                   w1_ptr, s1_ptr, w3_ptr, s3_ptr, limit, unit,
                   D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, BT: tl.constexpr,
                   BN: tl.constexpr, BK: tl.constexpr, HAS_LIMIT: tl.constexpr, XDT: tl.constexpr,
                   CDT: tl.constexpr, PIPE: tl.constexpr, MXB: tl.constexpr = False, ASM: tl.constexpr = False):
    """MXFP4 gate/up of one tile (``BT`` pairs of one expert) x ``BN`` columns of ``h``, on the
    dequantized operands (:func:`_gemm_wt`): the clamped SwiGLU times the routing weight, like
    :func:`.moe_experts._w13_rows`."""
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BT)
    if e >= 0:
        n_offs = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n_offs < I
        p1, q1 = _expert_ptrs(w1_ptr, s1_ptr, e, I, D, 2)
        p3, q3 = _expert_ptrs(w3_ptr, s3_ptr, e, I, D, 2)
        acc = _gemm_wt(x_ptr, rows // KTOP, valid, p1, q1, p3, q3, tl.program_id(1) * BN, unit, D, I, BN, BT, BK,
                       CDT, PIPE, MXB, ASM)
        g, u = tl.split(tl.reshape(acc, (2, BN, BT)).permute(1, 2, 0))
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
        h = _swiglu(g, u, limit, HAS_LIMIT) * rw[None, :]
        tl.store(h_ptr + rows[None, :].to(tl.int64) * I + n_offs[:, None], h.to(XDT),
                 mask=valid[None, :] & nmask[:, None])


# ----------------------------------------------------------------------------- host side
def run(L: Launch) -> None:
    """Sort the pairs by expert, the two grouped GEMMs (the gate/up one transposed or not, ``L.wt``),
    then the combine into ``L.out``."""
    (bn1, bk1, nw1, ns1, pp1), (bn2, bk2, nw2, ns2, pp2) = L.w13, L.w2
    nt1, nt2 = triton.cdiv(L.I, bn1), triton.cdiv(L.D, bn2)
    common = dict(FMT=L.fmt, BM=L.BM, XDT=L.xdt, CDT=L.xdt, QDOT=L.qdot, MXB=L.mx_bf16)
    xh, xq, xs = L.xin
    (d1, s1, g1), (d3, s3, g3), (d2, s2, g2) = L.weights
    order, tile_e, tile_r0, tile_r1 = _expert_tiles(L.ids.view(-1), L.E, L.BM)
    if L.wt:
        _w13_wt_kernel[(tile_e.numel(), nt1)](
            xh, order, tile_e, tile_r0, tile_r1, L.rw, L.h, d1, s1, d3, s3, L.limit, 1.0, D=L.D, I=L.I,
            KTOP=L.k, BT=L.BM, BN=bn1, BK=bk1, HAS_LIMIT=L.limit > 0, XDT=L.xdt, CDT=L.xdt, PIPE=pp1, MXB=L.mx_bf16,
            ASM=not runtime.interpreting(), num_warps=nw1, num_stages=ns1)
    else:
        _w13_grouped_kernel[(tile_e.numel(), nt1)](
            xh, xq, xs, order, tile_e, tile_r0, tile_r1, L.rw, L.h, d1, s1, g1, d3, s3, g3,
            L.limit, D=L.D, I=L.I, KTOP=L.k, BN=bn1, BK=bk1, HAS_LIMIT=L.limit > 0, PIPE=pp1, num_warps=nw1,
            num_stages=ns1, **common)
    hh, hq, hs = quantized(L.h, L.act_quant, L.pow2, L.qdot, L.q_dtype, L.ids)
    _w2_grouped_kernel[(tile_e.numel(), nt2)](
        hh, hq, hs, order, tile_e, tile_r0, tile_r1, L.y, d2, s2, g2, D=L.D, I=L.I, BN=bn2, BK=bk2,
        PIPE=pp2, num_warps=nw2, num_stages=ns2, **common)
    _combine_kernel[(L.T, triton.cdiv(L.D, COMBINE_BN))](
        L.y, L.ids, L.out, D=L.D, KTOP=L.k, BN=COMBINE_BN, XDT=L.xdt, num_warps=4)


#: pairs a program of the two sorting kernels reads at a time
SORT_BLOCK = 1024


# P and NT follow the pair count, whose integer class (1, multiple of 16, other) is not the token
# count's that the warm-up covers: not specialized on, so no prompt length compiles a new variant
@triton.jit(do_not_specialize=["P"])
def _expert_count_kernel(ids_ptr, counts_ptr, P, BLOCK: tl.constexpr):
    """``counts[b]`` = pairs with ``ids == b - 1`` (bin 0: the ``-1`` ids); one program a bin,
    each reading every id (no atomics: the same counts every run)."""
    b = tl.program_id(0)
    n = tl.zeros((BLOCK,), tl.int32)
    lo = 0
    while lo < P:                   # (while, not range: Triton's interpreter takes no int argument as a range bound)
        offs = lo + tl.arange(0, BLOCK)
        v = tl.load(ids_ptr + offs, mask=offs < P, other=-2).to(tl.int32)
        n += (v == b - 1).to(tl.int32)
        lo += BLOCK
    tl.store(counts_ptr + b, tl.sum(n, 0))


@triton.jit(do_not_specialize=["P", "NT"])
def _expert_order_kernel(ids_ptr, counts_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, P, NT,
                         E: tl.constexpr, EP: tl.constexpr, BM: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``b`` (bin ``b``: expert ``b - 1``, bin 0 the ``-1`` ids) writes its pairs' indices
    into ``order`` in pair order from the bin's first position (a stable sort by expert), and an
    expert's program its tiles of ``BM`` pairs (``tile_e``, first and end position); bin 0's the
    unused tail (expert ``-1``)."""
    b = tl.program_id(0)
    bins = tl.arange(0, EP)
    counts = tl.load(counts_ptr + bins, mask=bins <= E, other=0)
    start = tl.sum(tl.where(bins < b, counts, 0), 0)                  # first position of the bin
    mine = tl.sum(tl.where(bins == b, counts, 0), 0)
    tiles = tl.where((bins >= 1) & (bins <= E), (counts + BM - 1) // BM, 0)
    t0 = tl.sum(tl.where(bins < b, tiles, 0), 0)                      # the bin's first tile
    base = start
    lo = 0
    while lo < P:
        offs = lo + tl.arange(0, BLOCK)
        hit = tl.load(ids_ptr + offs, mask=offs < P, other=-2).to(tl.int32) == b - 1
        at = base + tl.cumsum(hit.to(tl.int32), 0) - 1
        tl.store(order_ptr + at, offs, mask=hit)
        base += tl.sum(hit.to(tl.int32), 0)
        lo += BLOCK
    if b >= 1:
        r0 = start
        while r0 < start + mine:
            tl.store(tile_e_ptr + t0, b - 1)
            tl.store(tile_r0_ptr + t0, r0)
            tl.store(tile_r1_ptr + t0, tl.minimum(r0 + BM, start + mine))
            r0 += BM
            t0 += 1
    else:
        used = tl.sum(tiles, 0)
        lo = 0
        while lo < NT:
            t = lo + tl.arange(0, BLOCK)
            tail = (t >= used) & (t < NT)
            tl.store(tile_e_ptr + t, tl.full((BLOCK,), -1, tl.int32), mask=tail)
            tl.store(tile_r0_ptr + t, tl.zeros((BLOCK,), tl.int32), mask=tail)
            tl.store(tile_r1_ptr + t, tl.zeros((BLOCK,), tl.int32), mask=tail)
            lo += BLOCK


def _expert_tiles(ids: torch.Tensor, E: int, BM: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert and tiles of at most ``BM`` of them, all on the device, in two
    launches (:func:`_expert_count_kernel`, :func:`_expert_order_kernel`; the torch composition
    :func:`expert_tiles_reference` took ~20).

    Returns ``order [P]`` (pair indices: ``-1`` ids first, then expert 0, 1, ...) and per tile its
    expert (``-1`` for the unused tail) and first / end position in ``order``, int32. The tile count
    is the host-known bound ``ceil(P / BM) + min(E, P)``, so nothing is read back.
    """
    P, dev = ids.numel(), ids.device
    NT = triton.cdiv(P, BM) + min(E, P)
    counts = runtime.empty((E + 1,), torch.int32, dev)
    order = runtime.empty((P,), torch.int32, dev)
    tile_e, tile_r0, tile_r1 = (runtime.empty((NT,), torch.int32, dev) for _ in range(3))
    _expert_count_kernel[(E + 1,)](ids, counts, P, BLOCK=SORT_BLOCK, num_warps=4)
    _expert_order_kernel[(E + 1,)](ids, counts, order, tile_e, tile_r0, tile_r1, P, NT, E=E,
                                   EP=triton.next_power_of_2(E + 1), BM=BM, BLOCK=SORT_BLOCK, num_warps=4)
    return order, tile_e, tile_r0, tile_r1


def expert_tiles_reference(ids: torch.Tensor, E: int, BM: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_expert_tiles` as torch ops (the oracle of its kernels; unused tiles' rows are 0)."""
    P = ids.numel()
    dev = ids.device
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev)
    counts.index_add_(0, ids.long() + 1, torch.ones(P, dtype=torch.int64, device=dev))
    start = torch.cumsum(counts, 0)[:E]                 # first position of expert e in `order`
    ecount = counts[1:]
    tiles = (ecount + BM - 1) // BM
    tile_end = torch.cumsum(tiles, 0)
    t = torch.arange(triton.cdiv(P, BM) + min(E, P), device=dev)
    te = torch.searchsorted(tile_end, t, right=True)
    tc = te.clamp(max=E - 1)
    r0 = start[tc] + (t - (tile_end[tc] - tiles[tc])) * BM
    r1 = torch.minimum(r0 + BM, start[tc] + ecount[tc])
    used = te < E
    return order, torch.where(used, tc, -1), torch.where(used, r0, 0), torch.where(used, r1, 0)

