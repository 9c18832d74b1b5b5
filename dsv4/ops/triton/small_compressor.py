"""A KV compressor's decode step in one launch (``compressor_step``, spec in
``dsv4.ops.reference_fused``): the batched compressor path takes ~60-120 small ops per call.
``compressor_step_pair``: a CSA layer's KV compressor and its indexer's in the same launch.

Grid: one program per row (slot) and compressor; a row with ``S`` new tokens (a verify step, a
short prompt chunk) steps them in order, a barrier between. Per token, with ``r = pos % m``:

- ``r < m - 1``: the token's ``C`` row and ``Z + ape[r]`` row go into the open window (row ``r``).
- ``r = m - 1`` (the window closes, a device-side branch): the entry is pooled per channel over
  the window's slots (CSA: the previous window's ``a`` halves, then this window's ``b`` halves with
  row ``r`` taken from the new token) in three passes over ``MC``-row chunks (max, denominator,
  weighted sum, as ``softmax(Z) * C`` summed), RMS-normed, rotated (RoPE on its last ``rd`` dims;
  the indexer's Hadamard), encoded in the entry store's layout and written at index ``pos // m``;
  then (CSA) this window's ``a`` halves become the previous window's, and the window rows are
  cleared. Barriers separate the reads of state rows from the writes that replace them.

Channels are held as even/odd halves (``[DP2]`` pairs), the layout RoPE pairs, FP4 packs and
the Hadamard splits into four ``+-1`` blocks need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .small_quant import _sign_pm1
from .numerics import e2m1_code, e4m3_bits, fp4_scale, fp8_scale, pow2_to_e8m0, quantize_e4m3
from .small_util import check, check_float, pow2, row_stride, rows


@triton.jit
def _chunk(v0, NPREV, M, slot, r, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr, W, DIM, COL0,
           kn_e, kn_o, gn_e, gn_o, p, pm, MC: tl.constexpr):
    """Pooling slots ``v0 .. v0 + MC - 1`` as even/odd channel tiles ``[MC, DP2]`` (kv, gate)."""
    i = tl.arange(0, MC)
    if v0 < NPREV:                      # the previous window's a halves
        rows = v0 + i
        off = (slot * M + rows)[:, None] * DIM + 2 * p[None, :]
        kvb = prev_kv_ptr
        gb = prev_g_ptr
        new = i < 0
    else:                               # this window (b halves with overlap), row r = the new token
        rows = v0 - NPREV + i
        off = (slot * M + rows)[:, None] * W + COL0 + 2 * p[None, :]
        kvb = win_kv_ptr
        gb = win_g_ptr
        new = rows == r
    m = (rows < M)[:, None] & pm[None, :]
    new = new[:, None]
    ke = tl.where(new, kn_e[None, :], tl.load(kvb + off, mask=m, other=0.0))
    ko = tl.where(new, kn_o[None, :], tl.load(kvb + off + 1, mask=m, other=0.0))
    ge = tl.where(new, gn_e[None, :], tl.load(gb + off, mask=m, other=-float("inf")))
    go = tl.where(new, gn_o[None, :], tl.load(gb + off + 1, mask=m, other=-float("inf")))
    return ke, ko, ge, go


@triton.jit
def _block_scale_pairs(ae, ao, valid, DP2: tl.constexpr, QP: tl.constexpr):
    """Per-block amax of pairs (``QP`` pairs a block) -> ``[DP2 // QP]`` and its index vector."""
    a = tl.where(valid, tl.maximum(tl.abs(ae), tl.abs(ao)), 0.0)
    return tl.max(tl.reshape(a, [DP2 // QP, QP]), axis=1)


@triton.jit
def _per_pair(s, DP2: tl.constexpr, QP: tl.constexpr):
    """A per-block value ``[DP2 // QP]`` repeated for each pair of its block ``[DP2]``."""
    return tl.reshape(tl.broadcast_to(s[:, None], [DP2 // QP, QP]), [DP2])


@triton.jit
def _zero(ptr, n, BLK: tl.constexpr):
    i0 = 0
    while i0 < n:
        o = i0 + tl.arange(0, BLK)
        tl.store(ptr + o, tl.zeros([BLK], tl.float32), mask=o < n)
        i0 += BLK


# S: tokens a row (a decode, a verify step, a short chunk); pos_ptr: a varlen forward hands each
# group its slice of the step's positions, 16-byte aligned or not by where the group starts
@triton.jit(do_not_specialize=["S"], do_not_specialize_on_alignment=["pos_ptr"])
def _compressor_step_kernel(kv_ptr, skv, g_ptr, sg, ape_ptr, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr,
                            w_ptr, eps, data_ptr, scale_ptr, rope_ptr, rows_per_slot, NSCALE, M, W, DIM, Df, NOPE,
                            hscale, log_kv_ptr, log_g_ptr, LOG_ROWS,
                            kv2_ptr, skv2, g2_ptr, sg2, ape2_ptr, win_kv2_ptr, win_g2_ptr, prev_kv2_ptr, prev_g2_ptr,
                            w2_ptr, eps2, data2_ptr, scale2_ptr, rope2_ptr, rows_per_slot2, NSCALE2, M2, W2, DIM2,
                            Df2, NOPE2, hscale2, log_kv2_ptr, log_g2_ptr, LOG_ROWS2,
                            slot_ptr, pos_ptr, spos, S, cos_ptr, sin_ptr, RD2, visible_ptr,
                            OVERLAP: tl.constexpr, ROTATE: tl.constexpr, LAYOUT: tl.constexpr, POW2: tl.constexpr,
                            MC: tl.constexpr, DP2: tl.constexpr, QP: tl.constexpr, BLK: tl.constexpr,
                            LOG: tl.constexpr,
                            OVERLAP2: tl.constexpr, ROTATE2: tl.constexpr, LAYOUT2: tl.constexpr, POW22: tl.constexpr,
                            MC2: tl.constexpr, DP22: tl.constexpr, QP2: tl.constexpr, BLK2: tl.constexpr,
                            LOG2: tl.constexpr):
    """Program ``(b, j)``: decode row ``b`` through compressor ``j``. Grid ``(B, 1)``: one
    compressor; ``(B, 2)``: a CSA layer's KV compressor and its indexer's (the same tokens at the
    same positions, one launch), the second's arguments after the first's. Program ``(b, 0)`` also
    writes the entries row ``b``'s queries see after each token, ``(pos + 1) // m`` (what the indexer
    and HCA attention mask by: no separate launch for it).

    The row's ``S`` tokens (flattened token rows ``b * S .. b * S + S - 1``) are stepped in order,
    a barrier after each: a token's pooling reads the window rows the one before it wrote (the
    verify step's 1 + k tokens, a short chunk: one launch for what the batched path does in ~60)."""
    b = tl.program_id(0)
    i = 0
    while i < S:
        t = b * S + i
        pos = tl.load(pos_ptr + t * spos).to(tl.int64)
        if tl.program_id(1) == 0:
            tl.store(visible_ptr + t, (pos + 1) // M)
            _step(t, i, pos, kv_ptr, skv, g_ptr, sg, ape_ptr, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr,
                  slot_ptr + b, w_ptr, eps, cos_ptr, sin_ptr, data_ptr, scale_ptr, rope_ptr,
                  rows_per_slot, NSCALE, M, W, DIM, Df, NOPE, RD2, hscale, log_kv_ptr, log_g_ptr, LOG_ROWS,
                  OVERLAP, ROTATE, LAYOUT, POW2, MC, DP2, QP, BLK, LOG)
        else:
            _step(t, i, pos, kv2_ptr, skv2, g2_ptr, sg2, ape2_ptr, win_kv2_ptr, win_g2_ptr, prev_kv2_ptr,
                  prev_g2_ptr, slot_ptr + b, w2_ptr, eps2, cos_ptr, sin_ptr, data2_ptr, scale2_ptr, rope2_ptr,
                  rows_per_slot2, NSCALE2, M2, W2, DIM2, Df2, NOPE2, RD2, hscale2, log_kv2_ptr, log_g2_ptr, LOG_ROWS2,
                  OVERLAP2, ROTATE2, LAYOUT2, POW22, MC2, DP22, QP2, BLK2, LOG2)
        tl.debug_barrier()
        i += 1


@triton.jit
def _step(b, i, pos, kv_ptr, skv, g_ptr, sg, ape_ptr, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr,
          slot_ptr, w_ptr, eps, cos_ptr, sin_ptr, data_ptr, scale_ptr, rope_ptr,
          rows_per_slot, NSCALE, M, W, DIM, Df, NOPE, RD2, hscale, log_kv_ptr, log_g_ptr, LOG_ROWS,
          OVERLAP: tl.constexpr, ROTATE: tl.constexpr, LAYOUT: tl.constexpr, POW2: tl.constexpr,
          MC: tl.constexpr, DP2: tl.constexpr, QP: tl.constexpr, BLK: tl.constexpr, LOG: tl.constexpr):
    """Token row ``b`` (its row's ``i``-th token, at ``pos``) through one compressor (the module
    docstring); ``LOG``: its ``C`` and ``Z + ape`` rows also into the log's row ``i`` (verify)."""
    slot = tl.load(slot_ptr).to(tl.int64)
    r = pos % M
    krow = kv_ptr + b.to(tl.int64) * skv
    grow = g_ptr + b.to(tl.int64) * sg
    arow = ape_ptr + r * W
    if LOG:
        lrow = (slot * LOG_ROWS + i) * W
        i0 = 0
        while i0 < W:
            o = i0 + tl.arange(0, BLK)
            om = o < W
            tl.store(log_kv_ptr + lrow + o, tl.load(krow + o, mask=om), mask=om)
            tl.store(log_g_ptr + lrow + o, tl.load(grow + o, mask=om) + tl.load(arow + o, mask=om), mask=om)
            i0 += BLK
    if r == M - 1:
        HALF = DIM // 2
        p = tl.arange(0, DP2)
        pm = p < HALF
        COL0 = 0
        NPREV = 0
        if OVERLAP:
            COL0 = DIM
            NPREV = M
        c0 = COL0 + 2 * p
        kn_e = tl.load(krow + c0, mask=pm, other=0.0)
        kn_o = tl.load(krow + c0 + 1, mask=pm, other=0.0)
        gn_e = tl.load(grow + c0, mask=pm, other=-float("inf")) + tl.load(arow + c0, mask=pm, other=0.0)
        gn_o = tl.load(grow + c0 + 1, mask=pm, other=-float("inf")) + tl.load(arow + c0 + 1, mask=pm, other=0.0)
        NV = NPREV + M
        # softmax over the slots per channel, then the weighted sum (three passes over the chunks)
        mx_e = tl.full([DP2], -float("inf"), tl.float32)
        mx_o = tl.full([DP2], -float("inf"), tl.float32)
        v0 = 0
        while v0 < NV:
            ke, ko, ge, go = _chunk(v0, NPREV, M, slot, r, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr, W, DIM,
                                    COL0, kn_e, kn_o, gn_e, gn_o, p, pm, MC)
            mx_e = tl.maximum(mx_e, tl.max(ge, axis=0))
            mx_o = tl.maximum(mx_o, tl.max(go, axis=0))
            v0 += MC
        mx_e = tl.where(pm, mx_e, 0.0)
        mx_o = tl.where(pm, mx_o, 0.0)
        den_e = tl.zeros([DP2], tl.float32)
        den_o = tl.zeros([DP2], tl.float32)
        v0 = 0
        while v0 < NV:
            ke, ko, ge, go = _chunk(v0, NPREV, M, slot, r, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr, W, DIM,
                                    COL0, kn_e, kn_o, gn_e, gn_o, p, pm, MC)
            den_e += tl.sum(tl.exp(ge - mx_e[None, :]), axis=0)
            den_o += tl.sum(tl.exp(go - mx_o[None, :]), axis=0)
            v0 += MC
        den_e = tl.where(pm, den_e, 1.0)
        den_o = tl.where(pm, den_o, 1.0)
        ent_e = tl.zeros([DP2], tl.float32)
        ent_o = tl.zeros([DP2], tl.float32)
        v0 = 0
        while v0 < NV:
            ke, ko, ge, go = _chunk(v0, NPREV, M, slot, r, win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr, W, DIM,
                                    COL0, kn_e, kn_o, gn_e, gn_o, p, pm, MC)
            ent_e += tl.sum(tl.div_rn(tl.exp(ge - mx_e[None, :]), den_e[None, :]) * ke, axis=0)
            ent_o += tl.sum(tl.div_rn(tl.exp(go - mx_o[None, :]), den_o[None, :]) * ko, axis=0)
            v0 += MC
        # RMSNorm (fp32 in and out), RoPE on the last rd dims, the Hadamard rotation
        ss = tl.sum(ent_e * ent_e, axis=0) + tl.sum(ent_o * ent_o, axis=0)
        inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, Df) + eps))
        ent_e = tl.load(w_ptr + 2 * p, mask=pm, other=0.0) * (ent_e * inv)
        ent_o = tl.load(w_ptr + 2 * p + 1, mask=pm, other=0.0) * (ent_o * inv)
        pr = p - (HALF - RD2)
        rot = pm & (pr >= 0)
        c = tl.load(cos_ptr + b * RD2 + pr, mask=rot, other=1.0)
        s = tl.load(sin_ptr + b * RD2 + pr, mask=rot, other=0.0)
        re = ent_e * c - ent_o * s
        ro = ent_e * s + ent_o * c
        ent_e = tl.where(rot, re, ent_e)
        ent_o = tl.where(rot, ro, ent_o)
        if ROTATE:
            pi = p[:, None]
            pj = p[None, :]
            ye = tl.sum(ent_e[:, None] * _sign_pm1(2 * pi, 2 * pj), axis=0) + \
                tl.sum(ent_o[:, None] * _sign_pm1(2 * pi + 1, 2 * pj), axis=0)
            yo = tl.sum(ent_e[:, None] * _sign_pm1(2 * pi, 2 * pj + 1), axis=0) + \
                tl.sum(ent_o[:, None] * _sign_pm1(2 * pi + 1, 2 * pj + 1), axis=0)
            ent_e = ye * hscale
            ent_o = yo * hscale
        # the entry, encoded as the store keeps it, at index pos // m
        tgt = slot * rows_per_slot + pos // M
        bq = tl.arange(0, DP2 // QP)
        if LAYOUT == 0:
            DT = data_ptr.dtype.element_ty
            tl.store(data_ptr + tgt * DIM + 2 * p, ent_e.to(DT), mask=pm)
            tl.store(data_ptr + tgt * DIM + 2 * p + 1, ent_o.to(DT), mask=pm)
        elif LAYOUT == 1:
            nope = p < NOPE // 2
            sb = fp8_scale(_block_scale_pairs(ent_e, ent_o, nope, DP2, QP), POW2)
            sp = _per_pair(sb, DP2, QP)
            qe = quantize_e4m3(tl.div_rn(ent_e, sp))
            qo = quantize_e4m3(tl.div_rn(ent_o, sp))
            tl.store(data_ptr + tgt * NOPE + 2 * p, e4m3_bits(qe).to(tl.uint8), mask=nope)
            tl.store(data_ptr + tgt * NOPE + 2 * p + 1, e4m3_bits(qo).to(tl.uint8), mask=nope)
            if POW2:
                tl.store(scale_ptr + tgt * NSCALE + bq, pow2_to_e8m0(sb).to(tl.uint8),
                         mask=bq < NSCALE)
            else:
                tl.store(scale_ptr + tgt * NSCALE + bq, sb, mask=bq < NSCALE)
            RT = rope_ptr.dtype.element_ty
            rp = 2 * (p - NOPE // 2)
            rm = pm & (p >= NOPE // 2)
            tl.store(rope_ptr + tgt * (DIM - NOPE) + rp, ent_e.to(RT), mask=rm)
            tl.store(rope_ptr + tgt * (DIM - NOPE) + rp + 1, ent_o.to(RT), mask=rm)
        else:
            sb = fp4_scale(_block_scale_pairs(ent_e, ent_o, pm, DP2, QP))
            sp = _per_pair(sb, DP2, QP)
            code = e2m1_code(tl.div_rn(ent_e, sp)) | (e2m1_code(tl.div_rn(ent_o, sp)) << 4)
            tl.store(data_ptr + tgt * HALF + p, code.to(tl.uint8), mask=pm)
            tl.store(scale_ptr + tgt * NSCALE + bq, pow2_to_e8m0(sb).to(tl.uint8),
                     mask=bq < NSCALE)
        # state: (overlap) this window's a halves become the previous window's; the window is cleared
        tl.debug_barrier()
        if OVERLAP:
            ka_e = tl.load(krow + 2 * p, mask=pm, other=0.0)
            ka_o = tl.load(krow + 2 * p + 1, mask=pm, other=0.0)
            ga_e = tl.load(grow + 2 * p, mask=pm, other=0.0) + tl.load(arow + 2 * p, mask=pm, other=0.0)
            ga_o = tl.load(grow + 2 * p + 1, mask=pm, other=0.0) + tl.load(arow + 2 * p + 1, mask=pm, other=0.0)
            i0 = 0
            while i0 < M:
                rows = i0 + tl.arange(0, MC)
                m2 = (rows < M)[:, None] & pm[None, :]
                new = (rows == r)[:, None]
                src = (slot * M + rows)[:, None] * W + 2 * p[None, :]
                dst = (slot * M + rows)[:, None] * DIM + 2 * p[None, :]
                tl.store(prev_kv_ptr + dst, tl.where(new, ka_e[None, :], tl.load(win_kv_ptr + src, mask=m2)), mask=m2)
                tl.store(prev_kv_ptr + dst + 1, tl.where(new, ka_o[None, :], tl.load(win_kv_ptr + src + 1, mask=m2)),
                         mask=m2)
                tl.store(prev_g_ptr + dst, tl.where(new, ga_e[None, :], tl.load(win_g_ptr + src, mask=m2)), mask=m2)
                tl.store(prev_g_ptr + dst + 1, tl.where(new, ga_o[None, :], tl.load(win_g_ptr + src + 1, mask=m2)),
                         mask=m2)
                i0 += MC
            tl.debug_barrier()
        _zero(win_kv_ptr + slot * M * W, M * W, BLK)
        _zero(win_g_ptr + slot * M * W, M * W, BLK)
    else:
        dst = (slot * M + r) * W
        i0 = 0
        while i0 < W:
            o = i0 + tl.arange(0, BLK)
            om = o < W
            tl.store(win_kv_ptr + dst + o, tl.load(krow + o, mask=om), mask=om)
            tl.store(win_g_ptr + dst + o, tl.load(grow + o, mask=om) + tl.load(arow + o, mask=om), mask=om)
            i0 += BLK


def compressor_step_triton(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object,
                           slots: torch.Tensor, positions: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           cos: torch.Tensor, sin: torch.Tensor, rotate: bool) -> torch.Tensor:
    args, consts = _plan("compressor_step", kv, gate, ape, state, slots, positions, norm_weight, eps, cos, rotate)
    return _launch("compressor_step", 1, args, consts, args, consts, slots, positions, cos, sin)


def compressor_step_pair_triton(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object,
                                norm_weight: torch.Tensor, eps: float, rotate: bool, kv2: torch.Tensor,
                                gate2: torch.Tensor, ape2: torch.Tensor, state2: object, norm_weight2: torch.Tensor,
                                eps2: float, rotate2: bool, slots: torch.Tensor, positions: torch.Tensor,
                                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Two compressors' decode steps (a CSA layer's and its indexer's) in one launch; see
    :func:`dsv4.ops.reference_fused.compressor_step_pair`."""
    op = "compressor_step_pair"
    check(state.ratio == state2.ratio, op, f"ratios {state.ratio} and {state2.ratio}: the window RoPE is shared")
    a = _plan(op, kv, gate, ape, state, slots, positions, norm_weight, eps, cos, rotate)
    b = _plan(op, kv2, gate2, ape2, state2, slots, positions, norm_weight2, eps2, cos, rotate2)
    return _launch(op, 2, *a, *b, slots, positions, cos, sin)


def _launch(op: str, n: int, args: tuple, consts: dict, args2: tuple, consts2: dict, slots: torch.Tensor,
            positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The step of ``n`` compressors (1 or 2; with 1 the second argument set is the first's, unread)
    over ``S = positions.numel() // B`` tokens a row. Returns the visible entry counts ``(positions +
    1) // m``, shaped like ``positions``."""
    B, rd2 = slots.shape[0], cos.shape[-1]
    S = _tokens_per_row(op, positions, B)
    check(not positions.is_floating_point(), op, f"positions are {positions.dtype}; need integers")
    check(sin.shape == cos.shape, op, f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} differ")
    check_float(op, sin=sin)
    visible = runtime.empty(tuple(positions.shape), positions.dtype, positions.device)
    if B == 0:
        return visible
    pos2 = positions.reshape(B * S)
    cos2, sin2 = cos.reshape(B * S, rd2).float().contiguous(), sin.reshape(B * S, rd2).float().contiguous()
    _compressor_step_kernel[(B, n)](
        *args, *args2, slots.reshape(B).contiguous(), pos2, pos2.stride(0) if B * S > 1 else 1, S, cos2, sin2, rd2,
        visible, **consts, **{k + "2": v for k, v in consts2.items()}, num_warps=8, enable_fp_fusion=False)
    return visible


def _tokens_per_row(op: str, positions: torch.Tensor, B: int) -> int:
    """``S``: the tokens each of the ``B`` rows steps (``positions [B, S]``, or ``[B]`` for one)."""
    S = positions.numel() // max(B, 1)
    check(positions.numel() == B * S and (positions.dim() < 2 or positions.shape[0] == B), op,
          f"positions {tuple(positions.shape)}: need [B, S] or [B] for {B} slots")
    return S


def _plan(op: str, kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object, slots: torch.Tensor,
          positions: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, rotate: bool
          ) -> tuple[tuple, dict]:
    """Check one compressor's step inputs: ``(its kernel arguments, its constexprs)``."""
    m, B = state.ratio, slots.shape[0]
    S = _tokens_per_row(op, positions, B)
    overlap = state.prev_kv is not None
    width = state.win_kv.shape[-1]
    dim = width // 2 if overlap else width
    check(kv.dtype == torch.float32 and gate.dtype == torch.float32, op,
          f"kv {kv.dtype} / gate {gate.dtype}: the compressor's C and Z are fp32")
    check(kv.numel() == B * S * width and gate.numel() == B * S * width, op,
          f"kv {tuple(kv.shape)} / gate {tuple(gate.shape)}: need {S} rows of {width} per slot ({B} slots)")
    check(tuple(ape.shape) == (m, width) and ape.dtype == torch.float32, op, f"ape {tuple(ape.shape)} {ape.dtype}")
    check(tuple(norm_weight.shape) == (dim,), op, f"norm weight {tuple(norm_weight.shape)}; needs ({dim},)")
    check_float(op, cos=cos)
    rd2 = cos.shape[-1]
    check(cos.numel() == B * S * rd2 and 0 < 2 * rd2 <= dim and dim % 2 == 0, op,
          f"cos {tuple(cos.shape)}: need [B, S, rd/2] with rd <= {dim}")
    # a multi-token step logs its rows for the rollback, as Compressor.forward does
    log = S > 1 and state.log_kv is not None and S <= state.log_kv.shape[1]
    for name in ("win_kv", "win_gate", "prev_kv", "prev_gate", "log_kv", "log_gate"):
        t = getattr(state, name)
        check(t is None or (t.dtype == torch.float32 and t.is_contiguous()), op, f"state.{name} must be "
              "contiguous fp32")
    if rotate:
        check(dim & (dim - 1) == 0 and dim <= 256, op, f"Hadamard over {dim} dims: powers of two up to 256")
    store = state.entries
    layout = {"plain": 0, "fp8": 1, "fp4": 2}.get(store.layout)
    check(layout is not None and store.dim == dim, op, f"entry store {store.layout!r} of width {store.dim}")
    for t in store.tensors():
        check(t.is_contiguous(), op, "entry store tensors must be contiguous")
    nope, qp = dim, 16
    data, scale, rope, nscale = store.data, store.data, store.data, 1
    if layout == 1:
        nope, qp = store.data.shape[-1], 32
        check(dim - nope == 2 * rd2 and nope % 2 == 0, op,
              f"the store keeps {dim - nope} rope dims; cos gives {2 * rd2}")
        check(store.scale.dtype == (torch.uint8 if store.pow2 else torch.float32), op,
              f"fp8 store with pow2={store.pow2} has {store.scale.dtype} scales")
        data, scale, rope, nscale = store.data.view(torch.uint8), store.scale, store.rope, store.scale.shape[-1]
    elif layout == 2:
        data, scale, nscale = store.data, store.scale, store.scale.shape[-1]
    kv2, g2 = rows(kv, width), rows(gate, width)
    mc = 1
    while mc < 8 and m % (2 * mc) == 0:
        mc *= 2
    dp2 = max(pow2(dim // 2), qp)
    hscale = float(torch.tensor(dim ** -0.5, dtype=torch.float32))
    prev_kv = state.prev_kv if overlap else state.win_kv
    prev_g = state.prev_gate if overlap else state.win_gate
    args = (kv2, row_stride(kv2), g2, row_stride(g2), ape.contiguous(), state.win_kv, state.win_gate, prev_kv, prev_g,
            norm_weight.float().contiguous(), float(eps), data, scale, rope, store.data.shape[1], nscale, m, width, dim,
            float(dim), nope, hscale, state.log_kv if log else state.win_kv, state.log_gate if log else state.win_gate,
            state.log_kv.shape[1] if log else 1)
    consts = dict(OVERLAP=overlap, ROTATE=bool(rotate), LAYOUT=layout, POW2=bool(store.pow2), MC=mc, DP2=dp2, QP=qp,
                  BLK=min(1024, pow2(width)), LOG=log)
    return args, consts


REGISTRATIONS = [("compressor_step", None, compressor_step_triton),
                 ("compressor_step_pair", None, compressor_step_pair_triton)]
