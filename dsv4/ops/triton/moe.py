"""Fused routed-expert MoE (``dsv4.ops.moe``) over stacked MXFP4 / NVFP4 / FP8-block experts.

Computes what :func:`dsv4.ops.reference.moe` computes (DSV4_FACTS sections 2 "MoE" and 2b):
for every (token t, slot j) pair with expert ``e = topk_ids[t, j] >= 0``

    g = x̂ W1[e]^T,  u = x̂ W3[e]^T                        fp32 accumulation
    h = (silu(min(g, L)) * clamp(u, -L, L) * topk_weights[t, j]).to(x.dtype)
    y = ĥ W2[e]^T                                          fp32
    out[t] = sum_j y  (j = 0 .. k-1, in that order), cast to x.dtype

where ``x̂``/``ĥ`` are the inputs, or with ``act_quant`` their e4m3 rounding per 1x128 block
(``numerics.fp8_quantize(v, 128, pow2)``, dequantized and cast to ``x.dtype`` like the
reference). Weights are dequantized in registers: e2m1 codes are decoded exactly (the three
magnitude bits placed in an fp16 exponent/mantissa give ``e2m1 * 2^-14``, subnormals included),
MXFP4 scales ``2^(s-127)`` and NVFP4 e4m3 block scales are applied per 32 / 16 values, the
NVFP4 global scale and nothing else is applied after the product. FP8-block scales (fp32 or e8m0)
apply per 128x128 block. Every value fed to a product is exactly the reference's (MXFP4 and the
act-quant inputs exactly; NVFP4's ``e2m1 * block_scale`` exactly, its global scale on the fp32
result rather than rounded into bf16 weights), so results differ from the reference only by fp32
summation order (and that one bf16 rounding for NVFP4 and fp32-scaled FP8 weights).

Ids of ``-1`` (expert parallel: a rank holding experts ``[r E/N, (r+1) E/N)`` gets local ids and
``-1`` for the other ranks' picks) are skipped everywhere and contribute nothing; a token with none
gets a zero row. Ids must lie in ``[-1, E)`` (not checked: that would read them on the host).

Refused with :class:`MoeKernelError` (a :class:`dsv4.ops.KernelUnsupported`: the dispatch runs the
reference), before anything is allocated or launched: weights other than stacked MXFP4 / NVFP4 /
FP8-block (block 128) or of mixed formats / FP8 scale kinds, shapes not ``[E, I, D]`` / ``[E, D, I]``,
FP4 ``D`` or ``I`` not a multiple of 8, non-contiguous ``x`` / ids / weights / scales, ``x`` not a 2-D
bf16/fp16/fp32 tensor, ids not int32/int64 ``[T, k]``, routing weights not fp32 ``[T, k]``, tensors on
different devices, ``T * k * max(D, I) >= 2^31``.

Decode (``T * k <= DECODE_MAX_PAIRS``), three launches at most, no host read, fixed shapes
(CUDA-graph capturable):

1. ``_w13_decode_kernel``, grid ``(T*k slots, I / BN)``. Each slot ``j`` owns a *chunk*: when pair
   ``j`` is the first of its expert, or the ``BM``-th, ``2BM``-th ... pair of that expert (pairs
   in index order), the program takes the next ``BM`` pairs of that expert; otherwise it exits.
   The chunk is found in registers from the ``T*k`` ids (compare, cumsum), so each expert's
   bytes are read once for up to ``BM`` tokens without any sort or extra launch. The program
   streams ``BN`` rows of W1 and W3 over all of ``D`` and writes ``h`` (SwiGLU + clamp + routing
   weight epilogue) for its pairs. ``BM = 1`` (batch 1): a CUDA-core GEMV whose group scales
   multiply per-group partial sums. ``BM = 16``: ``tl.dot`` on the dequantized tile.
   It also zeroes the combine counters of step 2 (saves a memset launch).
2. ``_w2_decode_kernel``, grid ``(T*k slots, D / BN)``: the same chunks over W2 with ``ĥ`` as
   input (quantized per 128 in the prologue of each K block), fp32 rows per pair; then the
   combine: each program bumps a per-(token, N tile) counter (``atomic_add``, acq_rel) and the
   program that completes a token sums that token's ``k`` rows in slot order and writes the
   output. The sum order is fixed, so results are deterministic whatever the scheduling.
   ``FUSED_COMBINE = False`` uses a separate ``_combine_kernel`` launch instead.

No split-K: at batch 1, ``BN`` = 16 / 32 rows already gives 6 x (I/16) and 6 x (D/32) programs
(768-1344 for Flash/Pro), several per SM.

Prefill: pairs are sorted by expert on the device (``argsort``, ``index_add_`` counts, tiles of
``BM`` rows per expert with a host-known upper bound on the tile count, so still no host read);
``_w13_grouped_kernel`` / ``_w2_grouped_kernel`` run one ``(tile, N tile)`` per program with
``tl.dot``: FP8-block experts with ``act_quant`` on FP8 tensor cores (e4m3 x e4m3 per 128 block,
fp32 promotion with both scales, DeepSeek's W8A8); FP4 experts on BF16 tensor cores with exactly
dequantized operands (per-32 / per-16 weight scales would otherwise need a promotion per 32
values); then ``_combine_kernel``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ...weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from .. import KernelUnsupported
from .small_util import fp8_scale, pow2_inv, round_e4m3

#: pairs (tokens x top-k) up to which the decode kernels run; above, the grouped GEMM
DECODE_MAX_PAIRS = 256
#: decode: sum the k expert rows of a token in the w2 kernel (last program per token and N tile)
FUSED_COMBINE = True

FMT_MXFP4, FMT_NVFP4, FMT_FP8 = 0, 1, 2
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


class MoeKernelError(KernelUnsupported):
    """The inputs do not fit the Triton MoE kernel (the message names the argument); raised before
    any launch, so the dispatch runs the reference for that call."""


@triton.jit(do_not_specialize=["R"])
def _quant_kernel(src_ptr, dst_ptr, q_ptr, s_ptr, ids_ptr, R, K: tl.constexpr, NB: tl.constexpr,
                  POW2: tl.constexpr, XDT: tl.constexpr, WRITE_Q: tl.constexpr,
                  SKIP_EMPTY: tl.constexpr):
    """DeepSeek's ``act_quant`` of ``NB`` 128-blocks of one row of ``src [R, K]``
    (``numerics.fp8_quantize(v, 128, pow2)``): ``amax = max(|v|, 1e-4)``, ``scale = amax / 448``
    (IEEE division; rounded up to a power of two from the float's bits with ``POW2``),
    ``q = e4m3(clamp(v / scale))``. Writes ``dst = (q * scale).to(XDT)`` (the reference's
    ``act_quant_sim``) and, with ``WRITE_Q``, ``q`` (e4m3 or fp16, exact either way) and the fp32
    scales. ``SKIP_EMPTY``: rows are pairs, those whose id is ``-1`` (never computed) are skipped."""
    r = tl.program_id(0)
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    kk = blk[:, None] * 128 + tl.arange(0, 128)[None, :]
    bm = blk < (K + 127) // 128
    if SKIP_EMPTY:
        bm = bm & (tl.load(ids_ptr + r) >= 0)
    m = (kk < K) & bm[:, None]
    v = tl.load(src_ptr + r.to(tl.int64) * K + kk, mask=m, other=0.0).to(tl.float32)
    s = fp8_scale(tl.max(tl.abs(v), axis=1), POW2)
    if POW2:
        y = v * pow2_inv(s)[:, None]   # v / s, exact
    else:
        y = tl.math.div_rn(v, tl.broadcast_to(s[:, None], v.shape))
    q = round_e4m3(tl.minimum(tl.maximum(y, -448.0), 448.0))
    tl.store(dst_ptr + r.to(tl.int64) * K + kk, (q * s[:, None]).to(XDT), mask=m)
    if WRITE_Q:
        tl.store(q_ptr + r.to(tl.int64) * K + kk, q.to(q_ptr.dtype.element_ty), mask=m)
        NKB: tl.constexpr = (K + 127) // 128
        tl.store(s_ptr + r.to(tl.int64) * NKB + blk, s, mask=bm)


@triton.jit
def _e2m1x8(w, F32: tl.constexpr):
    """Eight e2m1 codes per int32 word (code ``j`` in bits ``4j .. 4j+3``) -> ``[..., 2, 2, 2]``
    (code ``j = 4*i2 + 2*i1 + i0`` at ``[..., i2, i1, i0]``) holding ``e2m1 * 2^-14`` exactly, as
    fp16 (fp32 with ``F32``). Each pair of codes ``(j, j+4)`` becomes one fp16x2 word by masks and
    shifts: sign to bit 15, the three magnitude bits to fp16 bits 9..11, so the e2m1 subnormal
    (0.5) is the fp16 subnormal ``2^-15``."""
    p0 = ((w & 0x00070007) << 9) | ((w & 0x00080008) << 12)
    p1 = ((w & 0x00700070) << 5) | ((w & 0x00800080) << 8)
    p2 = ((w & 0x07000700) << 1) | ((w & 0x08000800) << 4)
    p3 = ((w & 0x70007000) >> 3) | (w & -2147450880)            # -2147450880 = 0x80008000
    l0 = p0.to(tl.int16).to(tl.float16, bitcast=True)
    l1 = p1.to(tl.int16).to(tl.float16, bitcast=True)
    l2 = p2.to(tl.int16).to(tl.float16, bitcast=True)
    l3 = p3.to(tl.int16).to(tl.float16, bitcast=True)
    h0 = (p0 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h1 = (p1 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h2 = (p2 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    h3 = (p3 >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    if F32:
        l0, l1, l2, l3 = l0.to(tl.float32), l1.to(tl.float32), l2.to(tl.float32), l3.to(tl.float32)
        h0, h1, h2, h3 = h0.to(tl.float32), h1.to(tl.float32), h2.to(tl.float32), h3.to(tl.float32)
    return tl.join(tl.join(tl.join(l0, h0), tl.join(l2, h2)), tl.join(tl.join(l1, h1), tl.join(l3, h3)))


@triton.jit
def _fp4_group16(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr,
                 FMT: tl.constexpr, BN: tl.constexpr):
    """One scale group (``GS`` = 32 MXFP4 / 16 NVFP4 columns from ``k0``) of rows ``rows [BN]`` of
    an FP4 expert: ``(e2m1 * 2^-14 as fp16 [BN, GS], scale * 2^14 fp32 [BN])``."""
    GS: tl.constexpr = 32 if FMT == 0 else 16
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
    w = tl.reshape(_e2m1x8(words, False), (BN, GS))
    if FMT == 0:
        scale = ((sv.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
    else:
        scale = sv.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    return w, scale


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, rmask, k0, K: tl.constexpr, N: tl.constexpr,
                 FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, S_E8M0: tl.constexpr,
                 RAW: tl.constexpr):
    """Rows ``rows [BN]`` x columns ``[k0, k0 + BK)`` of one expert's weight, dequantized but for
    a per-group factor: returns ``(w [BN, G, GS], scale [BN, G] fp32)``, the weight being
    ``w * scale`` (``G * GS = BK``; zeros past ``K`` or ``N``). ``w_ptr`` / ``s_ptr`` point at the
    expert's data (FP4: int32 words of 8 codes; FP8: bytes) and scales.

    FP4 (``GS`` = 32 MXFP4, 16 NVFP4): ``w = e2m1 * 2^-14`` (fp32), ``scale = 2^(s-127) * 2^14``
    or ``block_scale * 2^14``; with ``RAW`` (NVFP4) ``w`` in fp16 and the block scale as fp16. FP8:
    ``G = 1``, ``w`` the e4m3 values (fp32, or float8e4nv with ``RAW``), ``scale`` the 128x128
    block's scale.
    """
    GS: tl.constexpr = BK if FMT == 2 else (32 if FMT == 0 else 16)
    G: tl.constexpr = BK // GS
    EVEN: tl.constexpr = (K % BK == 0) and (N % BN == 0)
    g = tl.arange(0, G)
    if FMT == 2:
        kk = tl.arange(0, BK)
        ptrs = w_ptr + rows[:, None, None] * K + (k0 + kk)[None, None, :]
        if EVEN:
            b = tl.load(ptrs)
        else:
            b = tl.load(ptrs, mask=rmask[:, None, None] & ((k0 + kk) < K)[None, None, :], other=0)
        w = b.to(tl.float8e4nv, bitcast=True)
        if not RAW:
            w = w.to(tl.float32)
        sp = s_ptr + (rows // 128) * ((K + 127) // 128) + k0 // 128
        if S_E8M0:
            se = tl.load(sp, mask=rmask, other=127).to(tl.int32)
            sc = tl.where(se == 0, 0x00400000, se << 23).to(tl.float32, bitcast=True)
        else:
            sc = tl.load(sp, mask=rmask, other=1.0)
        scale = tl.reshape(sc, (BN, 1))
    else:
        W: tl.constexpr = GS // 8
        ww = tl.arange(0, W)
        col = k0 // 8 + g[None, :, None] * W + ww[None, None, :]
        ptrs = w_ptr + rows[:, None, None] * (K // 8) + col
        if EVEN:
            words = tl.load(ptrs)
        else:
            words = tl.load(ptrs, mask=rmask[:, None, None] & (col < K // 8), other=0)
        w = tl.reshape(_e2m1x8(words, not RAW), (BN, G, GS))
        NG: tl.constexpr = (K + GS - 1) // GS
        sp = s_ptr + rows[:, None] * NG + (k0 // GS + g)[None, :]
        if EVEN:
            sv = tl.load(sp)
        else:
            sv = tl.load(sp, mask=rmask[:, None] & ((k0 // GS + g) < NG)[None, :], other=0)
        if FMT == 0:
            scale = ((sv.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
        elif RAW:
            scale = sv.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            scale = sv.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 16384.0
    return w, scale


@triton.jit
def _expert_ptrs(w_ptr, s_ptr, e, N: tl.constexpr, K: tl.constexpr, FMT: tl.constexpr):
    """Data and scale pointers of expert ``e`` of a stacked weight (64-bit offsets)."""
    e64 = e.to(tl.int64)
    if FMT == 2:
        return w_ptr + e64 * (N * K), s_ptr + e64 * (((N + 127) // 128) * ((K + 127) // 128))
    elif FMT == 0:
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
    G: tl.constexpr = 1 if FMT == 2 else (BK // 32 if FMT == 0 else BK // 16)
    if BM == 1:
        part = tl.sum(w * tl.reshape(a.to(tl.float32), (1, G, BK // G)), axis=2)
        acc += part * scale
    elif FMT == 2:
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
          BN: tl.constexpr, BK: tl.constexpr, CDT: tl.constexpr, S_E8M0: tl.constexpr,
          TWO: tl.constexpr, QDOT: tl.constexpr, PIPE: tl.constexpr):
    """``A[a_rows] @ Wa[rows]^T`` (and ``@ Wb[rows]^T`` with ``TWO``, sharing the A tiles) over all
    of ``K``: fp32 ``[BM, BN]`` each. ``A`` is the matmul input (``x̂``) ``[*, K]``. With ``QDOT``
    (act-quant, ``BM >= 16``) it is the e4m3 values ``q`` and their per-128 scales instead, and the
    product is DeepSeek's ``sum_kb (q . w) * s_x * s_w`` (DSV4_FACTS 2b) on tensor cores: FP8
    experts e4m3 x e4m3 per 128 block; FP4 experts fp16 per 32 / 16 group (``q`` and
    ``e2m1 * 2^-14`` are exact in fp16), the group scales on the fp32 partial sums."""
    if BM == 1:
        G: tl.constexpr = 1 if FMT == 2 else (BK // 32 if FMT == 0 else BK // 16)
        acc_a = tl.zeros((BN, G), tl.float32)
        acc_b = tl.zeros((BN, G), tl.float32)
    else:
        acc_a = tl.zeros((BM, BN), tl.float32)
        acc_b = tl.zeros((BM, BN), tl.float32)
    if QDOT:
        NKB: tl.constexpr = (K + 127) // 128
        for kb in range(0, K, 128):
            sx = tl.load(as_ptr + a_rows * NKB + kb // 128, mask=a_valid, other=0.0)[:, None]
            if FMT == 2:
                a = _load_rows(aq_ptr, a_rows, a_valid, kb, K, 128, K % 128 == 0)
                wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, kb, K, N, FMT, BN, 128, S_E8M0, True)
                acc_a += tl.dot(a, tl.trans(tl.reshape(wa, (BN, 128)))) * sx * tl.reshape(sa, (1, BN))
                if TWO:
                    wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, kb, K, N, FMT, BN, 128, S_E8M0,
                                          True)
                    acc_b += tl.dot(a, tl.trans(tl.reshape(wb, (BN, 128)))) * sx \
                        * tl.reshape(sb, (1, BN))
            elif FMT == 1:
                # NVFP4: e2m1 * block_scale is exact in fp16 (<= 2688, >= 2^-10, <= 6 bits), so the
                # weights are scaled in registers and one fp16 dot covers the 128 block
                a = _load_rows(aq_ptr, a_rows, a_valid, kb, K, 128, K % 128 == 0)
                wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, kb, K, N, FMT, BN, 128, S_E8M0, True)
                wa = tl.reshape((wa * 16384.0) * sa[:, :, None], (BN, 128))
                acc_a += tl.dot(a, tl.trans(wa)) * sx
                if TWO:
                    wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, kb, K, N, FMT, BN, 128, S_E8M0,
                                          True)
                    wb = tl.reshape((wb * 16384.0) * sb[:, :, None], (BN, 128))
                    acc_b += tl.dot(a, tl.trans(wb)) * sx
            else:
                # MXFP4: fp16 dot per 32-group on the exact e2m1 * 2^-14, the scale on the partials
                GS: tl.constexpr = 32
                blk_a = tl.zeros((BM, BN), tl.float32)
                blk_b = tl.zeros((BM, BN), tl.float32)
                for g in tl.static_range(128 // GS):
                    a = _load_rows(aq_ptr, a_rows, a_valid, kb + g * GS, K, GS, K % 128 == 0)
                    wa, sa = _fp4_group16(wa_ptr, sa_ptr, rows, rmask, kb + g * GS, K, N, FMT, BN)
                    blk_a += tl.dot(a, tl.trans(wa)) * sa[None, :]
                    if TWO:
                        wb, sb = _fp4_group16(wb_ptr, sb_ptr, rows, rmask, kb + g * GS, K, N, FMT, BN)
                        blk_b += tl.dot(a, tl.trans(wb)) * sb[None, :]
                acc_a += blk_a * sx
                if TWO:
                    acc_b += blk_b * sx
    else:
        for k0 in tl.range(0, K, BK, num_stages=PIPE):
            a = _load_rows(a_ptr, a_rows, a_valid, k0, K, BK, K % BK == 0)
            wa, sa = _weight_tile(wa_ptr, sa_ptr, rows, rmask, k0, K, N, FMT, BN, BK, S_E8M0, False)
            acc_a = _accumulate(acc_a, a, wa, sa, FMT, BM, BN, BK, CDT)
            if TWO:
                wb, sb = _weight_tile(wb_ptr, sb_ptr, rows, rmask, k0, K, N, FMT, BN, BK, S_E8M0,
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


@triton.jit
def _swiglu_epilogue(g, u, rw, limit, HAS_LIMIT: tl.constexpr):
    """``silu(min(g, L)) * clamp(u, -L, L) * rw`` in fp32 (no clamp without a limit)."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u * rw[:, None]


@triton.jit
def _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
              e, rows, valid, pid_n, limit, D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr,
              FMT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              HAS_LIMIT: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr, S_E8M0: tl.constexpr,
              QDOT: tl.constexpr, PIPE: tl.constexpr):
    """The gate/up half of expert ``e`` for the pairs ``rows`` (``valid`` masks the padding), output
    columns ``pid_n * BN ...``: W1 and W3 in one pass, the NVFP4 global scales, the clamped SwiGLU
    times the routing weight, stored to ``h``. Shared by the decode and the grouped (prefill) kernel."""
    tok = rows // KTOP
    n_offs = pid_n * BN + tl.arange(0, BN)
    nmask = n_offs < I
    p1, q1 = _expert_ptrs(w1_ptr, s1_ptr, e, I, D, FMT)
    p3, q3 = _expert_ptrs(w3_ptr, s3_ptr, e, I, D, FMT)
    g, u = _gemm(x_ptr, xq_ptr, xs_ptr, tok, valid, p1, q1, p3, q3, n_offs, nmask, D, I, FMT,
                 BM, BN, BK, CDT, S_E8M0, True, QDOT, PIPE)
    if FMT == 1:
        g = g * tl.load(g1_ptr + e)
        u = u * tl.load(g3_ptr + e)
    rw = tl.load(rw_ptr + rows, mask=valid, other=0.0)
    h = _swiglu_epilogue(g, u, rw, limit, HAS_LIMIT)
    tl.store(h_ptr + rows[:, None].to(tl.int64) * I + n_offs[None, :], h.to(XDT),
             mask=valid[:, None] & nmask[None, :])


# ----------------------------------------------------------------------------- decode kernels
@triton.jit(do_not_specialize=["ncnt", "P"])
def _w13_decode_kernel(x_ptr, xq_ptr, xs_ptr, ids_ptr, rw_ptr, h_ptr, cnt_ptr, ncnt,
                       w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, P, E, limit,
                       D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                       ZB: tl.constexpr, HAS_LIMIT: tl.constexpr, XDT: tl.constexpr,
                       CDT: tl.constexpr, S_E8M0: tl.constexpr, QDOT: tl.constexpr, 
                       PIPE: tl.constexpr = 1):
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    if ZB > 0:   # zero the w2 kernel's combine counters (ZB per program)
        z = (slot * tl.num_programs(1) + pid_n) * ZB + tl.arange(0, ZB)
        tl.store(cnt_ptr + z, tl.zeros((ZB,), tl.int32), mask=z < ncnt)
    e = tl.load(ids_ptr + slot).to(tl.int32)
    rows, valid, active = _chunk(ids_ptr, slot, e, P, BM, PP)
    if active & (e < E):
        _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
                  e, rows, valid, pid_n, limit, D, I, KTOP, FMT, BM, BN, BK, HAS_LIMIT, XDT, CDT, S_E8M0,
                  QDOT, PIPE)


@triton.jit(do_not_specialize=["P"])
def _w2_decode_kernel(h_ptr, hq_ptr, hs_ptr, ids_ptr, y_ptr, out_ptr, cnt_ptr,
                      w2_ptr, s2_ptr, g2_ptr, P, E,
                      D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, FMT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PP: tl.constexpr,
                      KP2: tl.constexpr, FUSED: tl.constexpr, XDT: tl.constexpr,
                      CDT: tl.constexpr, S_E8M0: tl.constexpr, QDOT: tl.constexpr, 
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
                           FMT, BM, BN, BK, CDT, S_E8M0, False, QDOT, PIPE)
        if FMT == 1:
            y = y * tl.load(g2_ptr + e)
        tl.store(y_ptr + rows[:, None] * D + n_offs[None, :], y,
                 mask=valid[:, None] & nmask[None, :])
        if FUSED:
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
    if FUSED:
        # a token none of whose slots holds an expert still gets its zero row (by its slot 0)
        if (slot % KTOP) == 0:
            t = slot // KTOP
            jj = tl.arange(0, KP2)
            tid = tl.load(ids_ptr + t * KTOP + jj, mask=jj < KTOP, other=-1)
            if tl.max(tid, axis=0) < 0:
                tl.store(out_ptr + t * D + n_offs, tl.zeros((BN,), XDT), mask=nmask)


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


# ----------------------------------------------------------------------------- prefill kernels
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
                        S_E8M0: tl.constexpr, QDOT: tl.constexpr, 
                       PIPE: tl.constexpr = 1):
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM)
    if e >= 0:
        _w13_rows(x_ptr, xq_ptr, xs_ptr, rw_ptr, h_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr,
                  e, rows, valid, tl.program_id(1), limit, D, I, KTOP, FMT, BM, BN, BK, HAS_LIMIT, XDT, CDT, S_E8M0,
                  QDOT, PIPE)


@triton.jit
def _w2_grouped_kernel(h_ptr, hq_ptr, hs_ptr, order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr,
                       y_ptr, w2_ptr, s2_ptr, g2_ptr,
                       D: tl.constexpr, I: tl.constexpr, FMT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, XDT: tl.constexpr, CDT: tl.constexpr,
                       S_E8M0: tl.constexpr, QDOT: tl.constexpr, 
                       PIPE: tl.constexpr = 1):
    e, rows, valid = _tile_rows(order_ptr, tile_e_ptr, tile_r0_ptr, tile_r1_ptr, BM)
    if e >= 0:
        n_offs = tl.program_id(1) * BN + tl.arange(0, BN)
        nmask = n_offs < D
        p2, q2 = _expert_ptrs(w2_ptr, s2_ptr, e, D, I, FMT)
        y, _unused = _gemm(h_ptr, hq_ptr, hs_ptr, rows, valid, p2, q2, p2, q2, n_offs, nmask, I, D,
                           FMT, BM, BN, BK, CDT, S_E8M0, False, QDOT, PIPE)
        if FMT == 1:
            y = y * tl.load(g2_ptr + e)
        tl.store(y_ptr + rows[:, None].to(tl.int64) * D + n_offs[None, :], y,
                 mask=valid[:, None] & nmask[None, :])


# ----------------------------------------------------------------------------- host side
#: tile configs per path and projection: (BN, BK, num_warps, num_stages, K-loop pipelining of the
#: CUDA-core GEMV: 1 = plain loop); FP8 experts use BK 128
CONFIGS = {
    "gemv": dict(w13=(16, 256, 4, 3, 1), w2=(32, 256, 4, 3, 1)),     # decode, BM = 1 (one token)
    "dot": dict(w13=(32, 128, 4, 3, 1), w2=(64, 128, 4, 3, 1)),      # decode, BM = 16
    "grouped": dict(w13=(64, 128, 8, 3, 1), w2=(128, 128, 8, 3, 1)),  # prefill, BM = 64 (16 < 2048 pairs)
}
_COMBINE_BN = 512
_QUANT_BLOCKS = 4


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every buffer the wrapper allocates (tests poison them)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fmt_of(w: object) -> int:
    if isinstance(w, Mxfp4Weight):
        return FMT_MXFP4
    if isinstance(w, Nvfp4Weight):
        return FMT_NVFP4
    if isinstance(w, Fp8BlockWeight):
        return FMT_FP8
    raise MoeKernelError(f"moe: no Triton kernel for weights of type {type(w).__name__}")


def _weight_tensors(w: object, fmt: int, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(data, scales, global scales or None) of a stacked weight as the kernels read them: FP8
    bytes, FP4 codes as int32 words (8 codes each), scales as stored."""
    if fmt == FMT_FP8:
        if w.block != 128:
            raise MoeKernelError(f"moe: {name} has FP8 block {w.block}; the kernel needs 128")
        data, scale, gscale = w.weight.view(torch.uint8), w.scale, None
    else:
        data = w.packed
        scale, gscale = (w.scale, None) if fmt == FMT_MXFP4 else (w.block_scale.view(torch.uint8), w.global_scale)
        if gscale is not None and (gscale.dtype != torch.float32 or not gscale.is_contiguous()):
            raise MoeKernelError(f"moe: {name} global scale must be contiguous fp32 [E]")
    for t, what in ((data, "data"), (scale, "scales")):
        if not t.is_contiguous():
            raise MoeKernelError(f"moe: {name} {what} must be contiguous")
    if fmt != FMT_FP8:
        data = data.view(torch.int32)
    return data, scale, gscale


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object,
           w3: object, w2: object) -> tuple[int, int, int, int, int, int]:
    """Validate the inputs; returns ``(T, D, I, E, k, fmt)``."""
    if x.dim() != 2 or x.dtype not in _TL_DTYPE or not x.is_contiguous():
        raise MoeKernelError(f"moe: x must be a contiguous [T, D] bf16/fp16/fp32 tensor, got "
                             f"{x.dtype} {tuple(x.shape)} contiguous={x.is_contiguous()}")
    T, D = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_ids.dtype not in (torch.int64, torch.int32) \
            or not topk_ids.is_contiguous():
        raise MoeKernelError(f"moe: topk_ids must be a contiguous int64 [T={T}, k] tensor, got "
                             f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32 \
            or not topk_weights.is_contiguous():
        raise MoeKernelError(f"moe: topk_weights must be a contiguous fp32 {tuple(topk_ids.shape)} "
                             f"tensor, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    fmt = _fmt_of(w1)
    if type(w3) is not type(w1) or type(w2) is not type(w1):
        raise MoeKernelError(f"moe: w1, w3, w2 must share one format, got {type(w1).__name__}, "
                             f"{type(w3).__name__}, {type(w2).__name__}")
    if not (w1.is_stacked and w3.is_stacked and w2.is_stacked):
        raise MoeKernelError("moe: w1, w3, w2 must be stacked [E, N, K] weights")
    E, I, Dw = w1.shape
    if w3.shape != (E, I, D) or Dw != D or w2.shape != (E, D, I):
        raise MoeKernelError(f"moe: expert shapes w1 {w1.shape}, w3 {w3.shape}, w2 {w2.shape} do not "
                             f"match [E, I, D] / [E, D, I] with D = {D} (x)")
    if fmt == FMT_FP8 and not (w1.scale.dtype == w3.scale.dtype == w2.scale.dtype):
        raise MoeKernelError("moe: w1, w3, w2 FP8 scales differ in dtype (fp32 vs e8m0)")
    if fmt != FMT_FP8 and (D % 8 or I % 8):
        raise MoeKernelError(f"moe: FP4 experts need D and I divisible by 8 (int32 words of codes), "
                             f"got D={D}, I={I}")
    for t, what in ((topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
        if t.device != x.device:
            raise MoeKernelError(f"moe: {what} on {t.device}, x on {x.device}")
    for w, name in ((w1, "w1"), (w3, "w3"), (w2, "w2")):
        if w.device != x.device:
            raise MoeKernelError(f"moe: expert weights {name} on {w.device}, x on {x.device}")
    if T * k * max(D, I) >= 2 ** 31:
        raise MoeKernelError(f"moe: T*k*max(D, I) = {T * k * max(D, I)} overflows 32-bit offsets")
    return T, D, I, E, k, fmt


def _quantized(v: torch.Tensor, act_quant: bool, pow2: bool, with_q: bool, q_dtype: torch.dtype,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v̂, q, scales)``: the matmul input (``act_quant_sim(v)`` or ``v``) and, with ``with_q``,
    its e4m3 values (as ``q_dtype``) and per-128 fp32 scales (else placeholders). With ``ids`` the
    rows are pairs and rows of empty slots are left alone."""
    if not act_quant:
        return v, v, v
    R, K = v.shape
    out = _empty((R, K), v.dtype, v.device)
    q = _empty((R, K) if with_q else (1,), q_dtype, v.device)
    s = _empty((R, triton.cdiv(K, 128)) if with_q else (1,), torch.float32, v.device)
    _quant_kernel[(R, triton.cdiv(K, 128 * _QUANT_BLOCKS))](
        v, out, q, s, v if ids is None else ids, R, K=K, NB=_QUANT_BLOCKS, POW2=bool(pow2),
        XDT=_TL_DTYPE[v.dtype], WRITE_Q=with_q, SKIP_EMPTY=ids is not None, num_warps=4)
    return out, q, s


def moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w1: object,
               w3: object, w2: object, limit: float, act_quant: bool = False,
               pow2: bool = True) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.moe` for MXFP4 / NVFP4 / FP8-block experts."""
    T, D, I, E, k, fmt = _check(x, topk_ids, topk_weights, w1, w3, w2)
    d1, s1, g1 = _weight_tensors(w1, fmt, "w1")     # may refuse: before anything is allocated
    d3, s3, g3 = _weight_tensors(w3, fmt, "w3")
    d2, s2, g2 = _weight_tensors(w2, fmt, "w2")
    out = _empty((T, D), x.dtype, x.device)
    if T == 0 or k == 0:
        return out.zero_()
    g1, g3, g2 = (g if g is not None else topk_weights for g in (g1, g3, g2))   # unused placeholders
    P = T * k
    decode = P <= DECODE_MAX_PAIRS
    BM = (1 if T == 1 else 16) if decode else (64 if P >= 2048 else 16)
    qdot = bool(act_quant) and BM > 1
    q_dtype = torch.float8_e4m3fn if fmt == FMT_FP8 else torch.float16
    cfg = CONFIGS["gemv" if BM == 1 else "dot"] if decode else CONFIGS["grouped"]
    (bn1, bk1, nw1, ns1, pp1), (bn2, bk2, nw2, ns2, pp2) = cfg["w13"], cfg["w2"]
    if fmt == FMT_FP8:
        bk1 = bk2 = 128
    nt1, nt2 = triton.cdiv(I, bn1), triton.cdiv(D, bn2)
    common = dict(FMT=fmt, BM=BM, XDT=_TL_DTYPE[x.dtype], CDT=_TL_DTYPE[x.dtype],
                  S_E8M0=bool(fmt == FMT_FP8 and s1.dtype == torch.uint8), QDOT=qdot)
    lim = float(limit)
    h = _empty((P, I), x.dtype, x.device)
    y = _empty((P, D), torch.float32, x.device)
    xh, xq, xs = _quantized(x, act_quant, pow2, qdot, q_dtype)
    if decode:
        fused = FUSED_COMBINE
        ncnt = T * nt2 if fused else 0
        cnt = _empty((max(ncnt, 1),), torch.int32, x.device)
        zb = triton.next_power_of_2(triton.cdiv(ncnt, P * nt1)) if fused else 0
        pp = max(triton.next_power_of_2(P), 2)
        _w13_decode_kernel[(P, nt1)](
            xh, xq, xs, topk_ids, topk_weights, h, cnt, ncnt, d1, s1, g1, d3, s3, g3, P, E, lim,
            D=D, I=I, KTOP=k, BN=bn1, BK=bk1, PP=pp, ZB=zb, HAS_LIMIT=lim > 0,
            PIPE=pp1, num_warps=nw1, num_stages=ns1, **common)
        hh, hq, hs = _quantized(h, act_quant, pow2, qdot, q_dtype, topk_ids)
        _w2_decode_kernel[(P, nt2)](
            hh, hq, hs, topk_ids, y, out, cnt, d2, s2, g2, P, E,
            D=D, I=I, KTOP=k, BN=bn2, BK=bk2, PP=pp, KP2=max(triton.next_power_of_2(k), 2),
            FUSED=fused, PIPE=pp2, num_warps=nw2, num_stages=ns2, **common)
        if fused:
            return out
    else:
        order, tile_e, tile_r0, tile_r1 = _expert_tiles(topk_ids.view(-1), E, BM)
        ntiles = tile_e.numel()
        _w13_grouped_kernel[(ntiles, nt1)](
            xh, xq, xs, order, tile_e, tile_r0, tile_r1, topk_weights, h, d1, s1, g1, d3, s3, g3,
            lim, D=D, I=I, KTOP=k, BN=bn1, BK=bk1, HAS_LIMIT=lim > 0, PIPE=pp1, num_warps=nw1,
            num_stages=ns1, **common)
        hh, hq, hs = _quantized(h, act_quant, pow2, qdot, q_dtype, topk_ids)
        _w2_grouped_kernel[(ntiles, nt2)](
            hh, hq, hs, order, tile_e, tile_r0, tile_r1, y, d2, s2, g2, D=D, I=I, BN=bn2, BK=bk2,
            PIPE=pp2, num_warps=nw2, num_stages=ns2, **common)
    _combine_kernel[(T, triton.cdiv(D, _COMBINE_BN))](
        y, topk_ids, out, D=D, KTOP=k, BN=_COMBINE_BN, XDT=common["XDT"], num_warps=4)
    return out


def _expert_tiles(ids: torch.Tensor, E: int, BM: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert and tiles of at most ``BM`` of them, all on the device.

    Returns ``order [P]`` (pair indices: ``-1`` ids first, then expert 0, 1, ...) and per tile its
    expert (``-1`` for the unused tail) and first / end position in ``order``. The tile count is
    the host-known bound ``ceil(P / BM) + min(E, P)``, so nothing is read back.
    """
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
    return order, torch.where(te < E, tc, -1), r0, r1


REGISTRATIONS = [("moe", Mxfp4Weight, moe_triton), ("moe", Nvfp4Weight, moe_triton),
                 ("moe", Fp8BlockWeight, moe_triton)]
