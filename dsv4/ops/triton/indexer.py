"""The lightning indexer's scores and its top-k as Triton kernels.

Computes what :func:`dsv4.ops.reference.indexer_scores` and :func:`~dsv4.ops.reference.topk_indices`
compute (DSV4_FACTS section 2, "Lightning indexer"; key storage in :mod:`dsv4.model.cache`).

**Indexer scores.** ``out[b, s, c] = sum_h w[b, s, h] * relu(q[b, s, h] . K[slot_b, c])`` for
``c < bound``. Grid ``(B * ceil(S / BQ), entry splits)``; a program decodes a tile of ``BC`` (decode 64)
keys once (packed e2m1 nibbles times their e8m0 scale per 32, exactly, in the activation dtype)
and for each of its ``BQ`` queries (1 in decode: the query stays in registers) runs ``tl.dot`` of
the tile against the query's ``nI`` heads (low nibbles against the even query dims, high nibbles
against the odd ones: nothing is interleaved), then ReLU, the head weights, the sum over heads.
In prefill (``BC`` = :data:`PREFILL_KEY_TILE`, ``BQ`` = :data:`PREFILL_QUERY_BLOCK`) the (query,
head) rows of ``QS`` queries are one MMA's M side (128 rows), and key
tiles past every visible entry of the program's queries are written ``-inf`` without computing
(half the work of a prompt's causal triangle).

The head weights are scaled in-kernel (``w * scale`` in fp32, as the reference) and, given each
query's visible count, entries past it are written as ``-inf``: the indexer's mask costs no launch.

**Top-k.** One program per row finds the ``k``-th largest score by radix selection (four
256-bin histograms of one byte each of the score's order-preserving int32), then writes the
indices of every score above it and of the lowest-indexed scores equal to it, in index order (the
reference's picks and order: ties to the lowest index, ``-0 == +0``). No sort: a bitonic
``tl.topk`` of 2048 int64 keys took ~70 us a row of a decode step on an H100, this 37 us. Rows
longer than :data:`TOPK_SPLIT` scores go in levels: each chunk's picks (by the same kernel, chunks
in parallel), then the picks of those (the kernel reading candidates' scores through their indices).
Given a limit per row, a pick at or past it is written ``-1``.

Everything is sized from host-known shapes: no host read of a device value, CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import runtime
from .attention import AttentionKernelError, _check_int, _splits
from .numerics import e2m1_to_f32, e8m0_to_f32, ordered_i32

#: the indexer kernel is lighter than attention's (4 warps): several programs share an SM
PROGRAMS_PER_SM = 4
#: keys a decode program decodes at a time
DECODE_KEY_TILE = 64
#: prefill: keys decoded at a time (each tile serves a block of queries, eight warps) and queries a
#: block. The block's queries are re-read for every key tile, so wider tiles read them less often:
#: H200, one 8192-token prompt's scores (2048 entries, causal; bench/indexer_tune.py) 8.04 ms at 64
#: keys and 16 queries -> 2.28 ms at 256 and 8, the same bits (results/2026-11-28e)
PREFILL_KEY_TILE = 256
PREFILL_QUERY_BLOCK = 8


# ----------------------------------------------------------------------------- scores
@triton.jit
def _index_keys(k_data, k_scale, row, cm, HALF: tl.constexpr, FP4: tl.constexpr, OUT: tl.constexpr):
    """Key rows ``row [BC]`` as their even and odd dims ``[BC, HALF]`` each, in ``OUT`` (exactly
    ``RowStore.read``): packed e2m1, low nibble = even dim, times the e8m0 scale of its 32; or plain."""
    j = tl.arange(0, HALF)
    if FP4:
        byte = tl.load(k_data + row[:, None] * HALF + j[None, :], mask=cm[:, None], other=0).to(tl.int32)
        sc = e8m0_to_f32(tl.load(k_scale + row[:, None] * (HALF // 16) + (j // 16)[None, :],
                                 mask=cm[:, None], other=127))
        k_even = (e2m1_to_f32(byte & 15) * sc).to(OUT)
        k_odd = (e2m1_to_f32(byte >> 4) * sc).to(OUT)
    else:
        base = k_data + row[:, None] * (2 * HALF) + 2 * j[None, :]
        k_even = tl.load(base, mask=cm[:, None], other=0.0).to(OUT)
        k_odd = tl.load(base + 1, mask=cm[:, None], other=0.0).to(OUT)
    return k_even, k_odd


@triton.jit
def _index_query(q_ptr, w_ptr, s, sq_s, sq_h, sw_s, scale, NI: tl.constexpr, NIP: tl.constexpr, HALF: tl.constexpr):
    """Query ``s``'s heads as even / odd dims ``[NIP, HALF]`` (padded heads zero) and weights
    ``[NIP]`` times ``scale`` (fp32)."""
    hh = tl.arange(0, NIP)
    hm = hh < NI
    j = tl.arange(0, HALF)
    qrow = q_ptr + s * sq_s + hh[:, None] * sq_h + 2 * j[None, :]
    q_even = tl.load(qrow, mask=hm[:, None], other=0.0)
    q_odd = tl.load(qrow + 1, mask=hm[:, None], other=0.0)
    w = tl.load(w_ptr + s * sw_s + hh, mask=hm, other=0.0).to(tl.float32) * scale
    return q_even, q_odd, w


@triton.jit
def _index_score(k_even, k_odd, q_even, q_odd, w, PREC: tl.constexpr):
    """``sum_h w[h] * relu(q[h] . k[c])`` for the tile's keys: ``[BC]`` fp32."""
    dots = tl.dot(k_even, tl.trans(q_even), input_precision=PREC)
    dots = tl.dot(k_odd, tl.trans(q_odd), dots, input_precision=PREC)                # [BC, NIP]
    return tl.sum(tl.maximum(dots, 0.0) * w[None, :], 1)


@triton.jit
def _index_store(o_ptr, c, cm, score, vis_ptr, s, VIS: tl.constexpr):
    """Write a tile's scores, ``-inf`` at entries ``c >= visible[s]`` (with ``VIS``)."""
    if VIS:
        score = tl.where(c < tl.load(vis_ptr + s), score, float("-inf"))
    tl.store(o_ptr + c, score, mask=cm)


@triton.jit
def _index_block(q_b, w_b, o_b, v_b, k_even, k_odd, c, cm, s0, S, sq_s, sq_h, sw_s, so_s, scale,
                 NI: tl.constexpr, NIP: tl.constexpr, HALF: tl.constexpr, BC: tl.constexpr, QS: tl.constexpr,
                 VIS: tl.constexpr, PREC: tl.constexpr):
    """Scores of queries ``s0 .. s0 + QS`` against a decoded key tile: their ``QS * NIP`` (query,
    head) rows are one MMA's M side (``[QS * NIP, HALF] x [HALF, BC]``, even and odd dims), then
    ReLU, the head weights and the sum over each query's heads; stored with the visibility mask."""
    r = tl.arange(0, QS * NIP)
    s = s0 + r // NIP
    hh = r % NIP
    ok = (s < S) & (hh < NI)
    qrow = q_b + s[:, None] * sq_s + hh[:, None] * sq_h + 2 * tl.arange(0, HALF)[None, :]
    q_even = tl.load(qrow, mask=ok[:, None], other=0.0)
    q_odd = tl.load(qrow + 1, mask=ok[:, None], other=0.0)
    w = tl.load(w_b + s * sw_s + hh, mask=ok, other=0.0).to(tl.float32) * scale
    dots = tl.dot(q_even, tl.trans(k_even), input_precision=PREC)
    dots = tl.dot(q_odd, tl.trans(k_odd), dots, input_precision=PREC)                 # [QS * NIP, BC]
    score = tl.sum(tl.reshape(tl.maximum(dots, 0.0) * w[:, None], (QS, NIP, BC)), 1)  # [QS, BC]
    sq = s0 + tl.arange(0, QS)
    if VIS:
        score = tl.where(c[None, :] < tl.load(v_b + sq, mask=sq < S, other=0)[:, None], score, float("-inf"))
    tl.store(o_b + sq[:, None] * so_s + c[None, :], score, mask=(sq < S)[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["bound", "n_qb", "tiles_per_split", "so_b", "so_s"])
def _indexer_kernel(q_ptr, w_ptr, out_ptr, k_data, k_scale, slots_ptr, vis_ptr,
                    S, bound, k_rows, n_qb, tiles_per_split, scale,
                    sq_b, sq_s, sq_h, sw_b, sw_s, so_b, so_s, sv_b,
                    NI: tl.constexpr, NIP: tl.constexpr, HALF: tl.constexpr, BC: tl.constexpr,
                    BQ: tl.constexpr, FP4: tl.constexpr, VIS: tl.constexpr, PREC: tl.constexpr,
                    QS: tl.constexpr = 1):
    pid_q = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = pid_q // n_qb
    s0 = (pid_q % n_qb) * BQ
    dt = q_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + b).to(tl.int64)
    q_b = q_ptr + b.to(tl.int64) * sq_b
    w_b = w_ptr + b.to(tl.int64) * sw_b
    o_b = out_ptr + b.to(tl.int64) * so_b
    v_b = vis_ptr + b.to(tl.int64) * sv_b
    tile_lo = pid_c * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(bound, BC))
    if BQ == 1:                         # decode: the query stays in registers over the key tiles
        q_even, q_odd, w = _index_query(q_b, w_b, s0, sq_s, sq_h, sw_s, scale, NI, NIP, HALF)
        for tile in range(tile_lo, tile_hi):
            c = tile * BC + tl.arange(0, BC)
            cm = c < bound
            k_even, k_odd = _index_keys(k_data, k_scale, slot * k_rows + c, cm, HALF, FP4, dt)
            _index_store(o_b + s0 * so_s, c, cm, _index_score(k_even, k_odd, q_even, q_odd, w, PREC), v_b, s0, VIS)
    else:                               # prefill: each decoded key tile serves BQ queries, QS at a time
        tile_cut = tile_hi
        if VIS:                         # tiles no query of the block sees: -inf, not computed
            sb = s0 + tl.arange(0, BQ)
            vmax = tl.max(tl.load(v_b + sb, mask=sb < S, other=0), 0)
            tile_cut = tl.maximum(tl.minimum(tile_hi, tl.cdiv(vmax, BC)), tile_lo)
        for tile in range(tile_lo, tile_cut):
            c = tile * BC + tl.arange(0, BC)
            cm = c < bound
            k_even, k_odd = _index_keys(k_data, k_scale, slot * k_rows + c, cm, HALF, FP4, dt)
            for i in range(0, BQ, QS):
                _index_block(q_b, w_b, o_b, v_b, k_even, k_odd, c, cm, s0 + i, S, sq_s, sq_h, sw_s, so_s, scale,
                             NI, NIP, HALF, BC, QS, VIS, PREC)
        for tile in range(tile_cut, tile_hi):
            c = tile * BC + tl.arange(0, BC)
            sb = s0 + tl.arange(0, BQ)
            tl.store(o_b + sb[:, None] * so_s + c[None, :], tl.full((BQ, BC), float("-inf"), tl.float32),
                     mask=(sb < S)[:, None] & (c < bound)[None, :])


def indexer_scores_triton(q: torch.Tensor, keys: object, slots: torch.Tensor, weights: torch.Tensor,
                          bound: int, scale: float = 1.0, visible: torch.Tensor | None = None,
                          _config: dict | None = None) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.indexer_scores` (same signature and result).
    ``_config`` (tuning, bench/indexer_tune.py): prefill tiles ``BC``, ``BQ``, ``QS``, ``num_warps``,
    ``num_stages`` in place of the defaults."""
    if q.dim() != 4:
        raise AttentionKernelError(f"q must be [B, S, nI, d], got {tuple(q.shape)}")
    B, S, NI, dim = q.shape
    dtype, dev = q.dtype, q.device
    if dtype not in runtime.FLOAT_DTYPES:
        raise AttentionKernelError(f"q: dtype {dtype} not supported (bf16, fp16, fp32)")
    if q.stride(-1) != 1:
        raise AttentionKernelError("q needs a contiguous last dim")
    if tuple(weights.shape) != (B, S, NI) or not weights.is_floating_point() or weights.stride(-1) != 1:
        raise AttentionKernelError(f"weights must be a float [{B}, {S}, {NI}] with a contiguous last dim, "
                                   f"got {tuple(weights.shape)} {weights.dtype}")
    _check_int(slots, "slots", (B,), dev)
    if visible is not None:
        _check_int(visible, "visible", (B, S), dev)
        if visible.stride(1) != 1:
            raise AttentionKernelError("visible needs a contiguous last dim")
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
    out = runtime.empty((B, S, bound), torch.float32, dev)
    if B * S == 0 or bound == 0:
        return out
    interp = runtime.interpreting()
    if interp:                            # small tiles: few programs' work each in the interpreter
        bc, bq, warps, stages = 16, (1 if S == 1 else 4), 4, 1
    elif S == 1:
        bc, bq, warps, stages = DECODE_KEY_TILE, 1, 4, 2
    else:
        bc, bq, warps, stages = PREFILL_KEY_TILE, PREFILL_QUERY_BLOCK, 8, 2
    cfg = _config if _config and S > 1 else {}
    bc, bq = cfg.get("BC", bc), cfg.get("BQ", bq)
    warps, stages = cfg.get("num_warps", warps), cfg.get("num_stages", stages)
    nip = max(16, triton.next_power_of_2(NI))
    qs = cfg.get("QS", max(1, min(bq, 128 // nip)))      # (query, head) rows of one MMA: 128
    n_qb = triton.cdiv(S, bq)
    n_tiles = triton.cdiv(bound, bc)
    splits, per = _splits(n_tiles, B * n_qb, PROGRAMS_PER_SM * runtime.sm_count(dev))
    vis = slots if visible is None else visible          # a pointer the kernel never reads without VIS
    _indexer_kernel[(B * n_qb, splits)](
        q, weights, out, data, sc, slots, vis, S, bound, data.shape[1], n_qb, per, float(scale),
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
        vis.stride(0),
        NI=NI, NIP=nip, HALF=dim // 2, BC=bc, BQ=bq, QS=qs, FP4=fp4, VIS=visible is not None,
        PREC="ieee" if dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    return out


# ----------------------------------------------------------------------------- top-k
#: scores one top-k program holds in registers per pass (a row longer than this is walked in tiles)
TOPK_BLOCK = 4096
#: rows longer than this are cut into chunks of this many scores, one program each, whose picks are
#: then ranked together (one program a row walks a long row five times: 260 us at 65536 scores);
#: when those chunks would leave most SMs idle (a few decode rows) they are TOPK_BLOCK long instead
TOPK_SPLIT = 16384


@triton.jit
def _biased(v):
    """fp32 ``v`` -> int64 in ``[0, 2^32)`` with the order of the values (``-0 == +0``): the
    order-preserving int32 of :func:`dsv4.ops.reference.topk_indices`, plus ``2^31``."""
    return ordered_i32(v).to(tl.int64) + 2147483648


@triton.jit
def _topk_tile(src_row, cand_row, off, lo, hi, BLOCK: tl.constexpr, GATHER: tl.constexpr):
    """Elements ``[off, off + BLOCK)`` of ``[lo, hi)``: ``(biased values, in range, score indices)``.
    With ``GATHER`` an element is a candidate: a score index (``-1``: none) read from ``cand_row``."""
    j = off + tl.arange(0, BLOCK)
    m = (j >= lo) & (j < hi)
    if GATHER:
        idx = tl.load(cand_row + j, mask=m, other=-1)
        m = m & (idx >= 0)
    else:
        idx = j.to(tl.int64)
    return _biased(tl.load(src_row + idx, mask=m, other=0.0).to(tl.float32)), m, idx


@triton.jit(do_not_specialize=["n", "k", "chunk", "src_stride", "cand_stride", "dst_stride"])
def _topk_kernel(src_ptr, cand_ptr, dst_ptr, lim_ptr, n, k, chunk, src_stride, cand_stride, dst_stride,
                 BLOCK: tl.constexpr, LIMIT: tl.constexpr, GATHER: tl.constexpr):
    """The ``k`` largest elements of chunk ``program_id(1)`` (``chunk`` elements; the whole row when
    it is ``n``) of one row by radix selection, no sort: four passes of a 256-bin histogram of one
    byte of the (biased) value, among the values whose higher bytes match the ``k``-th largest's so
    far, find that value ``T`` byte by byte; a last pass keeps every value above ``T`` and the
    lowest-indexed values equal to it, writing their score indices in index order (positions from a
    running count) from ``dst[row, chunk_id * k]`` on (a chunk shorter than ``k`` writes all of
    it). The elements are scores, or with ``GATHER`` the candidates an earlier launch picked
    (``cand``: score indices in index order, ``-1`` none). With ``LIMIT``, ``-1`` for a score index
    at or past ``lim[row]``."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    src_row = src_ptr + row * src_stride
    cand_row = cand_ptr + row * cand_stride
    lo = ch * chunk
    hi = tl.minimum(lo + chunk, n)
    bins = tl.arange(0, 256)
    prefix = tl.full((), 0, tl.int64)                    # the bytes of T found so far
    need = tl.full((), 0, tl.int32) + k                  # how many of the values matching them to pick
    for d in tl.static_range(4):
        shift = 24 - 8 * d                               # (a constexpr: d is)
        hist = tl.zeros((256,), tl.int32)
        for off in range(lo, hi, BLOCK):
            u, m, idx = _topk_tile(src_row, cand_row, off, lo, hi, BLOCK, GATHER)
            if d > 0:
                m = m & ((u >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=m)
        if d == 0:
            # a chunk of fewer than k elements (the row's last; candidates past padding) keeps them all
            need = tl.minimum(need, tl.sum(hist, axis=0))
        at_least = tl.cumsum(hist, 0, reverse=True)      # count of bytes >= b
        b = tl.sum((at_least >= need).to(tl.int32), axis=0) - 1          # T's byte
        need -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix = prefix | (b.to(tl.int64) << shift)
    if LIMIT:
        lim = tl.load(lim_ptr + row)
    eq_seen = tl.full((), 0, tl.int32)
    written = tl.full((), 0, tl.int32)
    dst_row = dst_ptr + row * dst_stride + ch * k
    for off in range(lo, hi, BLOCK):
        u, m, idx = _topk_tile(src_row, cand_row, off, lo, hi, BLOCK, GATHER)
        eq = (m & (u == prefix)).to(tl.int32)
        sel = (m & (u > prefix)) | ((eq != 0) & (eq_seen + tl.cumsum(eq, 0) - eq < need))
        s32 = sel.to(tl.int32)
        pos = written + tl.cumsum(s32, 0) - s32
        if LIMIT:
            idx = tl.where(idx < lim, idx, -1)
        tl.store(dst_row + pos, idx, mask=sel)
        eq_seen += tl.sum(eq, axis=0)
        written += tl.sum(s32, axis=0)


def _topk_launch(src: torch.Tensor, cand: torch.Tensor | None, dst: torch.Tensor, limit: torch.Tensor | None,
                 n: int, k: int, chunk: int) -> None:
    """One launch: the top ``k`` of each ``chunk`` of the ``n`` elements of every row (scores, or
    the candidates ``cand`` picked from them) into ``dst [rows, ceil(n / chunk) * k]``."""
    rows = src.shape[0]
    # (candidates: always TOPK_BLOCK, so the number of candidates, which follows the row length, is
    # not part of the kernel's specialization: the warm-up's rows reach every variant long prompts do)
    block = TOPK_BLOCK if cand is not None else min(TOPK_BLOCK, max(16, triton.next_power_of_2(chunk)))
    _topk_kernel[(rows, triton.cdiv(n, chunk))](
        src, dst if cand is None else cand, dst, dst if limit is None else limit, n, k, chunk, src.stride(0),
        0 if cand is None else cand.stride(0), dst.stride(0), BLOCK=block, LIMIT=limit is not None,
        GATHER=cand is not None, num_warps=8 if block >= 4096 else 4)


def topk_indices_triton(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of :func:`dsv4.ops.reference.topk_indices` (same signature, same indices in the
    same order): one launch, one program a row, for rows up to :data:`TOPK_SPLIT` scores (a few rows:
    :data:`TOPK_BLOCK`); a longer row is cut into chunks ranked in parallel, then their picks (the row's top ``k`` is among them,
    ties included: a chunk keeps its lowest indices) are ranked together, in levels until they fit."""
    if not scores.is_floating_point() or scores.dim() < 1:
        raise AttentionKernelError(f"scores must be a float tensor [..., n], got {scores.dtype} {tuple(scores.shape)}")
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise AttentionKernelError(f"k = {k} outside [0, {n}]")
    if n >= 1 << 30:
        raise AttentionKernelError(f"rows of {n} scores do not fit the kernel's 32-bit counts")
    lead = scores.shape[:-1]
    if limit is not None:
        _check_int(limit, "limit", tuple(lead), scores.device)
        limit = limit.reshape(-1)
        if limit.stride(0) != 1:
            raise AttentionKernelError("limit must be contiguous")
    out = runtime.empty((*lead, k), torch.int64, scores.device)
    rows = out.numel() // max(1, k)
    if k == 0 or rows == 0:
        return out
    src = scores.reshape(-1, n)
    if src.stride(-1) != 1:
        src = src.contiguous()
    cand, m = None, n
    # a chunk of a level is at least 2k elements, so each level shrinks the candidates
    # (H100, bench/topk_bench.py: TOPK_BLOCK chunks took one row of 16384 / 65536 scores from 73 / 102
    # to 49 / 66-82 us, 32 rows of 16384 from 74 to 51 us, but 32 rows of 65536, 128 programs with
    # TOPK_SPLIT chunks, from 101-105 to 126-143 us: the extra level costs more than it spreads)
    fine = 2 * rows * triton.cdiv(n, TOPK_SPLIT) < runtime.sm_count(scores.device)
    chunk = max(TOPK_BLOCK if fine else TOPK_SPLIT, 2 * k)
    while m > chunk:
        picks = torch.full((rows, triton.cdiv(m, chunk) * k), -1, dtype=torch.int64, device=scores.device)
        _topk_launch(src, cand, picks, None, m, k, chunk)
        cand, m = picks, picks.shape[1]
    _topk_launch(src, cand, out.view(rows, k), limit, m, k, m)
    return out


REGISTRATIONS = [
    ("indexer_scores", None, indexer_scores_triton),
    ("topk_indices", None, topk_indices_triton),
]

__all__ = ["indexer_scores_triton", "topk_indices_triton", "REGISTRATIONS"]
