"""FP8 / FP4 rounding, the cache's row stores and the Hadamard rotation as Triton kernels.

- ``fp8_sim`` / ``fp4_sim``: round through e4m3 (scale per block, power of two or not) or e2m1
  (power-of-two scale per block) and back, bit-exact with ``dsv4.ops.numerics``. Grid: rows x
  block chunks; a program holds ``[ROWS, NB, BLOCK]`` and reduces the block amax over the last axis.
- ``store_rows``: encode rows into a ``RowStore`` (plain cast; FP8 e4m3 bytes + e8m0/fp32 scale
  per 64 + rope dims in the activation dtype; FP4 codes two a byte, low nibble first, + e8m0 per
  32) at device-side ``(slot, row)`` indices: one launch instead of quantize + three scatters.
  The bytes are assembled from integer bit operations (``numerics``).
- ``hadamard``: ``x @ H_n / sqrt(n)`` with the +-1 Sylvester matrix generated in registers
  (``H[i, j] = (-1)^popcount(i & j)``): a ``[BM, n] x [n, n]`` ``tl.dot`` (fp16/bf16 operands on
  the tensor cores, products exact; fp32 in IEEE mode), then one multiply by ``n^-1/2``.
- the indexer's query path (``rope_hadamard``, run by ``queries_prepare`` in
  :mod:`.small_queries` beside the attention's queries): RoPE on the last ``rd`` dims of each row,
  Hadamard, and (QAT) the FP4 round trip. The rotation is done on even/odd halves, so the
  Hadamard is two dots against ``H[0::2]`` and ``H[1::2]``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime
from .numerics import (e2m1_code, e2m1_to_f32, e4m3_bits, fp4_scale, fp8_round_trip, fp8_scale, pow2_to_e8m0,
                       quantize_e4m3)
from .small_util import broadcast_rows, check, check_float, pow2, row_stride, rows


# ----------------------------------------------------------------------------- fp8_sim / fp4_sim
@triton.jit(do_not_specialize=["R"])
def _sim_kernel(x_ptr, sx, y_ptr, R, N, BLOCK, NBLK, FP4: tl.constexpr, POW2: tl.constexpr, ROWS: tl.constexpr,
                NBC: tl.constexpr, BLKP: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    b = tl.program_id(1) * NBC + tl.arange(0, NBC)
    e = tl.arange(0, BLKP)
    col = b[None, :, None] * BLOCK + e[None, None, :]
    m = (r < R)[:, None, None] & (b < NBLK)[None, :, None] & (e < BLOCK)[None, None, :] & (col < N)
    r64 = r.to(tl.int64)[:, None, None]
    x = tl.load(x_ptr + r64 * sx + col, mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=2)[:, :, None]
    if FP4:
        s = fp4_scale(amax)
        y = e2m1_to_f32(e2m1_code(tl.div_rn(x, s))) * s
    else:
        y = fp8_round_trip(x, fp8_scale(amax, POW2))
    tl.store(y_ptr + r64 * N + col, y.to(y_ptr.dtype.element_ty), mask=m)


def _sim(op: str, x: torch.Tensor, block: int, fp4: bool, pow2_scales: bool) -> torch.Tensor:
    check_float(op, x=x)
    check(block >= 1, op, f"block {block}")
    N = x.shape[-1] if x.dim() else 1
    if fp4:
        check(N % 2 == 0, op, f"last dim {N} is odd; FP4 packs two values a byte")
    y = runtime.empty(x.shape, x.dtype, x.device)
    x2 = rows(x, N)
    R = x2.shape[0]
    if R == 0 or N == 0:
        return y
    nblk = triton.cdiv(N, block)
    blkp = pow2(block)
    nbc = max(1, min(pow2(nblk), 2048 // blkp))
    # one row count per program for every R: a variant per row-count bucket would be a compile
    # per new prompt-length class (the masked rows of a small R cost nothing but idle lanes)
    n_rows = max(1, 2048 // (nbc * blkp))
    grid = (triton.cdiv(R, n_rows), triton.cdiv(nblk, nbc))
    _sim_kernel[grid](x2, row_stride(x2), y, R, N, block, nblk, FP4=fp4, POW2=bool(pow2_scales), ROWS=n_rows,
                      NBC=nbc, BLKP=blkp, num_warps=4, enable_fp_fusion=False)
    return y


def fp8_sim_triton(x: torch.Tensor, block: int = 64, pow2: bool = True) -> torch.Tensor:
    return _sim("fp8_sim", x, block, False, pow2)


def fp4_sim_triton(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _sim("fp4_sim", x, block, True, True)


# ----------------------------------------------------------------------------- store_rows
@triton.jit(do_not_specialize=["ss0", "ss1", "sr0", "sr1", "L1"])
def _store_kernel(v_ptr, sv, slot_ptr, ss0, ss1, row_ptr, sr0, sr1, L1, rows_per_slot,
                  data_ptr, scale_ptr, rope_ptr, DIM, NOPE, NSCALE, LAYOUT: tl.constexpr, POW2: tl.constexpr,
                  NBP: tl.constexpr, QB: tl.constexpr, BR: tl.constexpr):
    r = tl.program_id(0)
    i0 = r // L1
    i1 = r % L1
    slot = tl.load(slot_ptr + i0 * ss0 + i1 * ss1).to(tl.int64)
    row = tl.load(row_ptr + i0 * sr0 + i1 * sr1).to(tl.int64)
    tgt = slot * rows_per_slot + row
    vrow = v_ptr + r.to(tl.int64) * sv
    b = tl.arange(0, NBP)[:, None]
    e = tl.arange(0, QB)[None, :]
    if LAYOUT == 0:                                        # plain: a cast
        col = b * QB + e
        m = col < DIM
        v = tl.load(vrow + col, mask=m, other=0.0)
        tl.store(data_ptr + tgt * DIM + col, v.to(data_ptr.dtype.element_ty), mask=m)
    elif LAYOUT == 1:                                      # fp8: e4m3 bytes + scale per QB + rope dims
        col = b * QB + e
        m = col < NOPE
        v = tl.load(vrow + col, mask=m, other=0.0).to(tl.float32)
        s = fp8_scale(tl.max(tl.abs(v), axis=1), POW2)                        # [NBP]
        q = quantize_e4m3(tl.div_rn(v, s[:, None]))
        tl.store(data_ptr + tgt * NOPE + col, e4m3_bits(q).to(tl.uint8), mask=m)
        bs = tl.arange(0, NBP)
        if POW2:
            sbits = pow2_to_e8m0(s)
            tl.store(scale_ptr + tgt * NSCALE + bs, sbits.to(tl.uint8), mask=bs < NSCALE)
        else:
            tl.store(scale_ptr + tgt * NSCALE + bs, s, mask=bs < NSCALE)
        rc = tl.arange(0, BR)
        rm = rc < DIM - NOPE
        rv = tl.load(vrow + NOPE + rc, mask=rm, other=0.0)
        tl.store(rope_ptr + tgt * (DIM - NOPE) + rc, rv.to(rope_ptr.dtype.element_ty), mask=rm)
    else:                                                  # fp4: codes two a byte (low nibble first) + e8m0
        col = b * (2 * QB) + 2 * e                         # QB = half the block: e indexes pairs
        me = col < DIM
        ve = tl.load(vrow + col, mask=me, other=0.0).to(tl.float32)
        vo = tl.load(vrow + col + 1, mask=me, other=0.0).to(tl.float32)
        s = fp4_scale(tl.maximum(tl.max(tl.abs(ve), axis=1), tl.max(tl.abs(vo), axis=1)))
        ce = e2m1_code(tl.div_rn(ve, s[:, None]))
        co = e2m1_code(tl.div_rn(vo, s[:, None]))
        tl.store(data_ptr + tgt * (DIM // 2) + col // 2, (ce | (co << 4)).to(tl.uint8), mask=me)
        bs = tl.arange(0, NBP)
        sbits = pow2_to_e8m0(s)
        tl.store(scale_ptr + tgt * NSCALE + bs, sbits.to(tl.uint8), mask=bs < NSCALE)


def _index2d(idx: torch.Tensor, lead: tuple[int, int], op: str, name: str) -> tuple[torch.Tensor, int, int]:
    """An index tensor broadcast to a 2-d ``lead`` as (tensor, stride0, stride1) without copying."""
    check(not idx.is_floating_point(), op, f"{name} has dtype {idx.dtype}; needs an integer dtype")
    try:
        ex = idx.expand(lead) if idx.dim() <= 2 else idx.reshape(lead)
    except RuntimeError:
        raise ValueError(f"{op} (triton): {name} of shape {tuple(idx.shape)} does not broadcast to {lead}") from None
    return ex, ex.stride(0), ex.stride(1)


def store_rows_triton(store: object, slot_idx: torch.Tensor, row_idx: torch.Tensor, values: torch.Tensor) -> None:
    op = "store_rows"
    check_float(op, values=values)
    layout = getattr(store, "layout", None)
    check(layout in ("plain", "fp8", "fp4"), op, f"unknown store layout {layout!r}")
    dim = store.dim
    check(values.shape[-1] == dim, op, f"values have last dim {values.shape[-1]}; the store holds {dim}")
    for t in store.tensors():
        check(t.is_contiguous() and t.device == values.device, op, "store tensors must be contiguous, on the "
              "values' device")
    lead = tuple(values.shape[:-1])
    if len(lead) != 2:
        lead2 = (1, math.prod(lead)) if len(lead) < 2 else (math.prod(lead[:-1]), lead[-1])
        shape = torch.broadcast_shapes(slot_idx.shape, row_idx.shape, lead)
        check(tuple(shape) == lead, op, f"indices {tuple(slot_idx.shape)}, {tuple(row_idx.shape)} do not broadcast "
              f"to {lead}")
        slot_idx = slot_idx.expand(lead).reshape(lead2)
        row_idx = row_idx.expand(lead).reshape(lead2)
        lead = lead2
    slot2, ss0, ss1 = _index2d(slot_idx, lead, op, "slot_idx")
    row2, sr0, sr1 = _index2d(row_idx, lead, op, "row_idx")
    v2 = rows(values, dim)
    R = v2.shape[0]
    if R == 0:
        return
    rows_per_slot = store.data.shape[1]
    if layout == "plain":
        data, scale, rope, nope, nscale, qb, code = store.data, store.data, store.data, dim, 1, 64, 0
    elif layout == "fp8":
        nope = store.data.shape[-1]
        check(store.scale.dtype == (torch.uint8 if store.pow2 else torch.float32), op,
              f"fp8 store with pow2={store.pow2} has {store.scale.dtype} scales")
        data, scale, rope, nscale, qb, code = store.data.view(torch.uint8), store.scale, store.rope, \
            store.scale.shape[-1], 64, 1
        check(nscale == triton.cdiv(nope, 64), op, f"{nscale} scales for {nope} FP8 values (one per 64)")
    else:
        data, scale, rope, nope, nscale, qb, code = store.data, store.scale, store.data, dim, store.scale.shape[-1], \
            16, 2
        check(nscale == triton.cdiv(dim, 32), op, f"{nscale} scales for {dim} FP4 values (one per 32)")
    span = nope if code != 2 else dim
    nbp = pow2(triton.cdiv(span, 2 * qb if code == 2 else qb))
    _store_kernel[(R,)](v2, row_stride(v2), slot2, ss0, ss1, row2, sr0, sr1, lead[1], rows_per_slot,
                        data, scale, rope, dim, nope, nscale, LAYOUT=code, POW2=bool(store.pow2), NBP=nbp, QB=qb,
                        BR=pow2(max(dim - nope, 1)), num_warps=4, enable_fp_fusion=False)


# ----------------------------------------------------------------------------- hadamard
@triton.jit
def _sign_pm1(i, j):
    """``(-1)^popcount(i & j)`` for ``i, j < 256`` (fp32)."""
    p = i & j
    p ^= p >> 4
    p ^= p >> 2
    p ^= p >> 1
    return 1.0 - 2.0 * (p & 1).to(tl.float32)


@triton.jit
def _mul_pm1(x, h, IEEE: tl.constexpr, DOT: tl.constexpr):
    """``x [BM, K] @ h [K, N]`` for a +-1 matrix ``h``, fp32 result: ``tl.dot`` (IEEE fp32, or on the
    tensor cores in x's half dtype: exact products) when the tile allows it, else a broadcast
    product summed over K (small ``n``)."""
    if DOT:
        if IEEE:
            return tl.dot(x, h, input_precision="ieee")
        return tl.dot(x, h.to(x.dtype))
    return tl.sum(x.to(tl.float32)[:, :, None] * h[None, :, :], axis=1)


@triton.jit(do_not_specialize=["R"])
def _hadamard_kernel(x_ptr, sx, cos_ptr, sin_ptr, y_ptr, R, G, RD2, scale,
                     N: tl.constexpr, BM: tl.constexpr, ROPE: tl.constexpr, FP4: tl.constexpr, IEEE: tl.constexpr,
                     DOT: tl.constexpr, FB: tl.constexpr):
    _hadamard_rows(tl.program_id(0), x_ptr, sx, cos_ptr, sin_ptr, y_ptr, R, G, RD2, scale, N, BM, ROPE, FP4, IEEE,
                   DOT, FB)


@triton.jit
def _hadamard_rows(pid, x_ptr, sx, cos_ptr, sin_ptr, y_ptr, R, G, RD2, scale,
                   N: tl.constexpr, BM: tl.constexpr, ROPE: tl.constexpr, FP4: tl.constexpr, IEEE: tl.constexpr,
                   DOT: tl.constexpr, FB: tl.constexpr):
    """Program ``pid``'s ``BM`` rows: RoPE (``ROPE``), the Hadamard rotation, the FP4 round trip (``FP4``)."""
    XDT: tl.constexpr = x_ptr.dtype.element_ty
    r = pid * BM + tl.arange(0, BM)
    rm = r < R
    r64 = r.to(tl.int64)
    p = tl.arange(0, N // 2)                                            # pair index
    j = tl.arange(0, N)
    xe = tl.load(x_ptr + r64[:, None] * sx + 2 * p[None, :], mask=rm[:, None], other=0.0)
    xo = tl.load(x_ptr + r64[:, None] * sx + 2 * p[None, :] + 1, mask=rm[:, None], other=0.0)
    if ROPE:
        first = N // 2 - RD2                                            # first rotated pair
        pr = p[None, :] - first
        rot = rm[:, None] & (pr >= 0)
        t = (r64 // G)[:, None] * RD2 + pr
        c = tl.load(cos_ptr + t, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t, mask=rot, other=0.0).to(tl.float32)
        a = xe.to(tl.float32)
        b = xo.to(tl.float32)
        xe = tl.where(rot, (a * c - b * s).to(XDT), xe)
        xo = tl.where(rot, (a * s + b * c).to(XDT), xo)
    he = _sign_pm1(2 * p[:, None], j[None, :])                          # H[0::2]  [N/2, N]
    ho = _sign_pm1(2 * p[:, None] + 1, j[None, :])                      # H[1::2]
    if IEEE:
        xe = xe.to(tl.float32)
        xo = xo.to(tl.float32)
    y = _mul_pm1(xe, he, IEEE, DOT) + _mul_pm1(xo, ho, IEEE, DOT)       # [BM, N] fp32
    y = (y * scale).to(XDT)
    if FP4:                                                             # blocks of 32 (one block if N < 32)
        y3 = tl.reshape(y.to(tl.float32), [BM, N // FB, FB])
        sc = fp4_scale(tl.max(tl.abs(y3), axis=2))[:, :, None]
        y = tl.reshape(e2m1_to_f32(e2m1_code(tl.div_rn(y3, sc))) * sc, [BM, N]).to(XDT)
    tl.store(y_ptr + r64[:, None] * N + j[None, :], y, mask=rm[:, None])


def _hadamard(op: str, x: torch.Tensor, cos=None, sin=None, fp4: bool = False) -> torch.Tensor:
    y, args, consts, programs = hadamard_plan(op, x, cos, sin, fp4)
    if programs:
        _hadamard_kernel[(programs,)](*args, **consts, num_warps=4, enable_fp_fusion=False)
    return y


def hadamard_plan(op: str, x: torch.Tensor, cos=None, sin=None, fp4: bool = False
                  ) -> tuple[torch.Tensor, tuple, dict, int]:
    """Check a Hadamard row op and allocate its output: ``(y, arguments, constexprs, programs)``."""
    check_float(op, x=x)
    n = x.shape[-1]
    check(n & (n - 1) == 0 and 2 <= n <= 256, op, f"last dim {n}: the kernel does powers of two from 2 to 256")
    lead = tuple(x.shape[:-1])
    x2 = rows(x, n)
    R = x2.shape[0]
    y = runtime.empty(x.shape, x.dtype, x.device)
    rd2, g = 1, 1
    if cos is not None:
        rd2 = cos.shape[-1]
        check(sin.shape == cos.shape and 0 < 2 * rd2 <= n, op, f"cos {tuple(cos.shape)} / sin {tuple(sin.shape)} "
              f"do not fit rows of {n}")
        cos, g = broadcast_rows(cos, lead, rd2, op, "cos")
        sin, _ = broadcast_rows(sin, lead, rd2, op, "sin")
    dot = n >= 32                                   # tl.dot tiles need K = n / 2 >= 16
    bm = 16 if dot else max(1, min(64, 4096 // (n * n // 2)))
    args = (x2, row_stride(x2), cos if cos is not None else x2, sin if sin is not None else x2, y, R, g, rd2,
            float(torch.tensor(n ** -0.5, dtype=torch.float32)))
    consts = dict(N=n, BM=bm, ROPE=cos is not None, FP4=bool(fp4), IEEE=x.dtype == torch.float32, DOT=dot,
                  FB=min(32, n))
    return y, args, consts, triton.cdiv(R, bm)


def hadamard_triton(x: torch.Tensor) -> torch.Tensor:
    return _hadamard("hadamard", x)


REGISTRATIONS = [
    ("fp8_sim", None, fp8_sim_triton),
    ("fp4_sim", None, fp4_sim_triton),
    ("store_rows", None, store_rows_triton),
    ("hadamard", None, hadamard_triton),
]
