"""Sparse attention (sliding window + compressed entries + sink) as Triton kernels.

Computes what :func:`dsv4.ops.reference.sparse_attention` computes (DSV4_FACTS section 2,
"Attention"; storage layouts in :mod:`dsv4.model.cache`). The lightning indexer's scores and top-k
are :mod:`dsv4.ops.triton.indexer`.

**Attention.** One shared K=V head (MQA), so for one query its heads are the rows of a matrix
product against the query's keys: ``logits = Q K^T``, then ``acc += P K``. Every query
``t = start[b] + s`` has its own key list, walked in blocks of ``BN`` keys:

- the window, ``W`` virtual keys ``i -> position t - W + 1 + i``: positions ``< start`` come from
  the ring (row ``pos % W`` of the slot, read-only here), the others from this forward's
  ``kv_new[b, pos - start]``; negative positions are masked (whole such blocks skipped);
- CSA: ``comp_idx[b, s, :]`` (``-1`` masked, a duplicate counts twice); HCA: entries
  ``0 .. comp_len[b, s] - 1`` (blocks past ``comp_len`` skipped).

Stored rows are dequantized in registers exactly as ``RowStore.read`` does (``fp8``:
``e4m3 * scale``, an e8m0 byte or fp32 per 64, in fp32 rounded to the activation dtype; rope dims
as stored), so both products see the reference's operands bit for bit. Logits and the softmax are
fp32 (online, base 2); ``P`` is rounded to the activation dtype for ``P K`` (flash-attention
practice: bf16-level differences).

Tiles are chunk-major, ``[hd / 64, rows, 64]``: the products are batched over the 64-dim chunks
(one chunk per warp at hd 512 with 8 warps), the logits summed over chunks. So no warp holds all
512 dims of the queries (a ``[BH, 512]`` operand per warp needs 128 registers alone and spills);
an e8m0 scale is one load per chunk and row; at 448 + 64 the rope dims are exactly the last chunk
and are loaded once as ``[BN, 64]``. Program: ``BH = 32`` heads x ``BN = 32`` keys, 8 warps (255
registers, no spill, 96 / 148 KB of shared memory with 1 / 2 stages on sm_90; see
``bench/attention_resources.py``).

Grid ``(B*S, ceil(H / BH), SPLITS)``. A query's key blocks (``ceil(W / BN)`` window blocks, then
``ceil(NC / BN)`` compressed ones, ``NC`` = top-k or ``comp_bound``) are cut into ``SPLITS``
contiguous ranges so that decode fills the SMs (flash decoding). When the queries fill the GPU with
one split (a prefill), :func:`_attn_rows_kernel` runs instead: the same walk over plain ``[64 heads,
hd]`` x ``[BN, hd]`` tiles, so each product is one tensor-core GEMM with ``K = hd``, and the softmax
finishes in-kernel. With several splits, each program writes its unnormalized ``acc`` and
``(max, sum)``; the last program of a (query, head block) to finish (an atomic counter, re-armed by
that program, so a replayed CUDA graph finds it at zero) merges the splits with the sink, in split
order, so the result is deterministic whichever program finishes last. There is no separate
combine launch: it would run the same merge (one program per query and head block), only later.
A query that sees no key gets ``0`` (the sink takes all the weight).

Given the query positions' RoPE tables, the program that writes a query's output then applies the
inverse RoPE to it in place (read back as written: the reference's ``apply_rope`` on its output),
so the K=V un-rotation costs no launch.

Everything is sized from host-known shapes: no host read of a device value, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import KernelUnsupported
from . import runtime
from .numerics import e8m0_to_f32, neg

_LOG2E = 1.4426950408889634

LAYOUT_PLAIN, LAYOUT_FP8 = 0, 1

#: programs of a split grid at most (so the merge counters, one per query and head block, suffice)
MAX_SPLIT_PROGRAMS = 4096


class AttentionKernelError(KernelUnsupported):
    """The inputs do not fit the Triton attention / indexer kernels (the message names the argument)."""


@triton.jit
def _load_kv(data_ptr, scale_ptr, rope_ptr, row, ok, LAYOUT: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr,
             NCH: tl.constexpr, CH: tl.constexpr, ROPE_ALIGNED: tl.constexpr, NSC: tl.constexpr, E8M0: tl.constexpr,
             OUT: tl.constexpr):
    """Rows ``row [BN]`` (int64 flat ``slot * rows + r``) of a K=V store, equal to ``RowStore.read``,
    chunk-major ``[NCH, BN, CH]`` in ``OUT`` (dim ``c * CH + e``; zeros where ``~ok`` or past ``HD``).

    ``fp8``: ``e4m3 * scale`` in fp32 rounded to ``OUT`` for dims ``< NOPE`` (the scale of 64 dims
    is one load per chunk, ``CH = 64``, broadcast), the rope dims as stored."""
    c3 = tl.arange(0, NCH)[:, None, None]
    d3 = c3 * CH + tl.arange(0, CH)[None, None, :]                       # [NCH, 1, CH]
    r3 = row[None, :, None]
    ok3 = ok[None, :, None]
    if LAYOUT == 0:
        return tl.load(data_ptr + r3 * HD + d3, mask=ok3 & (d3 < HD), other=0.0).to(OUT)
    else:
        ROPE: tl.constexpr = HD - NOPE
        x = tl.load(data_ptr + r3 * NOPE + d3, mask=ok3 & (d3 < NOPE), other=0.0).to(tl.float32)
        blk = (c3 * CH) // 64
        sc = tl.load(scale_ptr + r3 * NSC + blk, mask=ok3 & (blk < NSC), other=0)     # [NCH, BN, 1]
        if E8M0:
            sf = e8m0_to_f32(sc)
        else:
            sf = sc.to(tl.float32)
        v = (x * sf).to(OUT)
        if ROPE_ALIGNED:
            # the rope dims are exactly the last chunk: load them once as [BN, CH], not as a
            # mostly-masked [NCH, BN, CH] tile
            e = tl.arange(0, CH)
            r = tl.load(rope_ptr + row[:, None] * ROPE + e[None, :], mask=ok[:, None], other=0.0).to(OUT)
            return tl.where(c3 == NCH - 1, r[None, :, :], v)
        else:
            r = tl.load(rope_ptr + r3 * ROPE + (d3 - NOPE), mask=ok3 & (d3 >= NOPE) & (d3 < HD), other=0.0)
            return tl.where(d3 < NOPE, v, r.to(OUT))


@triton.jit
def _softmax_step(q, k, ok, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """One block of keys ``k [NCH, BN, CH]`` (``ok [BN]`` the visible ones) into the online softmax
    of the query heads ``q [NCH, BH, CH]``: base-2 logits, running max ``m_i [BH]``, sum ``l_i`` and
    ``acc [NCH, BH, CH]``. Products per chunk (a batched dot: each warp owns chunks, so no warp
    holds all of ``q``), logits summed over the chunks."""
    s = tl.sum(tl.dot(q, tl.permute(k, (0, 2, 1)), input_precision=PREC), 0)          # [BH, BN]
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p3 = tl.broadcast_to(p.to(k.dtype)[None, :, :], (k.shape[0], p.shape[0], p.shape[1]))
    acc = tl.dot(p3, k, acc * alpha[None, :, None], input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _unrotate(o_ptr, h, hm, so_h, cos_ptr, sin_ptr, ROFF, RD2, BR2: tl.constexpr):
    """The inverse RoPE, in place, of the output rows just written at ``o_ptr + h * so_h`` (heads
    ``h``): dims ``ROFF + 2i, ROFF + 2i + 1`` (``i < RD2``) read back in the activation dtype as
    written and rotated by ``-angle_i`` in fp32, exactly :func:`dsv4.ops.reference.apply_rope`
    ``inverse=True`` on the reference's output. The caller puts a barrier between the writes and
    this read (other threads of the program wrote them)."""
    i = tl.arange(0, BR2)
    im = i < RD2
    m2 = hm[:, None] & im[None, :]
    pa = o_ptr + h[:, None] * so_h + ROFF + 2 * i[None, :]
    a = tl.load(pa, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(pa + 1, mask=m2, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + i, mask=im, other=0.0).to(tl.float32)[None, :]
    sn = neg(tl.load(sin_ptr + i, mask=im, other=0.0).to(tl.float32))[None, :]
    ODT: tl.constexpr = o_ptr.dtype.element_ty
    tl.store(pa, (a * c - b * sn).to(ODT), mask=m2)
    tl.store(pa + 1, (a * sn + b * c).to(ODT), mask=m2)


# ----------------------------------------------------------------------------- attention kernels
@triton.jit(do_not_specialize=["NC", "n_splits", "bps"])
def _attn_kernel(q_ptr, kvn_ptr, out_ptr, pacc_ptr, pml_ptr, cnt_ptr, sink_ptr, slots_ptr, start_ptr,
                 ring_data, ring_scale, ring_rope, comp_data, comp_scale, comp_rope, idx_ptr, len_ptr,
                 cos_ptr, sin_ptr, S, H, ring_rows, comp_rows, NC, qk_scale, n_splits, bps,
                 sq_b, sq_s, sq_h, skv_b, skv_s, so_b, so_s, so_h, sc_b, sc_s, ROFF, RD2,
                 W: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
                 ROPE_ALIGNED: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                 R_LAYOUT: tl.constexpr, R_NSC: tl.constexpr, R_E8M0: tl.constexpr,
                 HAS_COMP: tl.constexpr, DENSE: tl.constexpr, C_LAYOUT: tl.constexpr,
                 C_NSC: tl.constexpr, C_E8M0: tl.constexpr, UNROT: tl.constexpr, BR2: tl.constexpr,
                 PREC: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_sp = tl.program_id(2)
    b = pid_q // S
    s = pid_q % S
    dt = q_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    start = tl.load(start_ptr + b).to(tl.int64)
    t = start + s

    h = pid_h * BH + tl.arange(0, BH)
    hm = h < H
    d3 = tl.arange(0, NCH)[:, None, None] * CH + tl.arange(0, CH)[None, None, :]      # [NCH, 1, CH]
    dm3 = d3 < HD
    hm3 = hm[None, :, None]
    h3 = h[None, :, None]
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + s * sq_s + h3 * sq_h + d3, mask=hm3 & dm3, other=0.0)

    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([NCH, BH, CH], tl.float32)
    n_wb: tl.constexpr = (W + BN - 1) // BN
    blk_lo = pid_sp * bps
    blk_hi = blk_lo + bps

    # the window: virtual key i is position t - W + 1 + i (blocks of negative positions skipped)
    first = tl.maximum(W - 1 - t, 0) // BN
    for blk in range(tl.maximum(blk_lo, first), tl.minimum(blk_hi, n_wb)):
        i = blk * BN + tl.arange(0, BN)
        pos = t - W + 1 + i
        ok = (i < W) & (pos >= 0)
        in_ring = ok & (pos < start)
        in_new = ok & (pos >= start)
        ring_row = slot * ring_rows + tl.where(in_ring, pos % W, 0)
        k = _load_kv(ring_data, ring_scale, ring_rope, ring_row, in_ring, R_LAYOUT, HD, NOPE, NCH, CH, ROPE_ALIGNED,
                     R_NSC, R_E8M0, dt)
        new3 = in_new[None, :, None]
        new_row = b.to(tl.int64) * skv_b + tl.where(in_new, pos - start, 0) * skv_s
        x = tl.load(kvn_ptr + new_row[None, :, None] + d3, mask=new3 & dm3, other=0.0)
        k = tl.where(new3, x.to(dt), k)
        m_i, l_i, acc = _softmax_step(q, k, ok, m_i, l_i, acc, qk_scale, PREC)

    if HAS_COMP:
        c_hi = tl.minimum(blk_hi, n_wb + tl.cdiv(NC, BN))
        if DENSE:
            clen = tl.load(len_ptr + pid_q).to(tl.int32)
            c_hi = tl.minimum(c_hi, n_wb + tl.cdiv(tl.minimum(clen, NC), BN))
        for blk in range(tl.maximum(blk_lo, n_wb), c_hi):
            c = (blk - n_wb) * BN + tl.arange(0, BN)
            if DENSE:
                ok = (c < clen) & (c < NC)
                row = c.to(tl.int64)
            else:
                row = tl.load(idx_ptr + pid_q.to(tl.int64) * NC + c, mask=c < NC, other=-1).to(tl.int64)
                ok = row >= 0
            k = _load_kv(comp_data, comp_scale, comp_rope, slot * comp_rows + tl.where(ok, row, 0), ok,
                         C_LAYOUT, HD, NOPE, NCH, CH, ROPE_ALIGNED, C_NSC, C_E8M0, dt)
            m_i, l_i, acc = _softmax_step(q, k, ok, m_i, l_i, acc, qk_scale, PREC)

    part = (pid_q.to(tl.int64) * H + h) * n_splits + pid_sp                    # [BH]
    tl.store(pml_ptr + part * 2, m_i, mask=hm)
    tl.store(pml_ptr + part * 2 + 1, l_i, mask=hm)
    # a split that saw no key leaves its acc unwritten: the merge never reads it (l = 0)
    live3 = (hm & (l_i > 0))[None, :, None]
    tl.store(pacc_ptr + part[None, :, None] * HD + d3, acc, mask=live3 & dm3)
    # the last of the splits programs of this (query, head block) merges them all, in split order
    # (deterministic whichever finishes last), then re-arms the counter
    cnt = cnt_ptr + pid_q * tl.num_programs(1) + pid_h
    tl.debug_barrier()
    done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    if done == n_splits - 1:
        o = _merge_splits(pml_ptr, pacc_ptr, sink_ptr, (pid_q.to(tl.int64) * H + h) * n_splits, h, hm, d3,
                          dm3, HD, NCH, CH, BH, n_splits)
        o_row = out_ptr + b.to(tl.int64) * so_b + s * so_s
        tl.store(o_row + h3 * so_h + d3, o.to(out_ptr.dtype.element_ty), mask=hm3 & dm3)
        if UNROT:
            tl.debug_barrier()
            cs = b.to(tl.int64) * sc_b + s * sc_s
            _unrotate(o_row, h, hm, so_h, cos_ptr + cs, sin_ptr + cs, ROFF, RD2, BR2)
        tl.atomic_xchg(cnt, 0)


@triton.jit
def _load_kv_rows(data_ptr, scale_ptr, rope_ptr, row, ok, LAYOUT: tl.constexpr, HD: tl.constexpr,
                  NOPE: tl.constexpr, DP: tl.constexpr, NSC: tl.constexpr, E8M0: tl.constexpr, OUT: tl.constexpr):
    """:func:`_load_kv` as a plain ``[BN, DP]`` tile (the prefill kernel's dot operand): rows ``row``
    of a K=V store, equal to ``RowStore.read``, zeros where ``~ok`` or past ``HD``."""
    d = tl.arange(0, DP)[None, :]
    r = row[:, None]
    okm = ok[:, None]
    if LAYOUT == 0:
        return tl.load(data_ptr + r * HD + d, mask=okm & (d < HD), other=0.0).to(OUT)
    else:
        ROPE: tl.constexpr = HD - NOPE
        nm = okm & (d < NOPE)
        x = tl.load(data_ptr + r * NOPE + d, mask=nm, other=0.0).to(tl.float32)
        sc = tl.load(scale_ptr + r * NSC + d // 64, mask=nm, other=0)
        if E8M0:
            sf = e8m0_to_f32(sc)
        else:
            sf = sc.to(tl.float32)
        v = (x * sf).to(OUT)
        ro = tl.load(rope_ptr + r * ROPE + (d - NOPE), mask=okm & (d >= NOPE) & (d < HD), other=0.0)
        return tl.where(d < NOPE, v, ro.to(OUT))


@triton.jit
def _softmax_rows(q, k, ok, m_i, l_i, acc, qk_scale, PREC: tl.constexpr):
    """:func:`_softmax_step` on plain tiles: ``q [BH, DP]``, ``k [BN, DP]``, ``acc [BH, DP]``."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)                                    # [BH, BN]
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=PREC)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["S", "NROWS"])
def _rows_table_kernel(tab_ptr, kvn_ptr, slots_ptr, start_ptr, data_ptr, scale_ptr, rope_ptr, store_rows, S, NROWS,
                       skv_b, skv_s, W: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr, DP: tl.constexpr,
                       BR: tl.constexpr, LAYOUT: tl.constexpr, NSC: tl.constexpr, E8M0: tl.constexpr,
                       WINDOW: tl.constexpr):
    """Rows ``BR`` at a time of one sequence's key table for :func:`_attn_rows_kernel`, ``[NROWS, HD]``
    in the activation dtype, each row what ``RowStore.read`` gives. ``WINDOW``: row ``j`` holds
    position ``start - W + j``: the ring's row for ``j < W`` (zeros before position 0), then this
    forward's ``kv_new`` (``NROWS = W + S``). Else the compressed entries ``0 .. NROWS - 1``."""
    b = tl.program_id(0)
    j = tl.program_id(1) * BR + tl.arange(0, BR)
    dt = tab_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    d = tl.arange(0, DP)
    dm = d < HD
    rows = j < NROWS
    if WINDOW:
        pos = tl.load(start_ptr + b).to(tl.int64) - W + j
        in_ring = (j < W) & (pos >= 0)
        in_new = (j >= W) & rows
        k = _load_kv_rows(data_ptr, scale_ptr, rope_ptr, slot * store_rows + tl.where(in_ring, pos % W, 0), in_ring,
                          LAYOUT, HD, NOPE, DP, NSC, E8M0, dt)
        new_row = b.to(tl.int64) * skv_b + tl.where(in_new, j - W, 0).to(tl.int64) * skv_s
        x = tl.load(kvn_ptr + new_row[:, None] + d[None, :], mask=in_new[:, None] & dm[None, :], other=0.0)
        k = tl.where(in_new[:, None], x.to(dt), k)
    else:
        k = _load_kv_rows(data_ptr, scale_ptr, rope_ptr, slot * store_rows + tl.where(rows, j, 0), rows,
                          LAYOUT, HD, NOPE, DP, NSC, E8M0, dt)
    tl.store(tab_ptr + (b.to(tl.int64) * NROWS + j)[:, None] * HD + d[None, :], k, mask=rows[:, None] & dm[None, :])


@triton.jit(do_not_specialize=["S", "NC", "NTAB"])
def _attn_rows_kernel(q_ptr, win_ptr, ctab_ptr, out_ptr, sink_ptr, start_ptr, idx_ptr, len_ptr,
                      cos_ptr, sin_ptr, S, H, NC, NTAB, qk_scale,
                      sq_b, sq_s, sq_h, so_b, so_s, so_h, sc_b, sc_s, ROFF, RD2,
                      W: tl.constexpr, HD: tl.constexpr, DP: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                      HAS_COMP: tl.constexpr, DENSE: tl.constexpr, UNROT: tl.constexpr, BR2: tl.constexpr,
                      PREC: tl.constexpr):
    """The unsplit (prefill) attention: what :func:`_attn_kernel` computes with one split, on plain
    ``[BH heads, hd]`` x ``[BN keys, hd]`` tiles, so that each product is one tensor-core GEMM of
    ``K = hd`` (the chunk-major tiles of the decode kernel are batched ``K = 64`` products that keep
    registers low for few heads but reach ~25 TFLOP/s on a prefill).

    Keys come from the sequence's key tables (:func:`_rows_table_kernel`: stored rows already
    decoded), so each key tile is a plain gather straight into the products' shared-memory operand,
    which the compiler pipelines; decoding FP8 rows here cost registers the ``[BH, hd]`` fp32
    accumulator needs (255 registers with ~1 KB of spills a thread, sm_90)."""
    pid_q = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = pid_q // S
    s = pid_q % S
    t = tl.load(start_ptr + b).to(tl.int64) + s
    h = pid_h * BH + tl.arange(0, BH)
    hm = h < H
    d = tl.arange(0, DP)
    dm = d < HD
    q = tl.load(q_ptr + b.to(tl.int64) * sq_b + s * sq_s + h[:, None] * sq_h + d[None, :],
                mask=hm[:, None] & dm[None, :], other=0.0)
    m_i = tl.full([BH], -1.0e30, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, DP], tl.float32)
    n_wb: tl.constexpr = (W + BN - 1) // BN

    # window key i (position t - W + 1 + i) is table row s + 1 + i
    win = win_ptr + b.to(tl.int64) * (W + S) * HD + (s + 1) * HD
    first = tl.maximum(W - 1 - t, 0) // BN
    for blk in range(first, n_wb):
        i = blk * BN + tl.arange(0, BN)
        ok = (i < W) & (t - W + 1 + i >= 0)
        k = tl.load(win + i[:, None] * HD + d[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
        m_i, l_i, acc = _softmax_rows(q, k, ok, m_i, l_i, acc, qk_scale, PREC)

    if HAS_COMP:
        ctab = ctab_ptr + b.to(tl.int64) * NTAB * HD
        n_cb = tl.cdiv(NC, BN)
        if DENSE:
            clen = tl.load(len_ptr + pid_q).to(tl.int32)
            n_cb = tl.cdiv(tl.minimum(clen, NC), BN)
        for cb in range(0, n_cb):
            c = cb * BN + tl.arange(0, BN)
            if DENSE:
                ok = (c < clen) & (c < NC)
                row = c
            else:
                row = tl.load(idx_ptr + pid_q.to(tl.int64) * NC + c, mask=c < NC, other=-1).to(tl.int32)
                ok = (row >= 0) & (row < NTAB)
            k = tl.load(ctab + tl.where(ok, row, 0)[:, None] * HD + d[None, :], mask=ok[:, None] & dm[None, :],
                        other=0.0)
            m_i, l_i, acc = _softmax_rows(q, k, ok, m_i, l_i, acc, qk_scale, PREC)

    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_f)
    f = alpha / (l_i * alpha + tl.exp2(sink - m_f))
    o = acc * f[:, None]
    o_row = out_ptr + b.to(tl.int64) * so_b + s * so_s
    tl.store(o_row + h[:, None] * so_h + d[None, :], o.to(out_ptr.dtype.element_ty), mask=hm[:, None] & dm[None, :])
    if UNROT:
        tl.debug_barrier()
        cs = b.to(tl.int64) * sc_b + s * sc_s
        _unrotate(o_row, h, hm, so_h, cos_ptr + cs, sin_ptr + cs, ROFF, RD2, BR2)


#: the split merge reads this many splits' (max, sum) pairs in one load for the running max, and
#: MERGE_UNROLL splits' partials at a time: loads in flight together instead of one L2 round trip
#: a split (the merge of 20 splits was most of a batch-1 CSA attention's ~35 us). Constexpr: a
#: kernel may read no other global
MERGE_MAX_BLOCK = tl.constexpr(16)
MERGE_UNROLL = tl.constexpr(4)


@triton.jit
def _merge_splits(pml_ptr, pacc_ptr, sink_ptr, part0, h, hm, d3, dm3, HD: tl.constexpr, NCH: tl.constexpr,
                  CH: tl.constexpr, BH: tl.constexpr, n_splits):
    """Softmax-merge the ``n_splits`` partial results of heads ``h`` (partials ``part0 + j``) with the
    sink: ``[NCH, BH, CH]`` fp32, summed in split order. Reads bypass L1 (other SMs wrote them)."""
    SPB: tl.constexpr = MERGE_MAX_BLOCK
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = sink
    jb = tl.arange(0, SPB)
    j0 = n_splits * 0
    while j0 < n_splits:
        jm = (j0 + jb < n_splits)[:, None] & hm[None, :]
        m_b = tl.load(pml_ptr + (part0[None, :] + j0 + jb[:, None]) * 2, mask=jm, other=-1.0e30, cache_modifier=".cg")
        m_f = tl.maximum(m_f, tl.max(m_b, 0))
        j0 += SPB
    den = tl.exp2(sink - m_f)
    acc = tl.zeros([NCH, BH, CH], tl.float32)
    j0 = n_splits * 0
    while j0 < n_splits:
        # MERGE_UNROLL splits' loads issued before their products are summed (in split order)
        for u in tl.static_range(MERGE_UNROLL):
            j = j0 + u
            ok = hm & (j < n_splits)
            m_j = tl.load(pml_ptr + (part0 + j) * 2, mask=ok, other=-1.0e30, cache_modifier=".cg")
            l_j = tl.load(pml_ptr + (part0 + j) * 2 + 1, mask=ok, other=0.0, cache_modifier=".cg")
            w_j = tl.exp2(m_j - m_f)
            den += l_j * w_j
            live = (ok & (l_j > 0))[None, :, None]
            a = tl.load(pacc_ptr + (part0 + j)[None, :, None] * HD + d3, mask=live & dm3, other=0.0,
                        cache_modifier=".cg")
            acc += a * w_j[None, :, None]
        j0 += MERGE_UNROLL
    return acc / den[None, :, None]


# ----------------------------------------------------------------------------- attention wrapper
def _store_parts(store: object, name: str, hd: int, dtype: torch.dtype) -> tuple:
    """Validate a K=V ``RowStore`` and return ``(data, scale, rope, layout, nope, n_scales, e8m0)``."""
    layout = getattr(store, "layout", None)
    if layout not in ("plain", "fp8"):
        raise AttentionKernelError(f"{name}: layout {layout!r} not supported (plain or fp8)")
    if store.dim != hd:
        raise AttentionKernelError(f"{name}: row width {store.dim} != head dim {hd}")
    if store.dtype != dtype:
        raise AttentionKernelError(f"{name}: dtype {store.dtype} != query dtype {dtype}")
    for part in store.tensors():
        if not part.is_contiguous():
            raise AttentionKernelError(f"{name}: stored tensors must be contiguous")
        if part.dim() != 3:
            raise AttentionKernelError(f"{name}: stored tensors must be [slots, rows, ...]")
    data = store.data
    if layout == "plain":
        if data.dtype != dtype or data.shape[-1] != hd:
            raise AttentionKernelError(f"{name}: plain data must be [slots, rows, {hd}] {dtype}")
        return data, data, data, LAYOUT_PLAIN, hd, 1, True
    nope = data.shape[-1]
    n_sc = -(-nope // 64)
    if data.dtype != torch.float8_e4m3fn:
        raise AttentionKernelError(f"{name}: fp8 data must be float8_e4m3fn, got {data.dtype}")
    if store.scale is None or store.scale.shape[:2] != data.shape[:2] or store.scale.shape[-1] != n_sc:
        raise AttentionKernelError(f"{name}: fp8 scale must be [slots, rows, {n_sc}]")
    if store.scale.dtype not in (torch.uint8, torch.float32):
        raise AttentionKernelError(f"{name}: fp8 scale must be uint8 e8m0 or fp32, got {store.scale.dtype}")
    rope = store.rope
    if rope is None or rope.shape[:2] != data.shape[:2] or rope.shape[-1] != hd - nope or rope.dtype != dtype:
        raise AttentionKernelError(f"{name}: fp8 rope part must be [slots, rows, {hd - nope}] {dtype}")
    return data, store.scale, rope, LAYOUT_FP8, nope, n_sc, store.scale.dtype == torch.uint8


#: up to this many (query, 32-head block) pairs the split kernel takes 16 heads a program instead
#: of 32 (bench/attn_split_tune.py, H100, decode at 8k context): a program's key block costs ~10 us
#: of latency whatever its heads, so few queries gain from twice the programs (Flash batch 1: CSA
#: 69 -> 35 us, HCA 35 -> 22 us, sliding 30 -> 20 us; Pro batch 1 CSA 79 -> 52 us; Flash batch 8
#: HCA 37 -> 33 us, sliding 31 -> 22 us, CSA even), while from Pro's batch 8 on the larger tile wins
#: (Pro CSA 143 vs 202 us). By batch size only, not context: the warm-up compiles every variant.
HALF_HEADS_MAX_BLOCKS = 16


def _attn_config(H: int, hd: int, n_queries: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """``(BH heads, BN keys, num_warps, num_stages)`` per program of the split kernel, by shape
    and element size."""
    bh = max(16, min(32, triton.next_power_of_2(H)))
    if runtime.interpreting():
        return bh, 16, 4, 1
    if n_queries * triton.cdiv(H, 32) <= HALF_HEADS_MAX_BLOCKS:
        bh = 16
    # hd 512: 32 heads x 32 keys with 8 warps (one 64-dim chunk each) is the largest tile without
    # spills (sm_90, Triton 3.6: 255 registers, 148 KB shared memory with two stages, 96 KB with
    # one); 64 heads would need 128 KB of fp32 accumulators per program. fp32 tiles take twice the
    # shared memory: two stages at hd 512 asked for 320 KB (H100: 227 KB), so they get one
    return bh, 32, 8, 1 if itemsize * hd > 1024 else 2


def _rows_config(H: int, hd: int, itemsize: int = 2) -> tuple[int, int, int, int]:
    """``(BH heads, BN keys, num_warps, num_stages)`` of the prefill kernel :func:`_attn_rows_kernel`.

    64 heads x 64 keys, two stages (197 KB of shared memory): H200, Flash, 8192 tokens from position 0
    (``bench/attention_prefill_tune.py``, results/2026-11-28f/call2_attn_after.txt), CSA 4.11 ms
    (32 keys: 4.40; 32 keys and one stage, the kernel's tile before its key tables: 10.56), sliding
    0.80 ms, HCA 1.15 ms."""
    if runtime.interpreting():
        return max(16, min(32, triton.next_power_of_2(H))), 16, 4, 1
    if itemsize * hd > 1024:          # fp32 at hd 512: [BH, hd] fp32 queries and keys in shared memory
        return max(16, min(32, triton.next_power_of_2(H))), 16, 8, 1
    return max(16, min(64, triton.next_power_of_2(H))), 64, 8, 2


#: bytes of key tables (:func:`_rows_table`) one prefill attention call holds at a time: sequences
#: are taken in groups that fit (a long context's entries are ~256 MiB a sequence at 1M positions),
#: within the engine's working margin (``engine.limits.WORKING_MARGIN_BYTES``)
TABLE_BYTES = 256 << 20
#: rows of a key table a program of :func:`_rows_table_kernel` writes
TABLE_ROWS = 16


def _rows_table(kv_new: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, parts: tuple, n: int,
                hd: int, dp: int, *, window: bool) -> torch.Tensor:
    """The prefill kernel's key table ``[B, rows, hd]`` in ``kv_new``'s dtype (:func:`_rows_table_kernel`):
    the window (``n`` = the window, ``n + S`` rows) or ``n`` compressed entries, of each sequence."""
    B, S = kv_new.shape[:2]
    rows = n + S if window else n
    tab = runtime.empty((B, rows, hd), kv_new.dtype, kv_new.device)
    data, scale, rope, layout, nope, nsc, e8m0 = parts
    _rows_table_kernel[(B, triton.cdiv(rows, TABLE_ROWS))](
        tab, kv_new, slots, start, data, scale, rope, data.shape[1], S, rows, kv_new.stride(0), kv_new.stride(1),
        W=n if window else 1, HD=hd, NOPE=nope, DP=dp, BR=TABLE_ROWS, LAYOUT=layout, NSC=nsc, E8M0=e8m0,
        WINDOW=window, num_warps=4)
    return tab


def _check_int(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise AttentionKernelError(f"{name}: must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise AttentionKernelError(f"{name}: shape {tuple(t.shape)} != {shape}")
    if t.device != device:
        raise AttentionKernelError(f"{name}: on {t.device}, queries on {device}")


def _splits(n_blocks: int, base_programs: int, target: int) -> tuple[int, int]:
    """``(splits, blocks per split)`` so that ``base_programs * splits <= target`` (at least one
    split; the largest count that fits), no split empty."""
    splits = min(n_blocks, max(1, target // base_programs), MAX_SPLIT_PROGRAMS // max(1, base_programs))
    bps = triton.cdiv(n_blocks, max(1, splits))
    return triton.cdiv(n_blocks, bps), bps


def _counters(device: torch.device) -> torch.Tensor:
    """The merge counters of the in-kernel split merge (zero between calls; the last program re-arms)."""
    try:
        return runtime.counters(device, MAX_SPLIT_PROGRAMS, "attention")
    except runtime.CounterError as e:
        raise AttentionKernelError(str(e)) from None


def sparse_attention_triton(q: torch.Tensor, kv_new: torch.Tensor, ring: object, slots: torch.Tensor,
                            start: torch.Tensor, window: int, sink: torch.Tensor, scale: float,
                            comp: object | None = None, comp_idx: torch.Tensor | None = None,
                            comp_len: torch.Tensor | None = None, comp_bound: int = 0,
                            cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, *,
                            _target_programs: int | None = None) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.sparse_attention` (same signature and result).

    Each query's keys are split until about ``_target_programs`` programs run (default: the SM
    count; tests set it to reach one split or several at small shapes). Split results are merged
    by the last program of each query and head block."""
    if q.dim() != 4:
        raise AttentionKernelError(f"q must be [B, S, H, hd], got {tuple(q.shape)}")
    B, S, H, hd = q.shape
    dtype, dev = q.dtype, q.device
    if dtype not in runtime.FLOAT_DTYPES:
        raise AttentionKernelError(f"q: dtype {dtype} not supported (bf16, fp16, fp32)")
    if q.stride(-1) != 1 or kv_new.stride(-1) != 1:
        raise AttentionKernelError("q and kv_new need a contiguous last dim")
    if tuple(kv_new.shape) != (B, S, hd) or kv_new.dtype != dtype:
        raise AttentionKernelError(f"kv_new must be [{B}, {S}, {hd}] {dtype}, got {tuple(kv_new.shape)} {kv_new.dtype}")
    _check_int(slots, "slots", (B,), dev)
    _check_int(start, "start", (B,), dev)
    if tuple(sink.shape) != (H,) or not sink.is_floating_point():
        raise AttentionKernelError(f"sink must be a float [{H}], got {tuple(sink.shape)} {sink.dtype}")
    if window < 1:
        raise AttentionKernelError(f"window must be >= 1, got {window}")
    unrot = cos is not None
    if unrot:
        rd2 = cos.shape[-1]
        for t, name in ((cos, "cos"), (sin, "sin")):
            if t is None or t.dim() != 3 or tuple(t.shape[:2]) != (B, S) or t.shape[-1] != rd2 or t.stride(-1) != 1 \
                    or t.dtype != torch.float32 or t.device != dev:
                raise AttentionKernelError(f"{name} must be fp32 [{B}, {S}, rd/2] with a contiguous last dim "
                                           f"(like cos {tuple(cos.shape)}), got {None if t is None else tuple(t.shape)}")
        if not 0 < 2 * rd2 <= hd or sin.stride() != cos.stride():
            raise AttentionKernelError(f"cos/sin: {2 * rd2} rope dims for a head of {hd}, strides "
                                       f"{cos.stride()} / {sin.stride()}")
    else:
        rd2, cos, sin = 1, q, q           # pointers the kernel never reads without UNROT
    rope_args = (cos.stride(0), cos.stride(1), hd - 2 * rd2, rd2)
    ring_p = _store_parts(ring, "ring", hd, dtype)
    if ring_p[0].shape[1] < window:
        raise AttentionKernelError(f"ring has {ring_p[0].shape[1]} rows < window {window}")

    has_comp, dense = comp is not None, comp is not None and comp_idx is None
    comp_p, idx, clen, nc = ring_p, slots, slots, 0
    if has_comp:
        comp_p = _store_parts(comp, "comp", hd, dtype)
        if not 0 <= comp_bound <= comp_p[0].shape[1]:
            raise AttentionKernelError(f"comp_bound {comp_bound} outside [0, {comp_p[0].shape[1]}]")
        if dense:
            if comp_len is None:
                raise AttentionKernelError("comp given without comp_idx needs comp_len (HCA)")
            _check_int(comp_len, "comp_len", (B, S), dev)
            clen, nc = comp_len.contiguous(), comp_bound
        else:
            if comp_idx.dim() != 3:
                raise AttentionKernelError(f"comp_idx must be [B, S, k], got {tuple(comp_idx.shape)}")
            _check_int(comp_idx, "comp_idx", (B, S, comp_idx.shape[-1]), dev)
            idx, nc = comp_idx.contiguous(), comp_idx.shape[-1]
        has_comp = nc > 0
    # the products split each row into dims [0, nope) and [nope, hd): an fp8 store's FP8 / rope parts
    nopes = {p[4] for p in (ring_p, comp_p) if p[3] == LAYOUT_FP8}
    if len(nopes) > 1:
        raise AttentionKernelError(f"ring and comp store different rope widths: {hd - max(nopes)} vs {hd - min(nopes)}")
    nope = nopes.pop() if nopes else hd
    dp = max(16, triton.next_power_of_2(hd))
    ch = min(64, dp)

    out = runtime.empty((B, S, H, hd), dtype, dev)
    if B * S == 0 or H == 0:
        return out
    bh, bn, warps, stages = _attn_config(H, hd, B * S, q.element_size())
    n_blocks = triton.cdiv(window, bn) + (triton.cdiv(nc, bn) if has_comp else 0)
    splits, bps = _splits(n_blocks, B * S * triton.cdiv(H, bh), _target_programs or runtime.sm_count(dev))
    (rd, rs, rr, r_layout, _, r_nsc, r_e8m0), (cd, cs, cr, c_layout, _, c_nsc, c_e8m0) = ring_p, comp_p
    if splits == 1:
        # a prefill (enough queries to fill the GPU unsplit): plain tiles, one GEMM of K = hd a product
        rbh, rbn, rwarps, rstages = _rows_config(H, hd, q.element_size())
        ntab = (comp_bound if comp_bound > 0 else cd.shape[1]) if has_comp else 0
        # the key tables of a group of sequences at a time, within TABLE_BYTES (one sequence at least)
        group = max(1, TABLE_BYTES // ((window + S + ntab) * hd * q.element_size()))
        for b0 in range(0, B, group):
            g = slice(b0, min(B, b0 + group))
            win = _rows_table(kv_new[g], slots[g], start[g], ring_p, window, hd, dp, window=True)
            ctab = _rows_table(kv_new[g], slots[g], start[g], comp_p, ntab, hd, dp, window=False) if has_comp else win
            _attn_rows_kernel[(kv_new[g].shape[0] * S, triton.cdiv(H, rbh))](
                q[g], win, ctab, out[g], sink, start[g], idx[g], clen[g], cos[g], sin[g], S, H, nc, ntab,
                float(scale) * _LOG2E, q.stride(0), q.stride(1), q.stride(2), out.stride(0), out.stride(1),
                out.stride(2), *rope_args, W=window, HD=hd, DP=dp, BH=rbh, BN=rbn, HAS_COMP=has_comp, DENSE=dense,
                UNROT=unrot, BR2=triton.next_power_of_2(rd2), PREC="ieee" if dtype == torch.float32 else "tf32",
                num_warps=rwarps, num_stages=rstages)
        return out
    cnt = _counters(dev)                        # may refuse (first use inside a graph capture)
    pacc = runtime.empty((B * S, H, splits, hd), torch.float32, dev)
    pml = runtime.empty((B * S, H, splits, 2), torch.float32, dev)
    _attn_kernel[(B * S, triton.cdiv(H, bh), splits)](
        q, kv_new, out, pacc, pml, cnt, sink, slots, start, rd, rs, rr, cd, cs, cr, idx, clen, cos, sin,
        S, H, rd.shape[1], cd.shape[1], nc, float(scale) * _LOG2E, splits, bps,
        q.stride(0), q.stride(1), q.stride(2), kv_new.stride(0), kv_new.stride(1),
        out.stride(0), out.stride(1), out.stride(2), *rope_args,
        W=window, HD=hd, NOPE=nope, NCH=dp // ch, CH=ch, ROPE_ALIGNED=nope % ch == 0 and hd - nope == ch == dp - nope,
        BH=bh, BN=bn,
        R_LAYOUT=r_layout, R_NSC=r_nsc, R_E8M0=r_e8m0, HAS_COMP=has_comp, DENSE=dense,
        C_LAYOUT=c_layout, C_NSC=c_nsc, C_E8M0=c_e8m0, UNROT=unrot, BR2=triton.next_power_of_2(rd2),
        PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out


REGISTRATIONS = [("sparse_attention", None, sparse_attention_triton)]

__all__ = ["sparse_attention_triton", "AttentionKernelError", "REGISTRATIONS"]
