"""The device code both MoE paths share (:mod:`dsv4.ops.triton.moe`): the activation
quantization kernel, an expert's weight tiles decoded in registers (FP8 block, MXFP4, NVFP4, by the
``FMT`` constexpr, a :class:`dsv4.weights.formats.FormatCode`: FP8_F32 0 and FP8_UE8M0 1, so
``FMT < 2`` is FP8; MXFP4 2; NVFP4 3), the GEMM over them and the gate/up half with its SwiGLU
epilogue.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .numerics import (e2m1x8_to_f16, e4m3_decode, e8m0_to_f32, fp8_scale, mxfp4_to_bf16, pow2_inv,
                       quantize_e4m3)

#: 128-blocks of a row each program of the activation quantization handles
QUANT_BLOCKS = 4


@triton.jit(do_not_specialize=["R", "n_ids"])
def _quant_kernel(src_ptr, dst_ptr, q_ptr, s_ptr, ids_ptr, R, n_ids, K: tl.constexpr, NB: tl.constexpr,
                  POW2: tl.constexpr, XDT: tl.constexpr, WRITE_Q: tl.constexpr,
                  SKIP_EMPTY: tl.constexpr):
    """DeepSeek's ``act_quant`` of ``NB`` 128-blocks of one row of ``src [R, K]``
    (``numerics.fp8_quantize(v, 128, pow2)``): ``amax = max(|v|, 1e-4)``, ``scale = amax / 448``
    (IEEE division; rounded up to a power of two from the float's bits with ``POW2``),
    ``q = e4m3(clamp(v / scale))``. Writes ``dst = (q * scale).to(XDT)`` (the reference's
    ``act_quant_sim``) and, with ``WRITE_Q``, ``q`` (e4m3 or fp16, exact either way) and the fp32
    scales. ``SKIP_EMPTY``: the first ``n_ids`` rows are pairs, those whose id is ``-1`` (never
    computed) are skipped; rows past them (the decode's shared-expert rows) are all computed."""
    r = tl.program_id(0)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    kk = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    bm = blk < (K + 127) // 128
    if SKIP_EMPTY:
        bm = bm & ((r >= n_ids) | (tl.load(ids_ptr + r, mask=r < n_ids, other=0) >= 0))
    m = (kk < K) & bm[:, None]
    v = tl.load(src_ptr + r.to(tl.int64) * K + kk, mask=m, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(tl.abs(v), axis=1), POW2)
    if POW2:
        y = v * pow2_inv(s)[:, None]   # v / s, exact
    else:
        y = tl.math.div_rn(v, tl.broadcast_to(s[:, None], v.shape))
    q = quantize_e4m3(y)
    tl.store(dst_ptr + r.to(tl.int64) * K + kk, (q * s[:, None]).to(XDT), mask=m)
    if WRITE_Q:
        tl.store(q_ptr + r.to(tl.int64) * K + kk, q.to(q_ptr.dtype.element_ty), mask=m)
        NKB: tl.constexpr = (K + 127) // 128
        tl.store(s_ptr + r.to(tl.int64) * NKB + blk, s, mask=bm)


@triton.jit
def _fp4_group16(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr,
                 FMT: tl.constexpr, BN: tl.constexpr):
    """One scale group (``GS`` = 32 MXFP4 / 16 NVFP4 columns from ``k0``) of rows ``rows [BN]`` of
    an FP4 expert: ``(e2m1 * 2^-14 as fp16 [BN, GS], scale * 2^14 fp32 [BN])``."""
    GS: tl.constexpr = 32 if FMT == 2 else 16
    W: tl.constexpr = GS // 8
    EVEN: tl.constexpr = (K % 128 == 0) and (N % BN == 0)
    col = k0 // 8 + tl.arange(0, W)
    ptrs = w_ptr + rows[:, None] * (K // 8) + col[None, :]
    sp = s_ptr + rows * ((K + GS - 1) // GS) + k0 // GS
    if EVEN:
        words = tl.load(ptrs)
        sv = tl.load(sp)
    else:
        words = tl.load(ptrs, mask=rmask[:, None] & (col < K // 8)[None, :], other=0)
        sv = tl.load(sp, mask=rmask & (k0 < K), other=0)
    w = tl.reshape(e2m1x8_to_f16(words, False), (BN, GS))
    if FMT == 2:
        scale = e8m0_to_f32(sv) * 16384.0
    else:
        scale = e4m3_decode(sv, tl.float32) * 16384.0
    return w, scale


@triton.jit
def _fp4_words(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr, GS: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``rows [BN]`` x columns ``[k0, k0 + BK)`` of an FP4 expert as stored: int32 words of
    8 codes ``[BN, BK / GS, GS / 8]`` and the scale bytes of their groups ``[BN, BK / GS]`` (zeros
    past ``K`` or ``N``)."""
    G: tl.constexpr = BK // GS
    W: tl.constexpr = GS // 8
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    g = tl.arange(0, G)
    col = k0 // 8 + g[None, :, None] * W + tl.arange(0, W)[None, None, :]
    ptrs = w_ptr + rows[:, None, None] * (K // 8) + col
    NG: tl.constexpr = (K + GS - 1) // GS
    sp = s_ptr + rows[:, None] * NG + (k0 // GS + g)[None, :]
    if EVEN:
        words = tl.load(ptrs)
        sv = tl.load(sp)
    else:
        words = tl.load(ptrs, mask=rmask[:, None, None] & (col < K // 8), other=0)
        sv = tl.load(sp, mask=rmask[:, None] & ((k0 // GS + g) < NG)[None, :], other=0)
    return words, sv


@triton.jit
def _mx_bf16_tile(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
    """Rows ``rows [BN]`` x columns ``[k0, k0 + BK)`` of an MXFP4 expert whose scale bytes are all
    ``<= 128`` (``moe.Launch.mx_bf16``), dequantized to bf16 ``[BN, BK]`` exactly by
    :func:`.numerics.mxfp4_to_bf16`: about a quarter fewer instructions a K step than decoding
    through fp16 and fp32 (SASS of the grouped GEMMs' K loops, ``bench/ptxas_regs.py --prefill``)."""
    words, sv = _fp4_words(w_ptr, s_ptr, rows, rmask, k0, K, N, 32, BN, BK)
    return mxfp4_to_bf16(words, sv)


@triton.jit
def _weight_raw(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr,
                FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Rows ``rows [BN]`` x columns ``[k0, k0 + BK)`` of one expert's weight as stored, for
    :func:`_weight_decode`: ``(data, scales)`` (FP8: bytes ``[BN, 1, BK]`` and the 128x128 blocks'
    scales ``[BN]``; FP4: int32 words of 8 codes and the groups' scale bytes, :func:`_fp4_words`;
    zeros past ``K`` or ``N``). Split from the decode so a K loop can put every load of a step in
    flight before it waits on any of them."""
    GS: tl.constexpr = BK if FMT < 2 else (32 if FMT == 2 else 16)
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    if FMT < 2:
        kk = tl.arange(0, BK)
        ptrs = w_ptr + rows[:, None, None] * K + (k0 + kk)[None, None, :]
        if EVEN:
            data = tl.load(ptrs)
        else:
            data = tl.load(ptrs, mask=rmask[:, None, None] & ((k0 + kk) < K)[None, None, :], other=0)
        sp = s_ptr + (rows // 128) * ((K + 127) // 128) + k0 // 128
        if FMT == 1:
            sv = tl.load(sp, mask=rmask, other=127)
        else:
            sv = tl.load(sp, mask=rmask, other=1.0)
    else:
        data, sv = _fp4_words(w_ptr, s_ptr, rows, rmask, k0, K, N, GS, BN, BK)
    return data, sv


@triton.jit
def _weight_decode(data, sv, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RAW: tl.constexpr):
    """:func:`_weight_raw`'s tile dequantized but for a per-group factor: ``(w [BN, G, GS],
    scale [BN, G] fp32)``, the weight being ``w * scale`` (``G * GS = BK``).

    FP4 (``GS`` = 32 MXFP4, 16 NVFP4): ``w = e2m1 * 2^-14`` (fp32), ``scale = 2^(s-127) * 2^14``
    or ``block_scale * 2^14``; with ``RAW`` (NVFP4) ``w`` in fp16 and the block scale as fp16. FP8:
    ``G = 1``, ``w`` the e4m3 values (fp32, or float8e4nv with ``RAW``), ``scale`` the 128x128
    block's scale.
    """
    GS: tl.constexpr = BK if FMT < 2 else (32 if FMT == 2 else 16)
    G: tl.constexpr = BK // GS
    if FMT < 2:
        w = data.to(tl.float8e4nv, bitcast=True)
        if not RAW:
            w = w.to(tl.float32)
        if FMT == 1:
            sc = e8m0_to_f32(sv)
        else:
            sc = sv
        scale = tl.reshape(sc, (BN, 1))
    else:
        w = tl.reshape(e2m1x8_to_f16(data, not RAW), (BN, G, GS))
        if FMT == 2:
            scale = e8m0_to_f32(sv) * 16384.0
        elif RAW:
            scale = e4m3_decode(sv, tl.float16)
        else:
            scale = e4m3_decode(sv, tl.float32) * 16384.0
    return w, scale


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr,
                 FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RAW: tl.constexpr):
    """Rows ``rows [BN]`` x columns ``[k0, k0 + BK)`` of one expert's weight (``w_ptr`` / ``s_ptr``
    point at the expert's data, FP4 int32 words of 8 codes or FP8 bytes, and scales), loaded and
    dequantized but for a per-group factor (:func:`_weight_decode`)."""
    data, sv = _weight_raw(w_ptr, s_ptr, rows, rmask, k0, K, N, FMT, BN, BK)
    return _weight_decode(data, sv, FMT, BN, BK, RAW)


@triton.jit
def _expert_ptrs(w_ptr, s_ptr, e, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr):
    """Data and scale pointers of expert ``e`` of a stacked weight (64-bit offsets)."""
    e64 = e.to(tl.int64)
    if FMT < 2:
        return w_ptr + e64 * (N * K), s_ptr + e64 * (((N + 127) // 128) * ((K + 127) // 128))
    elif FMT == 2:
        return w_ptr + e64 * (N * (K // 8)), s_ptr + e64 * (N * ((K + 31) // 32))
    else:
        return w_ptr + e64 * (N * (K // 8)), s_ptr + e64 * (N * ((K + 15) // 16))


@triton.jit
def _load_rows(a_ptr, a_rows, a_valid, k0, K: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """Columns ``[k0, k0 + BK)`` of rows ``a_rows [R]`` of ``A [*, K]`` (zeros for invalid rows
    and, unless ``EVEN`` says every tile is inside, past ``K``), ``[R, BK]`` in A's dtype."""
    kk = k0 + tl.arange(0, BK)
    ptrs = a_ptr + a_rows[:, None] * K + kk[None, :]
    if EVEN:
        return tl.load(ptrs, mask=a_valid[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=a_valid[:, None] & (kk < K)[None, :], other=0.0)


@triton.jit
def _accumulate(acc, a, w, scale, FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, CDT: tl.constexpr):
    """``acc += a @ (w * scale)^T`` for one K tile. ``BM == 1``: ``acc [BN, G]`` per-group partial
    sums times the group scale (CUDA cores); else ``acc [BM, BN]`` via ``tl.dot`` on exact ``CDT``
    operands (FP4: the scaled weight; FP8: the e4m3 values, block scale on the product)."""
    G: tl.constexpr = 1 if FMT < 2 else (BK // 32 if FMT == 2 else BK // 16)
    if BM == 1:
        part = tl.sum(w * tl.reshape(a.to(tl.float32), (1, G, BK // G)), axis=2)
        acc += part * scale
    elif FMT < 2:
        wt = tl.reshape(w, (BN, BK)).to(CDT)
        if CDT == tl.float32:
            part = tl.dot(a, tl.trans(wt), input_precision="ieee")
        else:
            part = tl.dot(a.to(CDT), tl.trans(wt))
        acc += part * tl.reshape(scale, (1, BN))
    else:
        wt = tl.reshape(w * scale[:, :, None], (BN, BK)).to(CDT)
        if CDT == tl.float32:
            acc = tl.dot(a, tl.trans(wt), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(CDT), tl.trans(wt), acc)
    return acc


@triton.jit
def _gemm(a_ptr, aq_ptr, as_ptr, a_rows, a_valid, wa_ptr, sa_ptr, wb_ptr, sb_ptr, rows, rmask,
          K: tl.constexpr, N: tl.constexpr, FMT: tl.constexpr, BM: tl.constexpr,
          BN: tl.constexpr, BK: tl.constexpr, CDT: tl.constexpr, TWO: tl.constexpr, QDOT: tl.constexpr,
          PIPE: tl.constexpr, MXB: tl.constexpr = False):
    """``A[a_rows] @ Wa[rows]^T`` (and ``@ Wb[rows]^T`` with ``TWO``, sharing the A tiles) over all
    of ``K``: fp32 ``[BM, BN]`` each. ``A`` is the matmul input (``x̂``) ``[*, K]``. With ``QDOT``
    (act-quant, ``BM >= 16``) it is the e4m3 values ``q`` and their per-128 scales instead, and the
    product is DeepSeek's ``sum_kb (q . w) * s_x * s_w`` (DSV4_FACTS 2b) on tensor cores: FP8
    experts e4m3 x e4m3 per 128 block; FP4 experts fp16 per 32 / 16 group (``q`` and
    ``e2m1 * 2^-14`` are exact in fp16), the group scales on the fp32 partial sums."""
    if BM == 1:
        G: tl.constexpr = 1 if FMT < 2 else (BK // 32 if FMT == 2 else BK // 16)
        acc_a = tl.zeros((BN, G), tl.float32)
        acc_b = tl.zeros((BN, G), tl.float32)
    else:
        acc_a = tl.zeros((BM, BN), tl.float32)
        acc_b = tl.zeros((BM, BN), tl.float32)
    if QDOT:
        NKB: tl.constexpr = (K + 127) // 128
        for kb in range(0, K, 128):
            sx = tl.load(as_ptr + a_rows * NKB + kb // 128, mask=a_valid, other=0.0)[:, None]
            if FMT < 2:
                # (q as e4m3; a shared FP8 expert beside FP4 ones gets them as fp16: exact either way)
                a = _load_rows(aq_ptr, a_rows, a_valid, kb, K, 128, K % 128 == 0).to(tl.float8e4nv)
                wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, kb, K, N, FMT, BN, 128, True)
                acc_a += tl.dot(a, tl.trans(tl.reshape(wa, (BN, 128)))) * sx * tl.reshape(sa, (1, BN))
                if TWO:
                    wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, kb, K, N, FMT, BN, 128,
                                          True)
                    acc_b += tl.dot(a, tl.trans(tl.reshape(wb, (BN, 128)))) * sx \
                        * tl.reshape(sb, (1, BN))
            elif FMT == 3:
                # NVFP4: e2m1 * block_scale is exact in fp16 (<= 2688, >= 2^-10, <= 6 bits), so the
                # weights are scaled in registers and one fp16 dot covers the 128 block
                a = _load_rows(aq_ptr, a_rows, a_valid, kb, K, 128, K % 128 == 0).to(tl.float16)
                wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, kb, K, N, FMT, BN, 128, True)
                wa = tl.reshape((wa * 16384.0) * sa[:, :, None], (BN, 128))
                acc_a += tl.dot(a, tl.trans(wa)) * sx
                if TWO:
                    wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, kb, K, N, FMT, BN, 128,
                                          True)
                    wb = tl.reshape((wb * 16384.0) * sb[:, :, None], (BN, 128))
                    acc_b += tl.dot(a, tl.trans(wb)) * sx
            else:
                # MXFP4: fp16 dot per 32-group on the exact e2m1 * 2^-14, the scale on the partials
                GS: tl.constexpr = 32
                blk_a = tl.zeros((BM, BN), tl.float32)
                blk_b = tl.zeros((BM, BN), tl.float32)
                for g in tl.static_range(128 // GS):
                    a = _load_rows(aq_ptr, a_rows, a_valid, kb + g * GS, K, GS, K % 128 == 0).to(tl.float16)
                    wa, sa = _fp4_group16(wa_ptr, sa_ptr, rows, rmask, kb + g * GS, K, N, FMT, BN)
                    blk_a += tl.dot(a, tl.trans(wa)) * sa[None, :]
                    if TWO:
                        wb, sb = _fp4_group16(wb_ptr, sb_ptr, rows, rmask, kb + g * GS, K, N, FMT, BN)
                        blk_b += tl.dot(a, tl.trans(wb)) * sb[None, :]
                acc_a += blk_a * sx
                if TWO:
                    acc_b += blk_b * sx
    elif BM == 1:
        # The CUDA-core GEMV, on an input already rounded (moe_decode.run: rounding it here, every
        # program again, cost a fifth of the layer's time at one token). The next step's
        # activation tile is loaded a step ahead (from L2) and both weights' bytes are in flight
        # together before either is decoded, so a K step waits on memory once, not three times.
        a_next = _load_rows(a_ptr, a_rows, a_valid, 0, K, BK, K % BK == 0)
        for k0 in range(0, K, BK):
            a = a_next
            a_next = _load_rows(a_ptr, a_rows, a_valid & (k0 + BK < K), k0 + BK, K, BK, K % BK == 0)
            ra, qa = _weight_raw(wa_ptr, sa_ptr, rows, rmask, k0, K, N, FMT, BN, BK)
            if TWO:
                rb, qb = _weight_raw(wb_ptr, sb_ptr, rows, rmask, k0, K, N, FMT, BN, BK)
            wa, sa = _weight_decode(ra, qa, FMT, BN, BK, False)
            acc_a = _accumulate(acc_a, a, wa, sa, FMT, BM, BN, BK, CDT)
            if TWO:
                wb, sb = _weight_decode(rb, qb, FMT, BN, BK, False)
                acc_b = _accumulate(acc_b, a, wb, sb, FMT, BM, BN, BK, CDT)
    else:
        for k0 in tl.range(0, K, BK, num_stages=PIPE):
            a = _load_rows(a_ptr, a_rows, a_valid, k0, K, BK, K % BK == 0)
            if MXB:   # MXFP4 tiles (BM > 1, bf16) dequantized in bf16 (_mx_bf16_tile)
                ab = a.to(tl.bfloat16)
                acc_a = tl.dot(ab, tl.trans(_mx_bf16_tile(wa_ptr, sa_ptr, rows, rmask, k0, K, N, BN, BK)), acc_a)
                if TWO:
                    acc_b = tl.dot(ab, tl.trans(_mx_bf16_tile(wb_ptr, sb_ptr, rows, rmask, k0, K, N, BN, BK)),
                                   acc_b)
            else:
                wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, k0, K, N, FMT, BN, BK, False)
                acc_a = _accumulate(acc_a, a, wa, sa, FMT, BM, BN, BK, CDT)
                if TWO:
                    wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, k0, K, N, FMT, BN, BK,
                                          False)
                    acc_b = _accumulate(acc_b, a, wb, sb, FMT, BM, BN, BK, CDT)
    if BM == 1:
        out_a = tl.reshape(tl.sum(acc_a, axis=1), (1, BN))
        out_b = tl.reshape(tl.sum(acc_b, axis=1), (1, BN))
    else:
        out_a = acc_a
        out_b = acc_b
    return out_a, out_b


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    """``silu(min(g, L)) * clamp(u, -L, L)`` in fp32 (no clamp without a limit)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _swiglu_epilogue(g, u, rw, limit, HAS_LIMIT: tl.constexpr):
    """:func:`_swiglu` times the routing weights ``rw [rows]``."""
    return _swiglu(g, u, limit, HAS_LIMIT) * rw[:, None]


@triton.jit
def _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
              e, rows, valid, pid_n, limit, D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr,
              FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              HAS_LIMIT: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr, QDOT: tl.constexpr,
              PIPE: tl.constexpr, WEIGHTED: tl.constexpr = True, MXB: tl.constexpr = False):
    """The gate/up half of expert ``e`` for the pairs ``rows`` (``valid`` masks the padding), output
    columns ``pid_n * BN ...``: W1 and W3 in one pass, the NVFP4 global scales, the clamped SwiGLU
    times the routing weight (``WEIGHTED``; the shared expert has none), stored to ``h``. Shared by
    the decode and the grouped (prefill) kernel."""
    tok = rows // KTOP
    n_offs = pid_n * BN + tl.arange(0, BN)
    nmask = n_offs < I
    p1, q1 = _expert_ptrs(w1_ptr, s1_ptr, e, I, D, FMT)
    p3, q3 = _expert_ptrs(w3_ptr, s3_ptr, e, I, D, FMT)
    g, u = _gemm(x_ptr, xq_ptr, xs_ptr, tok, valid, p1, q1, p3, q3, n_offs, nmask, D, I, FMT,
                 BM, BN, BK, CDT, True, QDOT, PIPE, MXB)
    if FMT == 3:
        g = g * tl.load(g1_ptr + e)
        u = u * tl.load(g3_ptr + e)
    if WEIGHTED:
        rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
    else:
        rw = tl.full((BM,), 1.0, tl.float32)
    h = _swiglu_epilogue(g, u, rw, limit, HAS_LIMIT)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n_offs[None, :], h.to(XDT),
             mask=valid[:, None] & nmask[None, :])


# ----------------------------------------------------------------------------- host side
def quantized(v: torch.Tensor, act_quant: bool, pow2: bool, with_q: bool, q_dtype: torch.dtype,
              ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v̂, q, scales)``: the matmul input (``act_quant_sim(v)`` or ``v``) and, with ``with_q``,
    its e4m3 values (as ``q_dtype``) and per-128 fp32 scales (else placeholders). With ``ids`` the
    first ``ids.numel()`` rows are pairs and rows of empty slots are left alone."""
    if not act_quant:
        return v, v, v
    R, K = v.shape
    out = runtime.empty((R, K), v.dtype, v.device)
    q = runtime.empty((R, K) if with_q else (1,), q_dtype, v.device)
    s = runtime.empty((R, triton.cdiv(K, 128)) if with_q else (1,), torch.float32, v.device)
    _quant_kernel[(R, triton.cdiv(K, 128 * QUANT_BLOCKS))](
        v, out, q, s, v if ids is None else ids, R, 0 if ids is None else ids.numel(), K=K, NB=QUANT_BLOCKS,
        POW2=bool(pow2), XDT=runtime.tl_dtype(v.dtype), WRITE_Q=with_q, SKIP_EMPTY=ids is not None, num_warps=4)
    return out, q, s
