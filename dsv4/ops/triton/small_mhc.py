"""mHC (manifold-constrained hyper-connections) as Triton kernels: ``mhc_pre_norm`` (a block's
mHC pre and the RMSNorm after it), ``mhc_post`` and ``hc_head_norm`` (the final collapse and the
final norm) (DSV4_FACTS section 2, "mHC pre/post" and "Head"; the compositions they implement are
in :mod:`dsv4.ops.reference_fused`).

mhc_pre_norm / hc_head_norm: two launches; one for up to ``ONE_LAUNCH_MAX_TOKENS`` tokens (decode),
where the last program of step 1 to arrive (an arrival counter it re-arms) does step 2 for them.

1. ``_mix_partial_kernel``, grid ``(splits, token blocks)``: the skinny projection
   ``mix = x @ fn.T`` with ``x = h.flatten(nc*D)`` (fp32), split over K so that the
   ``(2+nc)*nc x nc*D`` fp32 ``fn`` (1.5 MB at Flash, 2.75 MB at Pro) is read once by ~all SMs.
   Each program multiplies a ``[TB, BK]`` slice of the tokens by a ``[BK, NP]`` slice of ``fn``
   (``tl.dot`` in IEEE fp32: exact products, fp32 sums) and also sums ``x^2``; it writes its
   partial ``[TB, NP]`` and ``[TB]`` sums (no atomics: the result does not depend on timing).
   For bf16 / fp16 activations (``SPLIT``, every batch) the fp32 ``fn`` slice is
   split into three parts of the activations' type (``f1 = fn``, ``f2``, ``f3`` the rounded remainders: exact for bf16,
   whose 8-bit exponent keeps every remainder; for fp16 to ~2^-22 of ``fn``) and multiplied on
   tensor cores, each product exact, fp32 sums (H100, Flash, 8192 tokens: ~1.15 ms a call on
   CUDA cores, 8.6% of a prefill step).
2. ``_mhc_finalize_kernel``, grid ``(tokens,)``: sums the partials in a fixed order,
   ``r = rsqrt(mean x^2 + eps)``, ``mix *= r``, the sigmoids, and for ``mhc_pre`` the softmax
   and the 20 Sinkhorn iterations on the ``nc x nc`` comb in registers; then the collapse
   ``y = sum_j pre_j h_j`` of the whole row in registers (cast to the activation dtype, as the
   reference hands it to the norm) and the RMSNorm of that row, the arithmetic of
   :mod:`.small_rows` (``w * (y * inv)``, ``inv = 1 / sqrt(mean y^2 + eps)``). It writes the
   normed row, ``post`` and ``comb``.

mhc_post: one launch, grid ``(tokens, D blocks)``: ``h_next[k] = post_k out + sum_j comb[j,k] h[j]``
in fp32, cast once.

mhc_post_pre_norm: a block's attention post and its MoE pre + ``ffn_norm`` with the launches of
mhc_pre_norm alone: step 1 makes each tile of the streams (the post's arithmetic, no FMA in
either kernel, so the streams equal mhc_post's bit for bit), writes it and projects it; step 2
reads the whole rows back.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime
from .small_util import KernelInputError, check, check_float, pow2, row_stride, rows

_BK = 128
_MAX_ROW = 16384
#: tokens above which mhc_post_pre_norm runs as its two kernels (prompts; decode and verify batches
#: keep the one fused op) and the projection takes 64-token blocks
PROMPT_MIN_TOKENS = 256
#: tokens up to which the last split of the projection finalizes them (one launch); above, a second
#: launch with a program a token
ONE_LAUNCH_MAX_TOKENS = 2


@triton.jit
def _post_tile(t, tm, k0, k, km, out_ptr, so, h_ptr, sh, post_ptr, comb_ptr, D, NC: tl.constexpr,
               ONE_STREAM: tl.constexpr):
    """``mhc_post`` of a ``[TB, BK]`` tile of the flattened streams (column ``k`` is stream
    ``k // D``, dim ``k % D``), fp32 with ``_mhc_post_kernel``'s operations in its order.
    ``ONE_STREAM``: ``BK`` divides ``D``, so the tile (from ``k0``) lies in one stream (V4's widths:
    the post weights are then per token, not gathered per element, which saves registers)."""
    m = tm[:, None] & km[None, :]
    if ONE_STREAM:
        st = k0 // D
        d = k0 - st * D + tl.arange(0, k.shape[0])
        st_c = st + tl.zeros([1, 1], tl.int32)                                    # [1, 1]
    else:
        st = tl.where(km, k, 0) // D                                            # [BK] stream
        d = tl.where(km, k, 0) - st * D
        st_c = st[None, :]
    # a split's last tile may lie wholly past K (ONE_STREAM: stream NC, one past the last): the
    # per-token weights are read for streams that exist only, and the tile is zeros past K (it
    # feeds the projection's dot; a weight read past the last token's row once put NaN there)
    sm = tm[:, None] & (st_c < NC)
    t64 = t.to(tl.int64)[:, None]
    mm = tl.zeros(m.shape, tl.float32)
    for jj in tl.static_range(NC):
        hj = tl.load(h_ptr + t64 * sh + jj * D + d[None, :], mask=m, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t[:, None] * (NC * NC) + jj * NC + st_c, mask=sm, other=0.0)  # comb[j, k]
        mm += cj * hj
    o = tl.load(out_ptr + t64 * so + d[None, :], mask=m, other=0.0).to(tl.float32)
    p = tl.load(post_ptr + t[:, None] * NC + st_c, mask=sm, other=0.0)
    return tl.where(m, p * o + mm, 0.0)


@triton.jit(do_not_specialize=["T"])
def _mix_partial_kernel(x_ptr, sx, fn_ptr, part_ptr, ss_ptr, T, K, N, KCHUNK,
                        cnt_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr, comb_ptr, D, Kf, Df, iters,
                        norm_eps, hc_eps, eps, out_ptr, so, h_ptr, sh, prev_post_ptr, prev_comb_ptr,
                        NP: tl.constexpr, TB: tl.constexpr, BK: tl.constexpr, FINAL: tl.constexpr,
                        NC: tl.constexpr, NCP: tl.constexpr, SP: tl.constexpr, BD: tl.constexpr,
                        HEAD: tl.constexpr, POST: tl.constexpr, ONE_STREAM: tl.constexpr,
                        SPLIT: tl.constexpr = False):
    """Step 1 (and 2 with ``FINAL``) over the streams ``x``; with ``POST`` the streams are first
    made here, tile by tile: ``x = mhc_post(out, h, prev_post, prev_comb)`` written to ``x_ptr``
    (each element by the split that reads it; the finalizing program reads other splits' rows
    after the arrival counter's acquire). ``SPLIT``: the projection on tensor cores (16-bit ``x``)."""
    XT: tl.constexpr = x_ptr.dtype.element_ty
    pid_s = tl.program_id(0)
    t = tl.program_id(1) * TB + tl.arange(0, TB)
    n = tl.arange(0, NP)
    tm = t < T
    acc = tl.zeros([TB, NP], tl.float32)
    ss = tl.zeros([TB], tl.float32)
    k_lo = pid_s * KCHUNK
    kk = 0
    while kk < KCHUNK:              # (while, not range: Triton's interpreter under numpy 2.4 needs it)
        k = k_lo + kk + tl.arange(0, BK)
        km = k < K
        xo = x_ptr + t.to(tl.int64)[:, None] * sx + k[None, :]
        if POST:
            x = _post_tile(t, tm, k_lo + kk, k, km, out_ptr, so, h_ptr, sh, prev_post_ptr, prev_comb_ptr, D, NC,
                           ONE_STREAM).to(XT)
            tl.store(xo, x, mask=tm[:, None] & km[None, :])
        else:
            x = tl.load(xo, mask=tm[:, None] & km[None, :], other=0.0)
        f = tl.load(fn_ptr + n[None, :].to(tl.int64) * K + k[:, None], mask=km[:, None] & (n[None, :] < N),
                    other=0.0)
        if SPLIT:
            # fn = f1 + f2 + f3 in x's 16-bit type (each remainder exact in fp32): three tensor-core dots
            # of exact products, fp32 sums, instead of an fp32 dot on CUDA cores
            f1 = f.to(XT)
            r = f - f1.to(tl.float32)
            f2 = r.to(XT)
            f3 = (r - f2.to(tl.float32)).to(XT)
            # (a fresh accumulator per K tile, added in fp32: the tensor cores' accumulation of a
            # whole 16K-28K row drifts by a few 1e-5 of the mix at 4096 tokens)
            part = tl.dot(x, f3)
            part = tl.dot(x, f2, part)
            part = tl.dot(x, f1, part)
            acc += part
            x = x.to(tl.float32)
        else:
            x = x.to(tl.float32)
            acc = tl.dot(x, f, acc, input_precision="ieee")
        ss += tl.sum(x * x, axis=1)
        kk += BK
    base = (pid_s * T + t).to(tl.int64)
    tl.store(part_ptr + base[:, None] * NP + n[None, :], acc, mask=tm[:, None])
    tl.store(ss_ptr + base, ss, mask=tm)
    if FINAL:
        # a few tokens: the last split to arrive finalizes them all (no second launch)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tt = pid_s * 0
            while tt < T:
                _finalize_token(tt, x_ptr, sx, part_ptr, ss_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr,
                                comb_ptr, T, D, Kf, Df, tl.num_programs(0), iters, norm_eps, hc_eps, eps, NC, NCP,
                                NP, SP, BD, HEAD)
                tt += 1
            tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")       # ready for the next call


@triton.jit
def _pick(v, idx, j):
    """``v[j]`` of a register vector (``idx`` its index vector) as a scalar."""
    return tl.sum(tl.where(idx == j, v, 0.0), axis=0)


@triton.jit
def _finalize_token(t, h_ptr, sh, part_ptr, ss_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr, comb_ptr,
                    T, D, Kf, Df, SPLITS, iters, norm_eps, hc_eps, eps,
                    NC: tl.constexpr, NCP: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                    BD: tl.constexpr, HEAD: tl.constexpr):
    """Token ``t``'s weights, collapse and norm from the ``SPLITS`` partial sums (step 2 above)."""
    XDT: tl.constexpr = y_ptr.dtype.element_ty
    s = tl.arange(0, SP)
    n = tl.arange(0, NP)
    sm = s < SPLITS
    prow = (s * T + t).to(tl.int64)
    mix = tl.sum(tl.load(part_ptr + prow[:, None] * NP + n[None, :], mask=sm[:, None], other=0.0,
                         cache_modifier=".cg"), axis=0)
    ss = tl.sum(tl.load(ss_ptr + prow, mask=sm, other=0.0, cache_modifier=".cg"), axis=0)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, Kf) + norm_eps))
    mix = mix * r                                                               # [NP]

    j = tl.arange(0, NCP)
    jm = j < NC
    sel = n[None, :] == j[:, None]                                              # [NCP, NP]
    pre = tl.sum(tl.where(sel, mix[None, :], 0.0), axis=1)
    pre = tl.sigmoid(pre * tl.load(scale_ptr) + tl.load(base_ptr + j, mask=jm, other=0.0)) + hc_eps

    # collapse: y = sum_j pre_j h_j over the row, in stream order, in the activation dtype (read past
    # L1: with POST, other programs of this launch wrote the row)
    d = tl.arange(0, BD)
    dm = d < D
    hrow = h_ptr + t.to(tl.int64) * sh
    y = tl.zeros([BD], tl.float32)
    for jj in tl.static_range(NC):
        y += _pick(pre, j, jj) * tl.load(hrow + jj * D + d, mask=dm, other=0.0, cache_modifier=".cg").to(tl.float32)
    y = y.to(XDT).to(tl.float32)
    # the block's RMSNorm of y (small_rows' arithmetic)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(y * y, axis=0), Df) + eps))
    w = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * D + d, (w * (y * inv)).to(XDT), mask=dm)

    if not HEAD:
        post = tl.sum(tl.where(n[None, :] == NC + j[:, None], mix[None, :], 0.0), axis=1)
        post = 2.0 * tl.sigmoid(post * tl.load(scale_ptr + 1) + tl.load(base_ptr + NC + j, mask=jm, other=0.0))
        tl.store(post_ptr + t * NC + j, post, mask=jm)

        ci = tl.arange(0, NCP)[:, None]
        cj = tl.arange(0, NCP)[None, :]
        cm = (ci < NC) & (cj < NC)
        cidx = 2 * NC + ci * NC + cj                                           # [NCP, NCP]
        logit = tl.sum(tl.where(n[None, None, :] == cidx[:, :, None], mix[None, None, :], 0.0), axis=2)
        logit = logit * tl.load(scale_ptr + 2) + tl.load(base_ptr + cidx, mask=cm, other=0.0)
        logit = tl.where(cm, logit, -float("inf"))
        row_max = tl.max(logit, axis=1)
        e = tl.where(cm, tl.exp(logit - tl.where(ci < NC, row_max[:, None], 0.0)), 0.0)
        den = tl.sum(e, axis=1)
        comb = tl.where(cm, tl.div_rn(e, tl.where(ci < NC, den[:, None], 1.0)) + hc_eps, 0.0)
        # Sinkhorn: one column normalisation, then iters - 1 rounds of (row, column)
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
        it = 1
        while it < iters:
            comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
            it += 1
        tl.store(comb_ptr + t * NC * NC + ci * NC + cj, comb, mask=cm)


@triton.jit(do_not_specialize=["T", "SPLITS"])
def _mhc_finalize_kernel(h_ptr, sh, part_ptr, ss_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr, comb_ptr,
                         T, D, Kf, Df, SPLITS, iters, norm_eps, hc_eps, eps,
                         NC: tl.constexpr, NCP: tl.constexpr, NP: tl.constexpr, SP: tl.constexpr,
                         BD: tl.constexpr, HEAD: tl.constexpr):
    _finalize_token(tl.program_id(0), h_ptr, sh, part_ptr, ss_ptr, base_ptr, scale_ptr, w_ptr, y_ptr, post_ptr,
                    comb_ptr, T, D, Kf, Df, SPLITS, iters, norm_eps, hc_eps, eps, NC, NCP, NP, SP, BD, HEAD)


@triton.jit
def _mhc_post_kernel(out_ptr, so, h_ptr, sh, post_ptr, comb_ptr, y_ptr, D,
                     NC: tl.constexpr, NCP: tl.constexpr, BD: tl.constexpr):
    t = tl.program_id(0)
    d = tl.program_id(1) * BD + tl.arange(0, BD)
    dm = d < D
    k = tl.arange(0, NCP)
    km = k < NC
    t64 = t.to(tl.int64)
    mm = tl.zeros([NCP, BD], tl.float32)
    for jj in tl.static_range(NC):
        hj = tl.load(h_ptr + t64 * sh + jj * D + d, mask=dm, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * NC * NC + jj * NC + k, mask=km, other=0.0)     # comb[j, :]
        mm += cj[:, None] * hj[None, :]
    o = tl.load(out_ptr + t64 * so + d, mask=dm, other=0.0).to(tl.float32)
    p = tl.load(post_ptr + t * NC + k, mask=km, other=0.0)
    res = p[:, None] * o[None, :] + mm
    tl.store(y_ptr + t64 * (NC * D) + k[:, None] * D + d[None, :], res.to(y_ptr.dtype.element_ty),
             mask=km[:, None] & dm[None, :])


# ----------------------------------------------------------------------------- wrappers
def _splits(T: int, K: int, tb: int, device: torch.device) -> tuple[int, int]:
    """(number of K splits, K per split): ~2 programs per SM over (splits x token blocks)."""
    n_tb = triton.cdiv(T, tb)
    max_splits = triton.cdiv(K, _BK)
    splits = max(1, min(max_splits, (2 * runtime.sm_count(device)) // n_tb))
    kchunk = triton.cdiv(triton.cdiv(K, splits), _BK) * _BK
    return triton.cdiv(K, kchunk), kchunk


def _pre(op: str, h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n_mix: int,
         n_scale: int, iters: int, norm_eps: float, hc_eps: float, weight: torch.Tensor, eps: float, head: bool,
         prev: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
    """``(y, post, comb)`` of the streams ``h``; with ``prev = (out, post, comb)`` of the previous
    mixer, ``(h_next, y, post, comb)`` of ``h_next = mhc_post(out, h, *prev[1:])``, made in the same
    launch."""
    check_float(op, h=h, weight=weight)
    check(h.dim() >= 2, op, f"h has shape {tuple(h.shape)}; needs [..., nc, D]")
    nc, D = h.shape[-2], h.shape[-1]
    K = nc * D
    check(tuple(fn.shape) == (n_mix, K), op, f"fn has shape {tuple(fn.shape)}; needs ({n_mix}, {K})")
    check(fn.dtype == torch.float32, op, f"fn has dtype {fn.dtype}; needs float32 (it is an fp32 parameter)")
    check(tuple(base.shape) == (n_mix,), op, f"base has shape {tuple(base.shape)}; needs ({n_mix},)")
    check(scale.numel() >= n_scale, op, f"scale has {scale.numel()} values; needs {n_scale}")
    check(nc <= 8, op, f"{nc} streams; the kernel keeps the nc x nc comb in registers for nc <= 8")
    check(tuple(weight.shape) == (D,), op, f"norm weight has shape {tuple(weight.shape)}; needs ({D},)")
    check(D <= _MAX_ROW, op, f"rows of {D} values; the kernel holds at most {_MAX_ROW} in registers")
    lead = tuple(h.shape[:-2])
    T = math.prod(lead)
    dev = h.device
    post_args: tuple = (h, 0, h, 0, h, h)         # unread without prev
    if prev is None:
        x = rows(h, K)
    else:
        p_out, p_post, p_comb = _post_inputs(op, prev[0], h, prev[1], prev[2])
        h_next = runtime.empty(h.shape, h.dtype, dev)
        x = h_next.view(T, K)
        h_rows = rows(h, K)
        post_args = (p_out, row_stride(p_out), h_rows, row_stride(h_rows), p_post, p_comb)
    y = runtime.empty((*lead, D), h.dtype, dev)
    post = runtime.empty((*lead, nc), torch.float32, dev)
    comb = runtime.empty((*lead, nc, nc), torch.float32, dev)
    outs = (y, post, comb) if prev is None else (h_next, y, post, comb)
    if T == 0:
        return outs
    np_ = max(16, pow2(n_mix))
    one = T <= ONE_LAUNCH_MAX_TOKENS
    # 16-bit activations: the projection on tensor cores (SPLIT). The fp32 dot on CUDA cores pads a
    # decode token to a 16-row block: ~5 us a K tile on an H100 (bench/mhc_bench.py, 2026-11-28)
    split = h.dtype in (torch.bfloat16, torch.float16)
    tb = 16 if T <= 16 else 64 if split and T > PROMPT_MIN_TOKENS else 32
    splits, kchunk = _splits(T, K, tb, dev)
    part = torch.empty((splits, T, np_), dtype=torch.float32, device=dev)
    ss = torch.empty((splits, T), dtype=torch.float32, device=dev)
    fn = fn.contiguous()
    bd = pow2(D)
    try:
        cnt = runtime.counters(dev, 1, "mhc") if one else ss
    except runtime.CounterError as e:
        raise KernelInputError(str(e)) from None
    tail = (base.float().contiguous(), scale.float().contiguous(), weight.contiguous(), y, post, comb)
    # SP covers the most splits any T can get (splits shrink as T grows): one variant for every T
    fin = dict(NC=nc, NCP=pow2(nc), NP=np_, SP=pow2(triton.cdiv(K, _BK)), BD=bd, HEAD=head)
    _mix_partial_kernel[(splits, triton.cdiv(T, tb))](
        x, row_stride(x), fn, part, ss, T, K, n_mix, kchunk, cnt, *tail, D, float(K), float(D), int(iters),
        float(norm_eps), float(hc_eps), float(eps), *post_args, TB=tb, BK=_BK, FINAL=one, POST=prev is not None,
        ONE_STREAM=prev is not None and D % _BK == 0, SPLIT=split,
        num_warps=8 if one and bd >= 4096 else 4, enable_fp_fusion=False, **fin)
    if not one:
        _mhc_finalize_kernel[(T,)](
            x, row_stride(x), part, ss, *tail, T, D, float(K), float(D), splits, int(iters), float(norm_eps),
            float(hc_eps), float(eps), num_warps=8 if bd >= 4096 else 4, enable_fp_fusion=False, **fin)
    return outs


def mhc_pre_norm_triton(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                        norm_eps: float, hc_eps: float, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nc = h.shape[-2] if h.dim() >= 2 else 0
    return _pre("mhc_pre_norm", h, fn, base, scale, (2 + nc) * nc, 3, iters, norm_eps, hc_eps, weight, eps,
                head=False)


def hc_head_norm_triton(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                        hc_eps: float, weight: torch.Tensor, eps: float) -> torch.Tensor:
    nc = h.shape[-2] if h.dim() >= 2 else 0
    return _pre("hc_head_norm", h, fn, base, scale, nc, 1, 0, norm_eps, hc_eps, weight, eps, head=True)[0]


def _post_inputs(op: str, out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check ``mhc_post``'s inputs: ``(out [T, D] rows, post [T, nc], comb [T, nc*nc])`` fp32 contiguous."""
    check_float(op, out=out, h=h, post=post, comb=comb)
    check(h.dim() >= 2, op, f"h has shape {tuple(h.shape)}; needs [..., nc, D]")
    nc, D = h.shape[-2], h.shape[-1]
    lead = tuple(h.shape[:-2])
    check(tuple(out.shape) == (*lead, D), op, f"out has shape {tuple(out.shape)}; needs {(*lead, D)}")
    check(tuple(post.shape) == (*lead, nc), op, f"post has shape {tuple(post.shape)}; needs {(*lead, nc)}")
    check(tuple(comb.shape) == (*lead, nc, nc), op, f"comb has shape {tuple(comb.shape)}; needs {(*lead, nc, nc)}")
    T = math.prod(lead)
    return rows(out, D), post.float().reshape(T, nc).contiguous(), comb.float().reshape(T, nc * nc).contiguous()


def mhc_post_triton(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    o2, post2, comb2 = _post_inputs("mhc_post", out, h, post, comb)
    nc, D = h.shape[-2], h.shape[-1]
    y = runtime.empty(h.shape, h.dtype, h.device)
    T = post2.shape[0]
    if T == 0:
        return y
    h2 = rows(h, nc * D)
    bd = min(512, pow2(D))
    # no FMA contraction: the same roundings as the mix of mhc_post_pre_norm (its kernel's are off)
    _mhc_post_kernel[(T, triton.cdiv(D, bd))](o2, row_stride(o2), h2, row_stride(h2), post2, comb2, y, D,
                                             NC=nc, NCP=pow2(nc), BD=bd, num_warps=4, enable_fp_fusion=False)
    return y


def mhc_post_pre_norm_triton(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                             fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, norm_eps: float,
                             hc_eps: float, weight: torch.Tensor, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    nc = h.shape[-2] if h.dim() >= 2 else 0
    if h.dim() >= 2 and math.prod(h.shape[:-2]) > PROMPT_MIN_TOKENS:
        # a prompt: the two kernels (the same streams bit for bit); made in the projection's
        # launches they cost 12.6 ms at 8192 tokens on an H100 (4 layers), against 3.8 ms apart
        h_next = mhc_post_triton(out, h, post, comb)
        return (h_next, *mhc_pre_norm_triton(h_next, fn, base, scale, iters, norm_eps, hc_eps, weight, eps))
    return _pre("mhc_post_pre_norm", h, fn, base, scale, (2 + nc) * nc, 3, iters, norm_eps, hc_eps, weight, eps,
                head=False, prev=(out, post, comb))


REGISTRATIONS = [
    ("mhc_pre_norm", None, mhc_pre_norm_triton),
    ("mhc_post", None, mhc_post_triton),
    ("mhc_post_pre_norm", None, mhc_post_pre_norm_triton),
    ("hc_head_norm", None, hc_head_norm_triton),
]
