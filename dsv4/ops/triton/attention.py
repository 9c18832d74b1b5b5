"""Sparse attention (sliding window + compressed entries + sink), the lightning indexer's scores
and the indexer's top-k.

Computes what :func:`dsv4.ops.reference.sparse_attention`, :func:`~dsv4.ops.reference.indexer_scores`
and :func:`~dsv4.ops.reference.topk_indices` compute (DSV4_FACTS section 2, "Attention" and
"Lightning indexer"; storage layouts in :mod:`dsv4.model.cache`).

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
contiguous ranges so that decode fills the SMs (flash decoding; prefill has one split and finishes
in-kernel). With several splits, each program writes its unnormalized ``acc`` and ``(max, sum)``,
and ``_attn_combine_kernel`` (grid ``(B*S, H)``) merges them in split order with the sink. With at
most :data:`FUSED_MAX_SPLITS` splits the last program of a (query, head block) to finish (an
atomic counter, re-armed by that program) does that merge itself, saving the launch; in split
order too, so the result is deterministic whichever finishes last. A query that sees no key gets
``0`` (the sink takes all the weight).

**Indexer scores.** ``out[b, s, c] = sum_h w[b, s, h] * relu(q[b, s, h] . K[slot_b, c])`` for
``c < bound``. Grid ``(B * ceil(S / BQ), entry splits)``; a program decodes a tile of ``BC = 64``
keys once (packed e2m1 nibbles times their e8m0 scale per 32, exactly, in the activation dtype)
and for each of its ``BQ`` queries (1 in decode: the query stays in registers) runs ``tl.dot`` of
the tile against the query's ``nI`` heads (low nibbles against the even query dims, high nibbles
against the odd ones: nothing is interleaved), then ReLU, the head weights, the sum over heads.

**Top-k.** One program per row chunk ranks int64 keys (the score's order-preserving int32 in the
high half, the inverted index in the low half: exactly the reference's order, ties to the lowest
index) with Triton's bitonic ``tl.topk``; rows longer than :data:`TOPK_CHUNK` go through levels
(each chunk's top-k keys, then the top-k of those).

Everything is sized from host-known shapes: no host read of a device value, CUDA-graph capturable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import KernelUnsupported

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_LOG2E = 1.4426950408889634

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
LAYOUT_PLAIN, LAYOUT_FP8 = 0, 1

#: decode grids split each query's keys until about this many programs run (None: the device's SM
#: count; one program per SM at a time, register-bound); the interpreter tests set small numbers
TARGET_PROGRAMS: int | None = None
#: the last program of a split query merges the splits itself (no combine launch) when there are at
#: most this many: it reads every split's [BH, hd] fp32 partial alone, so for many splits the
#: combine kernel (one program per query and head, in parallel) is faster despite its launch
FUSED_MAX_SPLITS = 2
#: False: always the combine kernel
FUSED_COMBINE = True
#: per device: the merge counters of FUSED_COMBINE (zero between calls; the last program re-arms)
_COUNTERS: dict[torch.device, torch.Tensor] = {}
MAX_SPLIT_PROGRAMS = 4096
#: the indexer kernel is lighter (4 warps): several programs share an SM
INDEXER_PROGRAMS_PER_SM = 4


class AttentionKernelError(KernelUnsupported):
    """The inputs do not fit the Triton attention / indexer kernels (the message names the argument)."""


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Output / workspace allocation (tests replace it with a NaN-filled one)."""
    return torch.empty(shape, dtype=dtype, device=device)


# ----------------------------------------------------------------------------- numerics helpers
@triton.jit
def _e8m0_to_f32(bits):
    """e8m0 bytes -> fp32 ``2^(e-127)``, exact (``e = 0`` is the subnormal ``2^-127``, 255 NaN)."""
    e = bits.to(tl.int32)
    f = tl.where(e == 0, 0x00400000, e << 23)
    f = tl.where(e == 255, 0x7FC00000, f)
    return f.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_to_f32(code):
    """e2m1 codes (int32, low 4 bits) -> fp32 values, arithmetically: magnitude code ``2e + m`` is
    ``0.5 m`` for ``e = 0``, else ``2^(e-1) (1 + m/2)``; bit 3 is the sign."""
    e = (code >> 1) & 3
    m = (code & 1).to(tl.float32)
    pw = ((e + 126) << 23).to(tl.float32, bitcast=True)          # 2^(e-1) for e >= 1
    mag = tl.where(e == 0, 0.5 * m, pw * (1.0 + 0.5 * m))
    return tl.where((code & 8) != 0, -mag, mag)


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
            sf = _e8m0_to_f32(sc)
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


# ----------------------------------------------------------------------------- attention kernels
@triton.jit(do_not_specialize=["NC", "n_splits", "bps"])
def _attn_kernel(q_ptr, kvn_ptr, out_ptr, pacc_ptr, pml_ptr, cnt_ptr, sink_ptr, slots_ptr, start_ptr,
                 ring_data, ring_scale, ring_rope, comp_data, comp_scale, comp_rope, idx_ptr, len_ptr,
                 S, H, ring_rows, comp_rows, NC, qk_scale, n_splits, bps,
                 sq_b, sq_s, sq_h, skv_b, skv_s, so_b, so_s, so_h,
                 W: tl.constexpr, HD: tl.constexpr, NOPE: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
                 ROPE_ALIGNED: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                 R_LAYOUT: tl.constexpr, R_NSC: tl.constexpr, R_E8M0: tl.constexpr,
                 HAS_COMP: tl.constexpr, DENSE: tl.constexpr, C_LAYOUT: tl.constexpr,
                 C_NSC: tl.constexpr, C_E8M0: tl.constexpr, MULTI: tl.constexpr,
                 FUSED: tl.constexpr, PREC: tl.constexpr):
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

    if not MULTI:
        sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_f)
        f = alpha / (l_i * alpha + tl.exp2(sink - m_f))
        o = acc * f[None, :, None]
        tl.store(out_ptr + b.to(tl.int64) * so_b + s * so_s + h3 * so_h + d3, o.to(out_ptr.dtype.element_ty),
                 mask=hm3 & dm3)
    else:
        part = (pid_q.to(tl.int64) * H + h) * n_splits + pid_sp                    # [BH]
        tl.store(pml_ptr + part * 2, m_i, mask=hm)
        tl.store(pml_ptr + part * 2 + 1, l_i, mask=hm)
        # a split that saw no key leaves its acc unwritten: the combine never reads it (l = 0)
        live3 = (hm & (l_i > 0))[None, :, None]
        tl.store(pacc_ptr + part[None, :, None] * HD + d3, acc, mask=live3 & dm3)
        if FUSED:
            # the last of the SPLITS programs of this (query, head block) merges them all, in
            # split order (deterministic whichever finishes last), then re-arms the counter
            cnt = cnt_ptr + pid_q * tl.num_programs(1) + pid_h
            tl.debug_barrier()
            done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
            tl.debug_barrier()
            if done == n_splits - 1:
                o = _merge_splits(pml_ptr, pacc_ptr, sink_ptr, (pid_q.to(tl.int64) * H + h) * n_splits, h, hm, d3,
                                  dm3, HD, NCH, CH, BH, n_splits)
                tl.store(out_ptr + b.to(tl.int64) * so_b + s * so_s + h3 * so_h + d3,
                         o.to(out_ptr.dtype.element_ty), mask=hm3 & dm3)
                tl.atomic_xchg(cnt, 0)


@triton.jit
def _merge_splits(pml_ptr, pacc_ptr, sink_ptr, part0, h, hm, d3, dm3, HD: tl.constexpr, NCH: tl.constexpr,
                  CH: tl.constexpr, BH: tl.constexpr, n_splits):
    """Softmax-merge the ``n_splits`` partial results of heads ``h`` (partials ``part0 + j``) with the
    sink: ``[NCH, BH, CH]`` fp32, summed in split order. Reads bypass L1 (other SMs wrote them)."""
    sink = tl.load(sink_ptr + h, mask=hm, other=0.0).to(tl.float32) * 1.4426950408889634
    m_f = sink
    for j in range(n_splits):
        m_f = tl.maximum(m_f, tl.load(pml_ptr + (part0 + j) * 2, mask=hm, other=-1.0e30, cache_modifier=".cg"))
    den = tl.exp2(sink - m_f)
    acc = tl.zeros([NCH, BH, CH], tl.float32)
    for j in range(n_splits):
        m_j = tl.load(pml_ptr + (part0 + j) * 2, mask=hm, other=-1.0e30, cache_modifier=".cg")
        l_j = tl.load(pml_ptr + (part0 + j) * 2 + 1, mask=hm, other=0.0, cache_modifier=".cg")
        w_j = tl.exp2(m_j - m_f)
        den += l_j * w_j
        live = (hm & (l_j > 0))[None, :, None]
        a = tl.load(pacc_ptr + (part0 + j)[None, :, None] * HD + d3, mask=live & dm3, other=0.0,
                    cache_modifier=".cg")
        acc += a * w_j[None, :, None]
    return acc / den[None, :, None]


@triton.jit(do_not_specialize=["n_splits"])
def _attn_combine_kernel(pacc_ptr, pml_ptr, sink_ptr, out_ptr, S, H, n_splits, so_b, so_s, so_h,
                         HD: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr, BH: tl.constexpr):
    """Merge the ``n_splits`` partials of ``BH`` heads of one query (when the attention kernel did
    not merge them itself). The split count is a run-time loop bound: any count, one compile."""
    pid_q = tl.program_id(0)
    b = pid_q // S
    s = pid_q % S
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    hm = h < H
    d3 = tl.arange(0, NCH)[:, None, None] * CH + tl.arange(0, CH)[None, None, :]
    dm3 = d3 < HD
    o = _merge_splits(pml_ptr, pacc_ptr, sink_ptr, (pid_q.to(tl.int64) * H + h) * n_splits, h, hm, d3, dm3,
                      HD, NCH, CH, BH, n_splits)
    tl.store(out_ptr + b.to(tl.int64) * so_b + s * so_s + h[None, :, None] * so_h + d3,
             o.to(out_ptr.dtype.element_ty), mask=hm[None, :, None] & dm3)


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


def _attn_config(H: int, hd: int, n_queries: int) -> tuple[int, int, int, int]:
    """``(BH heads, BN keys, num_warps, num_stages)`` per program, by shape."""
    bh = max(16, min(32, triton.next_power_of_2(H)))
    if _INTERPRET:
        return bh, 16, 4, 1
    # hd 512: 32 heads x 32 keys with 8 warps (one 64-dim chunk each) is the largest tile without
    # spills (sm_90, Triton 3.6: 255 registers, 148 KB shared memory with two stages, 96 KB with
    # one); 64 heads would need 128 KB of fp32 accumulators per program
    return bh, 32, 8, 2


def _check_int(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise AttentionKernelError(f"{name}: must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise AttentionKernelError(f"{name}: shape {tuple(t.shape)} != {shape}")
    if t.device != device:
        raise AttentionKernelError(f"{name}: on {t.device}, queries on {device}")


def _target_programs(device: torch.device) -> int:
    if TARGET_PROGRAMS is not None:
        return TARGET_PROGRAMS
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def _splits(n_blocks: int, base_programs: int, target: int) -> tuple[int, int]:
    """``(splits, blocks per split)`` so that ``base_programs * splits <= target`` (at least one
    split; the largest count that fits), no split empty."""
    splits = min(n_blocks, max(1, target // base_programs), MAX_SPLIT_PROGRAMS // max(1, base_programs))
    bps = triton.cdiv(n_blocks, max(1, splits))
    return triton.cdiv(n_blocks, bps), bps


def _counters(device: torch.device) -> torch.Tensor:
    cnt = _COUNTERS.get(device)
    if cnt is None:
        cnt = _COUNTERS[device] = torch.zeros(MAX_SPLIT_PROGRAMS, dtype=torch.int32, device=device)
    return cnt


def sparse_attention_triton(q: torch.Tensor, kv_new: torch.Tensor, ring: object, slots: torch.Tensor,
                            start: torch.Tensor, window: int, sink: torch.Tensor, scale: float,
                            comp: object | None = None, comp_idx: torch.Tensor | None = None,
                            comp_len: torch.Tensor | None = None, comp_bound: int = 0) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.sparse_attention` (same signature and result)."""
    if q.dim() != 4:
        raise AttentionKernelError(f"q must be [B, S, H, hd], got {tuple(q.shape)}")
    B, S, H, hd = q.shape
    dtype, dev = q.dtype, q.device
    if dtype not in _TL_DTYPE:
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
    ring_p = _store_parts(ring, "ring", hd, dtype)
    if ring_p[0].shape[1] < window:
        raise AttentionKernelError(f"ring has {ring_p[0].shape[1]} rows < window {window}")

    has_comp, dense = comp is not None, comp is not None and comp_idx is None
    comp_p, idx, clen, nc = ring_p, slots, slots, 0
    if has_comp:
        comp_p = _store_parts(comp, "comp", hd, dtype)
        if dense:
            if comp_len is None:
                raise AttentionKernelError("comp given without comp_idx needs comp_len (HCA)")
            _check_int(comp_len, "comp_len", (B, S), dev)
            if not 0 <= comp_bound <= comp_p[0].shape[1]:
                raise AttentionKernelError(f"comp_bound {comp_bound} outside [0, {comp_p[0].shape[1]}]")
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

    out = _empty((B, S, H, hd), dtype, dev)
    if B * S == 0 or H == 0:
        return out
    bh, bn, warps, stages = _attn_config(H, hd, B * S)
    n_blocks = triton.cdiv(window, bn) + (triton.cdiv(nc, bn) if has_comp else 0)
    splits, bps = _splits(n_blocks, B * S * triton.cdiv(H, bh), _target_programs(dev))
    fused = FUSED_COMBINE and 1 < splits <= FUSED_MAX_SPLITS
    if splits > 1:
        pacc = _empty((B * S, H, splits, hd), torch.float32, dev)
        pml = _empty((B * S, H, splits, 2), torch.float32, dev)
    else:
        pacc = pml = out
    cnt = _counters(dev) if fused else out
    (rd, rs, rr, r_layout, _, r_nsc, r_e8m0), (cd, cs, cr, c_layout, _, c_nsc, c_e8m0) = ring_p, comp_p
    _attn_kernel[(B * S, triton.cdiv(H, bh), splits)](
        q, kv_new, out, pacc, pml, cnt, sink, slots, start, rd, rs, rr, cd, cs, cr, idx, clen,
        S, H, rd.shape[1], cd.shape[1], nc, float(scale) * _LOG2E, splits, bps,
        q.stride(0), q.stride(1), q.stride(2), kv_new.stride(0), kv_new.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        W=window, HD=hd, NOPE=nope, NCH=dp // ch, CH=ch, ROPE_ALIGNED=nope % ch == 0 and hd - nope == ch == dp - nope,
        BH=bh, BN=bn,
        R_LAYOUT=r_layout, R_NSC=r_nsc, R_E8M0=r_e8m0, HAS_COMP=has_comp, DENSE=dense,
        C_LAYOUT=c_layout, C_NSC=c_nsc, C_E8M0=c_e8m0, MULTI=splits > 1, FUSED=fused,
        PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    if splits > 1 and not fused:
        _attn_combine_kernel[(B * S, triton.cdiv(H, bh))](
            pacc, pml, sink, out, S, H, splits, out.stride(0), out.stride(1), out.stride(2),
            HD=hd, NCH=dp // ch, CH=ch, BH=bh, num_warps=8)
    return out


# ----------------------------------------------------------------------------- indexer
@triton.jit
def _index_keys(k_data, k_scale, row, cm, HALF: tl.constexpr, FP4: tl.constexpr, OUT: tl.constexpr):
    """Key rows ``row [BC]`` as their even and odd dims ``[BC, HALF]`` each, in ``OUT`` (exactly
    ``RowStore.read``): packed e2m1, low nibble = even dim, times the e8m0 scale of its 32; or plain."""
    j = tl.arange(0, HALF)
    if FP4:
        byte = tl.load(k_data + row[:, None] * HALF + j[None, :], mask=cm[:, None], other=0).to(tl.int32)
        sc = _e8m0_to_f32(tl.load(k_scale + row[:, None] * (HALF // 16) + (j // 16)[None, :],
                                  mask=cm[:, None], other=127))
        k_even = (_e2m1_to_f32(byte & 15) * sc).to(OUT)
        k_odd = (_e2m1_to_f32(byte >> 4) * sc).to(OUT)
    else:
        base = k_data + row[:, None] * (2 * HALF) + 2 * j[None, :]
        k_even = tl.load(base, mask=cm[:, None], other=0.0).to(OUT)
        k_odd = tl.load(base + 1, mask=cm[:, None], other=0.0).to(OUT)
    return k_even, k_odd


@triton.jit
def _index_query(q_ptr, w_ptr, s, sq_s, sq_h, sw_s, NI: tl.constexpr, NIP: tl.constexpr, HALF: tl.constexpr):
    """Query ``s``'s heads as even / odd dims ``[NIP, HALF]`` (padded heads zero) and weights ``[NIP]``."""
    hh = tl.arange(0, NIP)
    hm = hh < NI
    j = tl.arange(0, HALF)
    qrow = q_ptr + s * sq_s + hh[:, None] * sq_h + 2 * j[None, :]
    q_even = tl.load(qrow, mask=hm[:, None], other=0.0)
    q_odd = tl.load(qrow + 1, mask=hm[:, None], other=0.0)
    w = tl.load(w_ptr + s * sw_s + hh, mask=hm, other=0.0).to(tl.float32)
    return q_even, q_odd, w


@triton.jit
def _index_score(k_even, k_odd, q_even, q_odd, w, PREC: tl.constexpr):
    """``sum_h w[h] * relu(q[h] . k[c])`` for the tile's keys: ``[BC]`` fp32."""
    dots = tl.dot(k_even, tl.trans(q_even), input_precision=PREC)
    dots = tl.dot(k_odd, tl.trans(q_odd), dots, input_precision=PREC)                # [BC, NIP]
    return tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1)


@triton.jit(do_not_specialize=["bound", "n_qb", "tiles_per_split", "so_b", "so_s"])
def _indexer_kernel(q_ptr, w_ptr, out_ptr, k_data, k_scale, slots_ptr,
                    S, bound, k_rows, n_qb, tiles_per_split,
                    sq_b, sq_s, sq_h, sw_b, sw_s, so_b, so_s,
                    NI: tl.constexpr, NIP: tl.constexpr, HALF: tl.constexpr, BC: tl.constexpr,
                    BQ: tl.constexpr, FP4: tl.constexpr, PREC: tl.constexpr):
    pid_q = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_q // n_qb
    s0 = (pid_q % n_qb) * BQ
    dt = q_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    q_b = q_ptr + b.to(tl.int64) * sq_b
    w_b = w_ptr + b.to(tl.int64) * sw_b
    o_b = out_ptr + b.to(tl.int64) * so_b
    tile_lo = pid_c * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(bound, BC))
    if BQ == 1:                         # decode: the query stays in registers over the key tiles
        q_even, q_odd, w = _index_query(q_b, w_b, s0, sq_s, sq_h, sw_s, NI, NIP, HALF)
        for tile in range(tile_lo, tile_hi):
            c = tile * BC + tl.arange(0, BC)
            cm = c < bound
            k_even, k_odd = _index_keys(k_data, k_scale, slot * k_rows + c, cm, HALF, FP4, dt)
            tl.store(o_b + s0 * so_s + c, _index_score(k_even, k_odd, q_even, q_odd, w, PREC), mask=cm)
    else:                               # prefill: each decoded key tile serves BQ queries
        for tile in range(tile_lo, tile_hi):
            c = tile * BC + tl.arange(0, BC)
            cm = c < bound
            k_even, k_odd = _index_keys(k_data, k_scale, slot * k_rows + c, cm, HALF, FP4, dt)
            for i in range(0, BQ):
                s = s0 + i
                if s < S:
                    q_even, q_odd, w = _index_query(q_b, w_b, s, sq_s, sq_h, sw_s, NI, NIP, HALF)
                    tl.store(o_b + s * so_s + c, _index_score(k_even, k_odd, q_even, q_odd, w, PREC), mask=cm)


def indexer_scores_triton(q: torch.Tensor, keys: object, slots: torch.Tensor, weights: torch.Tensor,
                          bound: int) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.indexer_scores` (same signature and result)."""
    if q.dim() != 4:
        raise AttentionKernelError(f"q must be [B, S, nI, d], got {tuple(q.shape)}")
    B, S, NI, dim = q.shape
    dtype, dev = q.dtype, q.device
    if dtype not in _TL_DTYPE:
        raise AttentionKernelError(f"q: dtype {dtype} not supported (bf16, fp16, fp32)")
    if q.stride(-1) != 1:
        raise AttentionKernelError("q needs a contiguous last dim")
    if tuple(weights.shape) != (B, S, NI) or not weights.is_floating_point() or weights.stride(-1) != 1:
        raise AttentionKernelError(f"weights must be a float [{B}, {S}, {NI}] with a contiguous last dim, "
                                   f"got {tuple(weights.shape)} {weights.dtype}")
    _check_int(slots, "slots", (B,), dev)
    layout = getattr(keys, "layout", None)
    if layout not in ("plain", "fp4"):
        raise AttentionKernelError(f"keys: layout {layout!r} not supported (plain or fp4)")
    if keys.dim != dim or keys.dtype != dtype:
        raise AttentionKernelError(f"keys: rows of {keys.dim} {keys.dtype}, queries {dim} {dtype}")
    data = keys.data
    if not data.is_contiguous() or data.dim() != 3:
        raise AttentionKernelError("keys: data must be a contiguous [slots, rows, ...]")
    if not 0 <= bound <= data.shape[1]:
        raise AttentionKernelError(f"bound {bound} outside [0, {data.shape[1]}]")
    fp4 = layout == "fp4"
    if fp4:
        if dim % 32 or data.dtype != torch.uint8 or data.shape[-1] != dim // 2:
            raise AttentionKernelError(f"keys: fp4 needs d % 32 == 0 and uint8 [slots, rows, {dim // 2}]")
        sc = keys.scale
        if sc is None or sc.dtype != torch.uint8 or sc.shape != (*data.shape[:2], dim // 32) or not sc.is_contiguous():
            raise AttentionKernelError(f"keys: fp4 scale must be contiguous uint8 [slots, rows, {dim // 32}]")
    else:
        if data.dtype != dtype or data.shape[-1] != dim:
            raise AttentionKernelError(f"keys: plain data must be [slots, rows, {dim}] {dtype}")
        sc = data
    if dim < 32 or dim & (dim - 1):
        raise AttentionKernelError(f"index head dim {dim} must be a power of two >= 32")
    out = _empty((B, S, bound), torch.float32, dev)
    if B * S == 0 or bound == 0:
        return out
    bc = 16 if _INTERPRET else 64
    bq = 1 if S == 1 else (4 if _INTERPRET else 16)
    n_qb = triton.cdiv(S, bq)
    n_tiles = triton.cdiv(bound, bc)
    splits, per = _splits(n_tiles, B * n_qb, INDEXER_PROGRAMS_PER_SM * _target_programs(dev))
    _indexer_kernel[(B * n_qb, splits)](
        q, weights, out, data, sc, slots, S, bound, data.shape[1], n_qb, per,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
        NI=NI, NIP=max(16, triton.next_power_of_2(NI)), HALF=dim // 2, BC=bc, BQ=bq, FP4=fp4,
        PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=4, num_stages=2 if not _INTERPRET else 1)
    return out


# ----------------------------------------------------------------------------- top-k
#: elements one top-k program ranks at once (int64 keys in registers); longer rows go in levels
TOPK_CHUNK = 4096
_INT64_MIN = -(1 << 63)


@triton.jit(do_not_specialize=["n", "k", "src_stride", "dst_stride"])
def _topk_kernel(src_ptr, dst_ptr, n, k, src_stride, dst_stride, CHUNK: tl.constexpr, KP: tl.constexpr,
                 FROM_SCORES: tl.constexpr, FINAL: tl.constexpr):
    """One chunk of one row: the ``KP`` largest keys of ``CHUNK`` (bitonic top-k), where a key is
    the score's order-preserving int32 in the high half and the inverted index in the low half
    (exactly :func:`dsv4.ops.reference.topk_indices`: ties go to the lowest index, -0 == +0).
    ``FINAL``: write the first ``k`` indices; else the ``KP`` keys, for the next level."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    i = ch * CHUNK + tl.arange(0, CHUNK)
    m = i < n
    if FROM_SCORES:
        bits = tl.load(src_ptr + row * src_stride + i, mask=m, other=0.0).to(tl.float32).to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)                          # -0 ties with +0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) | (4294967295 - i.to(tl.int64))
        key = tl.where(m, key, -9223372036854775808)
    else:
        key = tl.load(src_ptr + row * src_stride + i, mask=m, other=-9223372036854775808)
    top = tl.topk(key, KP)
    j = tl.arange(0, KP)
    if FINAL:
        tl.store(dst_ptr + row * dst_stride + j, 4294967295 - (top & 4294967295), mask=j < k)
    else:
        tl.store(dst_ptr + row * dst_stride + ch * KP + j, top)


def topk_indices_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.topk_indices` (same signature, same indices and
    order): one launch for rows up to :data:`TOPK_CHUNK` entries, else levels of chunked top-k."""
    if not scores.is_floating_point() or scores.dim() < 1:
        raise AttentionKernelError(f"scores must be a float tensor [..., n], got {scores.dtype} {tuple(scores.shape)}")
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise AttentionKernelError(f"k = {k} outside [0, {n}]")
    lead = scores.shape[:-1]
    out = _empty((*lead, k), torch.int64, scores.device)
    rows = out.numel() // max(1, k)
    if k == 0 or rows == 0:
        return out
    src, n_cur, from_scores = scores.reshape(-1, n).contiguous(), n, True
    kp = triton.next_power_of_2(k)
    while True:
        if triton.next_power_of_2(n_cur) <= max(TOPK_CHUNK, 2 * kp):
            chunk, n_ch = max(kp, triton.next_power_of_2(n_cur)), 1
        else:
            chunk = max(TOPK_CHUNK, 2 * kp)
            n_ch = triton.cdiv(n_cur, chunk)
        final = n_ch == 1
        dst = out.view(rows, k) if final else _empty((rows, n_ch * kp), torch.int64, scores.device)
        _topk_kernel[(rows, n_ch)](src, dst, n_cur, k, src.stride(0), dst.stride(0), CHUNK=chunk, KP=kp,
                                   FROM_SCORES=from_scores, FINAL=final, num_warps=8 if chunk >= 4096 else 4)
        if final:
            return out
        src, n_cur, from_scores = dst, n_ch * kp, False


REGISTRATIONS = [
    ("sparse_attention", None, sparse_attention_triton),
    ("indexer_scores", None, indexer_scores_triton),
    ("topk_indices", None, topk_indices_triton),
]

__all__ = ["sparse_attention_triton", "indexer_scores_triton", "topk_indices_triton", "AttentionKernelError",
           "REGISTRATIONS"]
