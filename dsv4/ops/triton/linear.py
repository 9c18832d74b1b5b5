"""Quantized ``linear`` and ``grouped_linear`` for FP8-block, MXFP4 and NVFP4 weights (Triton).

Numerics (DSV4_FACTS 2b, the twins are :func:`dsv4.ops.reference.linear` / ``grouped_linear``):

- ``act_quant=True`` (the QAT simulation): the input is quantized to e4m3 per 1x128 block exactly as
  :func:`dsv4.ops.numerics.fp8_quantize` (``amax`` floored at 1e-4, scale ``amax/448`` rounded up
  to a power of two from the float's bits when ``pow2``; division and rounding IEEE, so ``q`` and
  the scales are bit-identical), and the product runs on the FP8 grid: W8A8 for FP8-block weights
  ``y = sum_kb (q . w)_kb * s_x[kb] * s_w[n//128, kb]`` (fp32 partial per 128 block, then scaled);
  W4A8 for FP4 weights. e2m1 times its per-32 power of two (MXFP4) or per-16 e4m3 scale (NVFP4)
  is exact in bf16, and so is an e4m3 ``q``, so the FP4 products are exact on a bf16 tensor core:
  ``y = sum_kb (q . w*s_w)_kb * s_x[kb]`` (NVFP4: times the global scale at the end), the same sum
  of exact products in fp32 as the per-32/per-16 formula.
- ``act_quant=False``: weight-only. The weight is dequantized in fp32 in registers and rounded to
  the activation dtype (what the reference's ``dequantize(x.dtype)`` does), multiplied with fp32
  accumulation (fp32 activations: IEEE fp32 products, no tf32).

Two kernels, chosen by the number of rows ``M`` (``SKINNY_MAX_M``):

- decode (``M <= 32``): :func:`_skinny_kernel`, a split-K GEMV on the tensor cores with the roles
  swapped (weight tile ``[BN, 128]`` is the MMA's M side, the ``M`` activation rows padded to 16/32
  its N side), the activation quantized in the prologue of every K step, the weight dequantized in
  registers. Grid ``(row tiles, K splits)``. Splits write fp32 partials to a workspace; the last
  split of a row tile to finish (a per-tile arrival counter) sums them in split order 0..S-1 and
  writes the output, so the result never depends on the order the programs ran in.
- prefill (``M > 32``): :func:`_gemm_kernel`, a tiled GEMM (K steps of 128, grouped tile order;
  tiles ``64 x 128`` for FP8 weights, ``128 x 128`` for FP4: :func:`_gemm_defaults`). FP8
  weights with act-quant (:func:`_gemm_w8a8_kernel`, a K loop of unmasked loads and MMAs):
  ``tl.dot`` on float8e4nv operands, the activation quantized once by
  :func:`_act_quant_kernel` (q e4m3 + scales), partial products promoted per 128 block with
  ``s_x * s_w`` (DeepGEMM's scheme). FP4 weights: e2m1 decoded in the prologue, scales folded
  exactly, bf16 ``tl.dot`` on the pre-quantized activation (with ``pow2`` the values ``q * s_x``
  are exact in bf16, so one fp32 accumulator and no promotion).

``grouped_linear`` (``wo_a``, no activation quantization) runs the same kernels with a group
index in the grid: group ``g`` multiplies ``x[..., g, :]`` by rows ``g*r:(g+1)*r``; from
:data:`GROUPED_DENSE_MIN_M` rows on with FP8 weights it runs the reference's dequantize + einsum. ``linear_pair``
(two weights on one input: ``wq_a`` and ``wkv``, ``wq_b`` and the indexer's ``wq_b``, a
compressor's ``wkv`` and ``wgate``) runs the decode kernel once over both weights' row tiles; it
also takes plain (BF16) weights there: ``tl.dot`` of the weight as stored, fp32 accumulation.

Plain ``torch.Tensor`` weights are not registered for ``linear``: they stay on the reference (cuBLAS).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...weights.formats import Fp8BlockWeight, FormatCode, Mxfp4Weight, Nvfp4Weight
from .. import KernelUnsupported
from . import runtime
from .numerics import e2m1_to_f32, e8m0_to_f32, fp8_scale, pow2_inv, quantize_e4m3

#: rows up to which the decode kernel (split-K GEMV) runs; above, the tiled GEMM
SKINNY_MAX_M = 32
#: rows from which the grouped projection (``wo_a``: FP8 weights, no activation quantization) runs
#: as DeepSeek's code and the reference do, the weight dequantized to the activation dtype and one
#: einsum (cuBLAS): H200, 8192 tokens, 4 layers: the tiled GEMM's weight-only path took 10.0 ms at
#: ~220 TF/s, the einsum 2.7 ms (results/2026-11-28d); from 512 rows the whole weight's
#: dequantization (one pass, :func:`fp8_dequantize_triton`) is paid back
GROUPED_DENSE_MIN_M = 512

# The kernels' constexpr FMT is the weight's FormatCode: FP8_F32 0, FP8_UE8M0 1 (``FMT < 2``: FP8),
# MXFP4 2, NVFP4 3.
# how the GEMM reads its activation operand (constexpr A_MODE)
_A_RAW, _A_FP8, _A_SIM, _A_QS = 0, 1, 2, 3


class LinearKernelError(KernelUnsupported):
    """The inputs do not fit the Triton linear kernels (the message names what is wrong); raised
    before any launch, so the dispatch runs the reference for that call."""


# ============================================================================= device helpers
# (decoding and rounding are dsv4.ops.triton.numerics': one set for every kernel)
@triton.jit
def _act_q(x, s, POW2: tl.constexpr):
    """e4m3 grid values of x / s (s broadcast over the block), as fp32 (exact in e4m3)."""
    if POW2:
        v = x * pow2_inv(s)  # x / s, exact
    else:
        v = tl.div_rn(x, s)
    return quantize_e4m3(v)


@triton.jit
def _fp4_tile(w_ptr, s_ptr, g_ptr, rows, r_ok, k0, K, stride_wn, stride_sn,
              FMT: tl.constexpr, FOLD_G: tl.constexpr, BN: tl.constexpr):
    """FP4 weight rows ``rows`` at K offset ``k0``, 128 values a row, split by nibble:
    ``lo[n, j]`` is element ``k0 + 2j`` and ``hi[n, j]`` element ``k0 + 2j + 1`` (j < 64),
    each times its block scale (and the NVFP4 global scale when ``FOLD_G``), fp32 [BN, 64]."""
    SB: tl.constexpr = 32 if FMT == 2 else 16  # K values per scale
    NSB: tl.constexpr = 128 // SB
    HB: tl.constexpr = SB // 2  # bytes per scale block
    c = tl.arange(0, NSB)
    j = tl.arange(0, HB)
    kh = k0 // 2 + c[:, None] * HB + j[None, :]  # [NSB, HB] byte index
    mask = r_ok[:, None, None] & (kh < K // 2)[None, :, :]
    pk = tl.load(w_ptr + rows[:, None, None].to(tl.int64) * stride_wn + kh[None, :, :], mask=mask,
                 other=0).to(tl.int32)  # [BN, NSB, HB]
    sc = k0 // SB + c
    smask = r_ok[:, None] & (sc < (K + SB - 1) // SB)[None, :]
    if FMT == 2:
        s = e8m0_to_f32(tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sn + sc[None, :], mask=smask,
                                other=127))
    else:
        s = tl.load(s_ptr + rows[:, None].to(tl.int64) * stride_sn + sc[None, :], mask=smask,
                    other=0.0).to(tl.float32)
    lo = e2m1_to_f32(pk & 15) * s[:, :, None]
    hi = e2m1_to_f32(pk >> 4) * s[:, :, None]
    if FOLD_G:
        g = tl.load(g_ptr)
        lo = lo * g
        hi = hi * g
    return tl.reshape(lo, (BN, 64)), tl.reshape(hi, (BN, 64))


@triton.jit
def _fp8_scale(s_ptr, rows, r_ok, kb, KB, stride_sn, FMT: tl.constexpr):
    """FP8-block weight scale of each row at K block ``kb``: fp32 [BN]."""
    ptr = s_ptr + (rows // 128) * stride_sn + kb
    if FMT == 0:
        return tl.load(ptr, mask=r_ok & (kb < KB), other=1.0)
    return e8m0_to_f32(tl.load(ptr, mask=r_ok & (kb < KB), other=127))


# ============================================================================= decode kernel
@triton.jit
def _skinny_kernel(x_ptr, w_ptr, s_ptr, g_ptr, w2_ptr, s2_ptr, g2_ptr, out_ptr, ws_ptr, cnt_ptr,
                   M, R, R2, K, TILES_PER_GROUP,
                   stride_xm, stride_xg, stride_wn, stride_sn, stride_om, stride_og, ws_stride_s, ws_stride_m,
                   unit, FMT: tl.constexpr, ACT_QUANT: tl.constexpr, POW2: tl.constexpr, OP_BF16: tl.constexpr,
                   PREC: tl.constexpr, BN: tl.constexpr, MP: tl.constexpr, KSTEPS: tl.constexpr,
                   SPLIT: tl.constexpr, PAIR: tl.constexpr):
    """``out[m, g, r] = x[m, g, :] . W[g*R + r, :]`` for a tile of BN weight rows and one K split.

    ``PAIR``: two weights of one format on the same input (``stride_xg = 0``): the first
    ``TILES_PER_GROUP`` tiles are rows of ``W`` (``R`` of them), the others rows of ``W2`` (``R2``),
    written after them (``stride_og = R``): ``out[m, :R] = x W^T``, ``out[m, R:] = x W2^T``.

    The MMA computes ``acc[BN, MP] = W_tile @ x_tile^T`` (weight rows on the MMA's M side).

    ``unit`` is 1.0: FP8 weights without act-quant are dequantized in registers, the MMA's left
    operand; chained into ``acc`` Triton 3.6 keeps that MMA in flight while the next K step's weights
    overwrite its registers (a race, ``bench/wgmma_hazards.py``). Its product times ``unit`` (which the
    compiler cannot fold) is added instead, so each MMA is retired before the next tile is decoded."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    if PAIR:
        second = pid_t >= TILES_PER_GROUP
        g = second.to(tl.int32)
        offs_r = (pid_t - g * TILES_PER_GROUP) * BN + tl.arange(0, BN)
        r_ok = offs_r < tl.where(second, R2, R)
        wrows = offs_r  # rows of the weight this tile reads
        w_ptr = tl.where(second, w2_ptr, w_ptr)
        s_ptr = tl.where(second, s2_ptr, s_ptr)
        g_ptr = tl.where(second, g2_ptr, g_ptr)
    else:
        g = pid_t // TILES_PER_GROUP
        offs_r = (pid_t % TILES_PER_GROUP) * BN + tl.arange(0, BN)
        r_ok = offs_r < R
        wrows = g * R + offs_r
    rows = g * R + offs_r  # output columns (over the groups / the pair)
    offs_m = tl.arange(0, MP)
    m_ok = offs_m < M
    x_rows = x_ptr + g * stride_xg + offs_m[:, None] * stride_xm  # [MP, 1]
    KB = tl.cdiv(K, 128)
    acc = tl.zeros([BN, MP], dtype=tl.float32)
    for i in range(KSTEPS):
        kb = pid_s * KSTEPS + i
        k0 = kb * 128
        if FMT < 2:  # ------------------------------------------------ FP8 block
            kk = k0 + tl.arange(0, 128)
            k_ok = kk < K
            w = tl.load(w_ptr + wrows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)  # [BN, 128] e4m3
            sw = _fp8_scale(s_ptr, wrows, r_ok, kb, KB, stride_sn, FMT)
            xr = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if ACT_QUANT:
                xf = xr.to(tl.float32)
                sx = fp8_scale(tl.max(tl.abs(xf), axis=1), POW2)  # [MP]
                q = _act_q(xf, sx[:, None], POW2).to(tl.float8e4nv)
                p = tl.dot(w, tl.trans(q))  # [BN, MP], fp32 (see FP8_ACC in _gemm_w8a8_kernel)
                acc += p * (sw[:, None] * sx[None, :])
            else:
                wd = (w.to(tl.float32) * sw[:, None]).to(xr.dtype)
                if PREC == "ieee":
                    acc = tl.dot(wd, tl.trans(xr), acc, input_precision=PREC)
                else:       # retired before the next tile overwrites its registers (see ``unit``)
                    acc += tl.dot(wd, tl.trans(xr), input_precision=PREC) * unit
        elif FMT == 4:  # ------------------------------------------------ plain (BF16 precision floor)
            kk = k0 + tl.arange(0, 128)
            k_ok = kk < K
            w = tl.load(w_ptr + wrows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            xr = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(w.to(xr.dtype), tl.trans(xr), acc, input_precision=PREC)
        else:  # ------------------------------------------------------ MXFP4 / NVFP4
            lo, hi = _fp4_tile(w_ptr, s_ptr, g_ptr, wrows, r_ok, k0, K, stride_wn, stride_sn, FMT,
                               FMT == 3 and not ACT_QUANT, BN)
            ke = k0 + 2 * tl.arange(0, 64)
            xe = tl.load(x_rows + ke[None, :], mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
            xo = tl.load(x_rows + ke[None, :] + 1, mask=m_ok[:, None] & (ke + 1 < K)[None, :], other=0.0)
            if ACT_QUANT:
                OP: tl.constexpr = tl.bfloat16 if OP_BF16 else tl.float32
                xef = xe.to(tl.float32)
                xof = xo.to(tl.float32)
                sx = fp8_scale(tl.maximum(tl.max(tl.abs(xef), axis=1), tl.max(tl.abs(xof), axis=1)), POW2)
                qe = _act_q(xef, sx[:, None], POW2).to(OP)
                qo = _act_q(xof, sx[:, None], POW2).to(OP)
                p = tl.dot(lo.to(OP), tl.trans(qe), input_precision=PREC)
                p = tl.dot(hi.to(OP), tl.trans(qo), p, input_precision=PREC)
                acc += p * sx[None, :]
            else:
                acc = tl.dot(lo.to(xe.dtype), tl.trans(xe), acc, input_precision=PREC)
                acc = tl.dot(hi.to(xo.dtype), tl.trans(xo), acc, input_precision=PREC)
    if FMT == 3 and ACT_QUANT:
        acc = acc * tl.load(g_ptr)
    out_ptrs = out_ptr + g * stride_og + offs_m[None, :] * stride_om + offs_r[:, None]
    out_mask = r_ok[:, None] & m_ok[None, :]
    if SPLIT == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials [SPLIT, M, G*R]; the last split to arrive sums them in split order
        ws_off = offs_m[None, :] * ws_stride_m + rows[:, None]
        tl.store(ws_ptr + pid_s * ws_stride_s + ws_off, acc, mask=out_mask)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            tot = tl.zeros([BN, MP], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # unrolled: every partial's load in flight at once
                tot += tl.load(ws_ptr + s * ws_stride_s + ws_off, mask=out_mask, other=0.0,
                               cache_modifier=".cg")
            tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(cnt_ptr + pid_t, 0, sem="relaxed", scope="gpu")  # ready for the next call


# ============================================================================= prefill kernels
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                      MODE: tl.constexpr, POW2: tl.constexpr, NB: tl.constexpr):
    """Quantize row ``program_id(0)`` of x, NB 128-blocks per program (numerics.fp8_quantize).

    MODE 1: q as e4m3 in natural order + fp32 scales (FP8-weight GEMM).
    MODE 2: ``q * s`` (exact with pow2) in the GEMM's operand dtype, each 128 block stored
            even elements first then odd ones (the FP4 GEMM's nibble split); no scales.
    MODE 3: like 2 but ``q`` alone + fp32 scales (non-pow2 scales).
    Blocks past K up to the padded width are written as zeros."""
    m = tl.program_id(0)
    kb = tl.program_id(1) * NB + tl.arange(0, NB)
    KB = tl.cdiv(K, 128)
    b_ok = kb < KB
    xrow = x_ptr + m.to(tl.int64) * stride_xm
    qrow = q_ptr + m.to(tl.int64) * stride_qm
    if MODE == 1:
        kk = kb[:, None] * 128 + tl.arange(0, 128)[None, :]
        x = tl.load(xrow + kk, mask=kk < K, other=0.0).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(x), axis=1), POW2)
        q = _act_q(x, s[:, None], POW2)
        tl.store(qrow + kk, q.to(q_ptr.dtype.element_ty), mask=b_ok[:, None])
        tl.store(s_ptr + m.to(tl.int64) * stride_sm + kb, s, mask=b_ok)
    else:
        j = tl.arange(0, 64)
        ke = kb[:, None] * 128 + 2 * j[None, :]
        xe = tl.load(xrow + ke, mask=ke < K, other=0.0).to(tl.float32)
        xo = tl.load(xrow + ke + 1, mask=ke + 1 < K, other=0.0).to(tl.float32)
        s = fp8_scale(tl.maximum(tl.max(tl.abs(xe), axis=1), tl.max(tl.abs(xo), axis=1)), POW2)
        qe = _act_q(xe, s[:, None], POW2)
        qo = _act_q(xo, s[:, None], POW2)
        if MODE == 2:
            qe = qe * s[:, None]
            qo = qo * s[:, None]
        else:
            tl.store(s_ptr + m.to(tl.int64) * stride_sm + kb, s, mask=b_ok)
        pe = qrow + kb[:, None] * 128 + j[None, :]
        tl.store(pe, qe.to(q_ptr.dtype.element_ty), mask=b_ok[:, None])
        tl.store(pe + 64, qo.to(q_ptr.dtype.element_ty), mask=b_ok[:, None])


@triton.jit
def _tile_coords(pid, M, R, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` of program ``pid`` in the grouped tile order (``GROUP_M`` row tiles walk
    the column tiles together, so their weight tiles are read from L2 while still there)."""
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(R, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _gemm_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, g_ptr, out_ptr,
                 M, R, K, stride_am, stride_ag, stride_sam, stride_wn, stride_sn, stride_om, stride_og,
                 FMT: tl.constexpr, A_MODE: tl.constexpr, PREC: tl.constexpr, KB: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``out[m, g, r] = A[m, g, :] . W[g*R + r, :]`` for one BM x BN tile (grid: tiles, groups).

    A_MODE 0: A is the activation itself (weight-only). 2: bf16 ``q*s`` in nibble-split order (no
    scales). 3: bf16 q in nibble-split order + scales. (1, e4m3 q + scales with FP8 weights:
    :func:`_gemm_w8a8_kernel`.)"""
    pid = tl.program_id(0)
    g = tl.program_id(1)
    pid_m, pid_n = _tile_coords(pid, M, R, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < M
    offs_r = pid_n * BN + tl.arange(0, BN)
    r_ok = offs_r < R
    rows = g * R + offs_r
    a_rows = a_ptr + g * stride_ag + offs_m[:, None].to(tl.int64) * stride_am  # [BM, 1]
    sa_rows = sa_ptr + offs_m.to(tl.int64) * stride_sam
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(KB):  # KB = ceil(K / 128) is a compile-time constant (a model dimension)
        k0 = kb * 128
        if FMT < 2:
            kk = k0 + tl.arange(0, 128)
            k_ok = kk < K
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            sw = _fp8_scale(s_ptr, rows, r_ok, kb, KB, stride_sn, FMT)
            # (A_MODE 0 only: e4m3 activations, A_MODE 1, run _gemm_w8a8_kernel)
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            wd = (w.to(tl.float32) * sw[:, None]).to(a.dtype)
            acc = tl.dot(a, tl.trans(wd), acc, input_precision=PREC)
        else:
            lo, hi = _fp4_tile(w_ptr, s_ptr, g_ptr, rows, r_ok, k0, K, stride_wn, stride_sn, FMT,
                               FMT == 3 and A_MODE == 0, BN)
            j = tl.arange(0, 64)
            if A_MODE == 0:
                ke = k0 + 2 * j
                ae = tl.load(a_rows + ke[None, :], mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
                ao = tl.load(a_rows + ke[None, :] + 1, mask=m_ok[:, None] & (ke + 1 < K)[None, :], other=0.0)
            else:
                ae = tl.load(a_rows + (k0 + j)[None, :], mask=m_ok[:, None], other=0.0)
                ao = tl.load(a_rows + (k0 + 64 + j)[None, :], mask=m_ok[:, None], other=0.0)
            if A_MODE == 3:
                p = tl.dot(ae, tl.trans(lo.to(ae.dtype)), input_precision=PREC)
                p = tl.dot(ao, tl.trans(hi.to(ao.dtype)), p, input_precision=PREC)
                acc += p * tl.load(sa_rows + kb, mask=m_ok, other=0.0)[:, None]
            else:
                acc = tl.dot(ae, tl.trans(lo.to(ae.dtype)), acc, input_precision=PREC)
                acc = tl.dot(ao, tl.trans(hi.to(ao.dtype)), acc, input_precision=PREC)
    if FMT == 3 and A_MODE != 0:
        acc = acc * tl.load(g_ptr)
    out_ptrs = out_ptr + g * stride_og + offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _gemm_w8a8_kernel(a_ptr, sa_ptr, w_ptr, s_ptr, out_ptr, M, R, K, stride_am, stride_sam, stride_wn, stride_sn,
                      stride_om, FMT: tl.constexpr, KB: tl.constexpr, EVEN_K: tl.constexpr,
                      FP8_ACC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """``out = x W^T`` for FP8-block weights and e4m3 activations (W8A8, ``_gemm_kernel``'s
    ``A_MODE == 1`` case, the prefill's dense projections), one BM x BN tile: the same products and
    promotion per 128 block, with a K loop of loads and MMAs only. Rows past ``M`` / ``R`` read
    rows inside (``% M``, ``% R``) and are never stored, so no load is masked; the pointers step by
    128; the weight scale is one value a tile (``BN`` divides the 128-row scale block); ``EVEN_K``:
    ``K`` is a multiple of 128 (``q`` is zero padded to 128s, so only the weight needs the mask)."""
    pid = tl.program_id(0)
    pid_m, pid_n = _tile_coords(pid, M, R, BM, BN, GROUP_M)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_r = pid_n * BN + tl.arange(0, BN)
    kk = tl.arange(0, 128)
    a_ptrs = a_ptr + (offs_m % M)[:, None].to(tl.int64) * stride_am + kk[None, :]
    w_ptrs = w_ptr + (offs_r % R)[:, None].to(tl.int64) * stride_wn + kk[None, :]
    sa_ptrs = sa_ptr + (offs_m % M).to(tl.int64) * stride_sam
    s_tile = s_ptr + ((pid_n * BN) // 128) * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(KB):  # KB = ceil(K / 128) is a compile-time constant (a model dimension)
        a = tl.load(a_ptrs)
        if EVEN_K:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=(kb * 128 + kk < K)[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb)
        if FMT == 0:
            sw = tl.load(s_tile + kb)
        else:
            sw = e8m0_to_f32(tl.load(s_tile + kb))
        # Hopper's FP8 MMA sums inside the 128 block at reduced precision (~1e-4 relative, as in
        # DeepGEMM / DeepSeek's kernels); FP8_ACC = 32 promotes every 32 products (4.5e-5: the
        # instruction itself is not exact either) at 1.5x the time.
        acc += tl.dot(a, tl.trans(w), max_num_imprecise_acc=FP8_ACC) * (sa * sw)[:, None]
        a_ptrs += 128
        w_ptrs += 128
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_r[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_r < R)[None, :])


@triton.jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                        FMT: tl.constexpr, BR: tl.constexpr):
    """Rows ``[BR * pid, ...)`` x the 128 columns of block ``program_id(1)`` of an FP8-block weight as
    ``e4m3 * scale`` in fp32 rounded once to ``out``'s dtype: ``Fp8BlockWeight.dequantize``'s bits
    (its bf16 path multiplies exact values, so one rounding either way)."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    k = kb * 128 + tl.arange(0, 128)
    m = (r < N)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + r[:, None].to(tl.int64) * stride_wn + k[None, :], mask=m, other=0.0).to(tl.float32)
    sp = s_ptr + (r // 128) * stride_sn + kb
    if FMT == 0:
        sw = tl.load(sp, mask=r < N, other=1.0)
    else:
        sw = e8m0_to_f32(tl.load(sp, mask=r < N, other=127))
    tl.store(out_ptr + r[:, None].to(tl.int64) * stride_on + k[None, :],
             (w * sw[:, None]).to(out_ptr.dtype.element_ty), mask=m)


# ============================================================================= host side
def fp8_dequantize_triton(w: Fp8BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """``w.dequantize(dtype)`` for a 2-D FP8-block weight (block 128) in one pass (the torch
    composition makes ~4 passes over the weight, ~280 us for Flash's ``wo_a`` on an H200)."""
    code, data, scale, _, _ = _weight_args(w, "fp8 dequantize (triton)")
    if code >= FormatCode.MXFP4:
        raise LinearKernelError(f"fp8 dequantize (triton): not an FP8-block weight: {type(w).__name__}")
    N, K = data.shape
    out = runtime.empty((N, K), dtype, data.device)
    BR = 32
    _fp8_dequant_kernel[(triton.cdiv(N, BR), triton.cdiv(K, 128))](
        data, scale, out, N, K, data.stride(0), scale.stride(0), out.stride(0), FMT=code, BR=BR, num_warps=4)
    return out


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """The split-K arrival counters (zero between calls: the reducing program resets its own)."""
    try:
        return runtime.counters(device, n, "linear")
    except runtime.CounterError as e:
        raise LinearKernelError(str(e)) from None


def _weight_args(w: object, who: str) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """(format code, data, scale, global scale (or a dummy), bytes per K value) of a packed weight,
    validated (2-D, contiguous, the block sizes the kernels assume)."""
    if isinstance(w, torch.Tensor):         # a plain weight (only the decode pair takes one)
        if w.dim() != 2 or not w.is_contiguous() or not w.is_floating_point():
            raise LinearKernelError(f"{who}: a plain weight must be a contiguous float [N, K], got "
                                    f"{tuple(w.shape)} {w.dtype}")
        return int(FormatCode.BF16), w, w, w, float(w.element_size())
    name = getattr(w, "name", None) or "<unnamed weight>"
    if len(w.shape) != 2:
        raise LinearKernelError(f"{who}: weight {name} has shape {tuple(w.shape)}; the kernel takes one 2-D "
                                "weight (stacked experts go through moe)")
    code, data, scale, gs = w.kernel_operands() if hasattr(w, "kernel_operands") else (None,) * 4
    if code not in (FormatCode.FP8_F32, FormatCode.FP8_UE8M0, FormatCode.MXFP4, FormatCode.NVFP4):
        raise LinearKernelError(f"{who}: unsupported weight type {type(w).__name__}")
    if code < FormatCode.MXFP4 and w.block != 128:
        raise LinearKernelError(f"{who}: weight {name} has FP8 block {w.block}; the kernel needs 128")
    if gs is not None and gs.numel() != 1:
        raise LinearKernelError(f"{who}: weight {name} has {gs.numel()} global scales; expected one")
    gs = scale if gs is None else gs        # a pointer the kernel never reads
    kbytes = 1.0 if code < FormatCode.MXFP4 else 0.5
    for t, what in ((data, "data"), (scale, "scale")):
        if not t.is_contiguous():
            raise LinearKernelError(f"{who}: weight {name} {what} must be contiguous")
    return int(code), data, scale, gs, kbytes


def _check_x(x: torch.Tensor, who: str) -> None:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LinearKernelError(f"{who}: activation dtype {x.dtype} not supported (bf16, fp16, fp32)")


def _skinny_config(M: int, rows: int, K: int, kbytes: float, n_sm: int, fp4: bool = False) -> dict:
    """Tile rows and K split for the decode kernel: enough programs to cover the SMs twice, each
    at least one 128-wide K step, the fp32 partials at most ~1/4 of the weight bytes, at most 16
    splits (8 for the larger tiles: the reducing program holds every partial in registers).

    FP4 weights: 128-row tiles split 8 ways along K wherever the partials allow, 4 warps when a
    program has a single K step. Their dequantization (nibbles, block scales) costs more per byte
    than FP8's, so more programs in flight pay: measured by ``bench/tune_skinny.py`` on an H100
    (2026-11-24), 1.1x to 1.6x over the FP8 rules on Flash's ``wq_b`` and expert-shaped ``w1``; the
    FP8 rules were within 6% of the best config found for every FP8 shape."""
    MP = 16 if M <= 16 else 32
    KB = math.ceil(K / 128)
    cap = max(1, int(K * kbytes / (16 * M)))
    if fp4:
        split = max(1, min(KB, cap, 8))
        ksteps = math.ceil(KB / split)
        return dict(BN=128, MP=MP, KSTEPS=ksteps, SPLIT=math.ceil(KB / ksteps),
                    num_warps=4 if ksteps == 1 else 8, num_stages=3)
    BN = 128 if rows >= 64 * n_sm else 64
    tiles = math.ceil(rows / BN)
    want = max(1, round(2 * n_sm / tiles))
    split = max(1, min(KB, want, cap, 16 if BN * MP <= 1024 else 8))
    ksteps = math.ceil(KB / split)
    split = math.ceil(KB / ksteps)
    return dict(BN=BN, MP=MP, KSTEPS=ksteps, SPLIT=split)


def _prec(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None


def _run_skinny(x3: torch.Tensor, w: object, act_quant: bool, pow2: bool, out3: torch.Tensor, G: int, R: int,
                who: str, config: dict | None = None, w2: object | None = None) -> None:
    """x3 [M, G, K] (last dim contiguous) -> out3 [M, G, R]; with ``w2`` (``G = 1``, a pair of weights
    on one input), out3 [M, 1, R + R2]: ``x W^T`` then ``x W2^T``, one launch."""
    code, data, scale, gs, kbytes = _weight_args(w, who)
    code2, data2, scale2, gs2, _ = (code, data, scale, gs, kbytes) if w2 is None else _weight_args(w2, who)
    if code2 != code or data2.stride(0) != data.stride(0) or scale2.stride(0) != scale.stride(0):
        raise LinearKernelError(f"{who}: a pair of weights needs one format and layout, got {type(w).__name__} "
                                f"(code {code}) and {type(w2).__name__} (code {code2})")
    M, _, K = x3.shape
    R2 = 0 if w2 is None else w2.shape[-2]
    cfg = dict(config or _skinny_config(M, G * R + R2, K, kbytes, runtime.sm_count(x3.device), fp4=code >= 2))
    if M > cfg["MP"]:
        raise LinearKernelError(f"{who}: {M} rows exceed the decode tile ({cfg['MP']})")
    BN, split = cfg["BN"], cfg["SPLIT"]
    tiles = triton.cdiv(R, BN)
    programs = G * tiles + triton.cdiv(R2, BN)
    op_bf16 = not runtime.interpreting()
    if act_quant:
        prec = None if (code < 2 or op_bf16) else "ieee"
    else:
        prec = _prec(x3.dtype)
    if split > 1:
        cnt = _counters(x3.device, programs)  # may refuse (first use inside a capture): allocate nothing before
        ws = runtime.empty((split, M, G * R + R2), torch.float32, x3.device)
    else:
        ws, cnt = out3, out3
    pair = w2 is not None
    _skinny_kernel[(programs, split)](
        x3, data, scale, gs, data2, scale2, gs2, out3, ws, cnt, M, R, R2, K, tiles,
        x3.stride(0), 0 if pair else x3.stride(1), data.stride(0), scale.stride(0), out3.stride(0),
        R if pair else out3.stride(1), M * (G * R + R2), G * R + R2, 1.0,
        FMT=code, ACT_QUANT=act_quant, POW2=pow2, OP_BF16=op_bf16, PREC=prec,
        BN=BN, MP=cfg["MP"], KSTEPS=cfg["KSTEPS"], SPLIT=split, PAIR=pair,
        num_warps=cfg.get("num_warps", 4 if code < 2 else 8), num_stages=cfg.get("num_stages", 4))


def act_quant_triton(x2: torch.Tensor, pow2: bool, mode: int = _A_FP8,
                     op_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize x2 [M, K] per 1x128 block (the GEMM's activation operand), K padded to 128s.

    mode 1 (``_A_FP8``): q float8_e4m3fn [M, Kpad] bit-identical to ``numerics.fp8_quantize(x,
    128, pow2)`` (zero padded) and fp32 scales [M, KB]. Modes 2/3: see :func:`_act_quant_kernel`."""
    M, K = x2.shape
    KB = triton.cdiv(K, 128)
    qdt = torch.float8_e4m3fn if mode == _A_FP8 else op_dtype
    q = runtime.empty((M, KB * 128), qdt, x2.device)
    s = runtime.empty((M, KB), torch.float32, x2.device)
    NB = 4
    _act_quant_kernel[(M, triton.cdiv(KB, NB))](x2, q, s, K, x2.stride(0), q.stride(0), s.stride(0),
                                                 MODE=mode, POW2=pow2, NB=NB, num_warps=4)
    return q, s


def _gemm_defaults(code: int) -> dict:
    """Tiling of the GEMM per weight format code (bench/aot_linear.py compiles these)."""
    if code < 2:  # measured on H100 (bench/tune_linear.py): 80% of cuBLAS BF16 at 4096x4096x8192
        return dict(BM=64, BN=128, GROUP_M=8, num_warps=4, num_stages=4, FP8_ACC=None)
    return dict(BM=128, BN=128, GROUP_M=8, num_warps=8, num_stages=4, FP8_ACC=None)


def _gemm_operand(x2: torch.Tensor, code: int, pow2: bool) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(A_MODE, a, scales)``: the GEMM's quantized activation operand of ``x2 [M, K]`` for a weight
    of format ``code`` (one per input: the two GEMMs of a pair share it)."""
    op_dtype = torch.float32 if runtime.interpreting() else torch.bfloat16
    mode = _A_FP8 if code < 2 else (_A_SIM if pow2 else _A_QS)
    return (mode, *act_quant_triton(x2, pow2, mode, op_dtype))


def _run_gemm(x3: torch.Tensor, w: object, act_quant: bool, pow2: bool, out3: torch.Tensor, G: int, R: int,
              who: str, config: dict | None = None, operand: tuple | None = None) -> None:
    """x3 [M, G, K] -> out3 [M, G, R] through the tiled GEMM (``operand``: the quantized activation
    :func:`_gemm_operand` already made for this input and format)."""
    code, data, scale, gs, _ = _weight_args(w, who)
    M, _, K = x3.shape
    cfg = _gemm_defaults(code)
    cfg.update(config or {})
    if act_quant:
        if G != 1:
            raise LinearKernelError(f"{who}: grouped GEMM with activation quantization is not implemented")
        mode, a, sa = operand or _gemm_operand(x3[:, 0], code, pow2)
        stride_am, stride_ag = a.stride(0), 0
        prec = _prec(a.dtype) if mode != _A_FP8 else None
    else:
        mode, a, sa = _A_RAW, x3, x3
        stride_am, stride_ag = x3.stride(0), x3.stride(1)
        prec = _prec(x3.dtype)
    grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(R, cfg["BN"]), G)
    if mode == _A_FP8:
        if 128 % cfg["BN"]:
            raise LinearKernelError(f"{who}: the W8A8 GEMM's BN must divide the 128-row scale block, got {cfg['BN']}")
        _gemm_w8a8_kernel[grid[:1]](
            a, sa, data, scale, out3, M, R, K, a.stride(0), sa.stride(0), data.stride(0), scale.stride(0),
            out3.stride(0), FMT=code, KB=triton.cdiv(K, 128), EVEN_K=K % 128 == 0, FP8_ACC=cfg["FP8_ACC"],
            BM=cfg["BM"], BN=cfg["BN"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
        return
    _gemm_kernel[grid](
        a, sa, data, scale, gs, out3, M, R, K, stride_am, stride_ag, sa.stride(0) if sa is not a else 0,
        data.stride(0), scale.stride(0), out3.stride(0), out3.stride(1),
        FMT=code, A_MODE=mode, PREC=prec, KB=triton.cdiv(K, 128), BM=cfg["BM"], BN=cfg["BN"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _run(x3: torch.Tensor, w: object, act_quant: bool, pow2: bool, out3: torch.Tensor, G: int, R: int,
         who: str, path: str | None = None, config: dict | None = None) -> None:
    if x3.shape[0] == 0:
        return
    path = path or ("skinny" if x3.shape[0] <= SKINNY_MAX_M else "gemm")
    (_run_skinny if path == "skinny" else _run_gemm)(x3, w, act_quant, pow2, out3, G, R, who, config)


# ============================================================================= the ops
def linear_triton(x: torch.Tensor, w: object, act_quant: bool = False, pow2: bool = True,
                  out_dtype: torch.dtype | None = None, *, _path: str | None = None,
                  _config: dict | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T -> [..., N]`` for an FP8-block / MXFP4 / NVFP4 weight; see
    :func:`dsv4.ops.reference.linear` (the twin). ``_path`` / ``_config`` force a kernel and its
    tiling (tests)."""
    who = "linear (triton)"
    _check_x(x, who)
    N, K = w.shape[-2], w.shape[-1]
    if x.shape[-1] != K:
        raise LinearKernelError(f"{who}: x has shape {tuple(x.shape)} but the weight has shape {tuple(w.shape)}")
    x2, out_dtype = _rows(x, K, out_dtype, who)
    out = runtime.empty((x2.shape[0], N), out_dtype, x.device)
    _run(x2.unsqueeze(1), w, act_quant, pow2, out.unsqueeze(1), 1, N, who, _path, _config)
    return out.view(*x.shape[:-1], N)


def _rows(x: torch.Tensor, K: int, out_dtype: torch.dtype | None, who: str) -> tuple[torch.Tensor, torch.dtype]:
    """``x`` as ``[M, K]`` rows with a unit last stride, and the output dtype (``x``'s by default;
    bf16, fp16 or fp32)."""
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise LinearKernelError(f"{who}: out_dtype {out_dtype} not supported")
    x2 = x.reshape(-1, K)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), out_dtype


def _one_format(w1: object, w2: object) -> bool:
    """The two weights share one kernel format code (the pair kernel's constexpr) and storage type."""
    if isinstance(w1, torch.Tensor) or isinstance(w2, torch.Tensor):
        return isinstance(w1, torch.Tensor) and isinstance(w2, torch.Tensor) and w1.dtype == w2.dtype
    if type(w1) is not type(w2) or not hasattr(w2, "kernel_operands"):
        return False
    return w1.kernel_operands()[0] == w2.kernel_operands()[0]


def _linear_op(x: torch.Tensor, w: object, act_quant: bool, pow2: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``dsv4.ops.linear`` (whatever kernel is registered for ``w``'s format)."""
    from ... import ops
    return ops.linear(x, w, act_quant, pow2, out_dtype)


def linear_pair_triton(x: torch.Tensor, w1: object, w2: object, act_quant: bool = False, pow2: bool = True,
                       out_dtype: torch.dtype | None = None, *, _config: dict | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two weights of one format on the same input (``wq_a`` and ``wkv``); see
    :func:`dsv4.ops.reference_fused.linear_pair`. Decode: one launch of the split-K GEMV over both
    weights' rows, the results views of one ``[..., N1 + N2]`` buffer. Prefill: the GEMM per weight,
    on one quantized input, each result contiguous.
    Plain weights (the compressor's BF16 ``wkv`` and ``wgate``) take the decode kernel's plain path
    (their input is never rounded); their prefill is the reference's matmul. Weights of two formats:
    a launch each. ``_config`` forces the decode tiling (tests)."""
    who = "linear_pair (triton)"
    _check_x(x, who)
    (N1, K), N2 = w1.shape[-2:], w2.shape[-2]
    if x.shape[-1] != K or w2.shape[-1] != K:
        raise LinearKernelError(f"{who}: x has shape {tuple(x.shape)}, the weights {tuple(w1.shape)} and "
                                f"{tuple(w2.shape)}")
    x2, out_dtype = _rows(x, K, out_dtype, who)
    decode = 0 < x2.shape[0] <= SKINNY_MAX_M
    if not _one_format(w1, w2) or (isinstance(w1, torch.Tensor) and not decode):
        # weights of two formats (some exports mix them), or a plain pair's prefill: a launch each
        return _linear_op(x, w1, act_quant, pow2, out_dtype), _linear_op(x, w2, act_quant, pow2, out_dtype)
    if isinstance(w1, torch.Tensor):
        act_quant = False                 # a plain weight's input is never rounded (reference.linear)
    if decode:
        out = runtime.empty((x2.shape[0], N1 + N2), out_dtype, x.device)
        _run_skinny(x2.unsqueeze(1), w1, act_quant, pow2, out.unsqueeze(1), 1, N1, who, _config, w2=w2)
        out = out.view(*x.shape[:-1], N1 + N2)
        return out[..., :N1], out[..., N1:]
    # Prefill: each result in its own contiguous buffer. (As views of one [M, N1 + N2] buffer, a
    # consumer that flattens heads, CSA's queries [M, H, hd], copied the whole result first: 0.6 ms
    # at 8192 tokens on an H200, results/2026-11-28g/call8_profile_prefill_ops.txt.)
    out1 = runtime.empty((x2.shape[0], N1), out_dtype, x.device)
    out2 = runtime.empty((x2.shape[0], N2), out_dtype, x.device)
    if x2.shape[0]:
        # one quantized input for both GEMMs (the same rounding of the same x: one launch fewer)
        x3 = x2.unsqueeze(1)
        operand = _gemm_operand(x2, _weight_args(w1, who)[0], pow2) if act_quant else None
        _run_gemm(x3, w1, act_quant, pow2, out1.unsqueeze(1), 1, N1, who, operand=operand)
        _run_gemm(x3, w2, act_quant, pow2, out2.unsqueeze(1), 1, N2, who, operand=operand)
    return out1.view(*x.shape[:-1], N1), out2.view(*x.shape[:-1], N2)


def grouped_linear_triton(x: torch.Tensor, w: object, groups: int, *, _path: str | None = None,
                          _config: dict | None = None) -> torch.Tensor:
    """Grouped output projection: group ``g`` of ``x [..., G, K]`` times rows ``g*r:(g+1)*r`` of
    ``w [G*r, K]`` -> ``[..., G, r]`` in ``x.dtype``; no activation quantization (see
    :func:`dsv4.ops.reference.grouped_linear`)."""
    who = "grouped_linear (triton)"
    _check_x(x, who)
    N, K = w.shape[-2], w.shape[-1]
    if x.dim() < 2 or x.shape[-2] != groups or x.shape[-1] != K or N % groups:
        raise LinearKernelError(f"{who}: x {tuple(x.shape)} and weight {tuple(w.shape)} do not form {groups} "
                                f"groups (needs x [..., {groups}, K], weight [{groups}*r, K])")
    R = N // groups
    x3 = x.reshape(-1, groups, K)
    out = runtime.empty((x3.shape[0], groups, R), x.dtype, x.device)
    if (_path is None and x3.shape[0] >= GROUPED_DENSE_MIN_M and isinstance(w, Fp8BlockWeight)
            and x.dtype in (torch.bfloat16, torch.float16) and not runtime.interpreting()):
        # the reference's own computation (bit for bit): tensor cores at cuBLAS's rate. The batched
        # GEMM its einsum runs, written straight into token-major rows: the einsum's result is
        # group-major, and wo_b's input then copied it whole (0.17 ms a layer at 8192 tokens on an
        # H200, results/2026-11-28g/call8_profile_prefill_ops.txt).
        wg = fp8_dequantize_triton(w, x.dtype).unflatten(0, (groups, R))
        torch.bmm(x3.transpose(0, 1), wg.transpose(1, 2), out=out.transpose(0, 1))
    else:
        _run(x3 if x3.stride(-1) == 1 else x3.contiguous(), w, False, True, out, groups, R, who, _path, _config)
    return out.view(*x.shape[:-1], R)


REGISTRATIONS = [
    ("linear_pair", torch.Tensor, linear_pair_triton),
    ("linear_pair", Fp8BlockWeight, linear_pair_triton),
    ("linear_pair", Mxfp4Weight, linear_pair_triton),
    ("linear_pair", Nvfp4Weight, linear_pair_triton),
    ("linear", Fp8BlockWeight, linear_triton),
    ("linear", Mxfp4Weight, linear_triton),
    ("linear", Nvfp4Weight, linear_triton),
    ("grouped_linear", Fp8BlockWeight, grouped_linear_triton),
    ("grouped_linear", Mxfp4Weight, grouped_linear_triton),
    ("grouped_linear", Nvfp4Weight, grouped_linear_triton),
]
