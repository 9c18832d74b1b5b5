"""Plain-torch definitions of the fused decode ops: each is a composition of the ops in
:mod:`dsv4.ops.reference` (and of the cache's own row rounding), written so a kernel can do the
whole chain in one launch. They are the spec the fused kernels are tested against; the model
calls them through :mod:`dsv4.ops.fused`.

Re-exported by :mod:`dsv4.ops.reference` (so ``dsv4.ops.register`` knows them).
"""

from __future__ import annotations

import torch

from .reference import (apply_rope, compress_windows, fp4_sim, hadamard, hc_head, linear, mhc_post, mhc_pre,
                        rms_norm, rms_norm_unweighted)


def mhc_pre_norm(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                 norm_eps: float, hc_eps: float, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's input: the mHC pre collapse, then the block's RMSNorm (``attn_norm`` / ``ffn_norm``,
    ``weight [D]``, ``eps``) of the collapsed ``y``. Returns ``(normed y [..., D] h.dtype, post,
    comb)`` as :func:`mhc_pre` does."""
    y, post, comb = mhc_pre(h, fn, base, scale, iters, norm_eps, hc_eps)
    return rms_norm(y, weight, eps), post, comb


def mhc_post_pre_norm(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      base: torch.Tensor, scale: torch.Tensor, iters: int, norm_eps: float, hc_eps: float,
                      weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mixer's post then the next mixer's pre and norm (a block's attention output mixed back
    into the streams, then the MoE's input): ``h_next = mhc_post(out, h, post, comb)`` and
    :func:`mhc_pre_norm` of it with the next mixer's ``fn, base, scale`` and norm. Returns
    ``(h_next [..., nc, D], normed y [..., D], post [..., nc], comb [..., nc, nc])``."""
    h_next = mhc_post(out, h, post, comb)
    return (h_next, *mhc_pre_norm(h_next, fn, base, scale, iters, norm_eps, hc_eps, weight, eps))


def hc_head_norm(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                 hc_eps: float, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The head's input: the final collapse :func:`hc_head`, then the final RMSNorm (``weight [D]``)."""
    return rms_norm(hc_head(h, fn, base, scale, norm_eps, hc_eps), weight, eps)


def linear_pair(x: torch.Tensor, w1: object, w2: object, act_quant: bool = False, pow2: bool = True,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Two projections of the same input (attention's ``wq_a`` and ``wkv``): ``(linear(x, w1),
    linear(x, w2))`` with the same numerics each (:func:`dsv4.ops.reference.linear`)."""
    return linear(x, w1, act_quant, pow2, out_dtype), linear(x, w2, act_quant, pow2, out_dtype)


def rope_qnorm(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The query path: per-head RMS normalisation without weight, then RoPE on the last
    ``rd = 2 * cos.shape[-1]`` dims. ``q [..., H, hd]``, ``cos``/``sin`` broadcast against
    ``q[..., :rd // 2]``. Returns ``q.dtype``."""
    return apply_rope(rms_norm_unweighted(q, eps), cos, sin)


def q_kv_prepare(qa: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv: torch.Tensor, kv_weight: torch.Tensor,
                 kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, store: object,
                 slot_idx: torch.Tensor | None = None, row_idx: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows ``wq_a || wkv`` produce, made ready: ``(q_norm(qa), kv)``.

    ``q_norm``: RMSNorm of ``qa [..., q_lora_rank]`` with ``q_weight`` (``qa.dtype``). The K=V path:
    ``kv_norm`` (RMSNorm of ``kv [..., hd]`` with ``kv_weight``), RoPE on the last ``rd`` dims, then
    the values as ``store`` (a ``dsv4.model.cache.RowStore``) keeps them: the FP8 round trip of the
    non-rope dims (``fp8`` layout) or a cast (``plain``), in ``store.dtype``. Without indices nothing
    is written (the caller stores the rows after attention); with ``slot_idx``, ``row_idx`` (shaped
    like ``kv[..., 0]``) the K=V rows are also written there (:func:`store_rows`: a decode step's
    window rows, whose ring rows no query of the step reads)."""
    y = store.round_trip(apply_rope(rms_norm(kv, kv_weight, kv_eps), cos, sin))
    if slot_idx is not None:
        store_rows(store, slot_idx, row_idx, y)
    return rms_norm(qa, q_weight, q_eps), y


def store_rows(store: object, slot_idx: torch.Tensor, row_idx: torch.Tensor, values: torch.Tensor) -> None:
    """Write ``values [..., dim]`` into ``store`` (a ``RowStore``) at ``(slot_idx, row_idx)`` (index
    tensors broadcast to ``values.shape[:-1]``), encoded in the store's layout (FP8 + e8m0 scale per
    64 + rope in the activation dtype; packed FP4 + e8m0 scale per 32; or a cast)."""
    store.write(slot_idx, row_idx, values)


def rope_hadamard(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp4: bool) -> torch.Tensor:
    """The indexer's query path: RoPE on the last ``rd`` dims, the normalised Walsh-Hadamard
    rotation over the last dim, and (QAT simulation) the FP4 round trip per 32. ``x.dtype``."""
    y = hadamard(apply_rope(x, cos, sin))
    return fp4_sim(y) if fp4 else y


def compressor_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object, slots: torch.Tensor,
                    positions: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, rotate: bool) -> torch.Tensor:
    """``S`` new tokens per slot through a KV compressor, one after the other (``S = 1``: a decode
    step; a few more: a verify step or a short chunk, what ``Compressor.forward`` does in ~60 ops).

    ``kv``, ``gate`` ``[B, S, width]`` (or ``[B, width]`` at ``S = 1``) fp32: the tokens' ``C`` and
    ``Z`` (without ``ape``) at ``positions [B, S]`` (or ``[B]``) in ``slots [B]``; ``state`` the
    compressor's ``CompressorState``; ``cos``/``sin`` ``[B, S, rd/2]`` (or ``[B, rd/2]``) at each
    token's window start ``positions // m * m``; ``rotate``: the indexer's Hadamard rotation.

    Each token's row goes into the open window (row ``pos % m``, gate plus ``ape``). When that
    closes the window, the entry (the window pooled as in :func:`compress_windows`, then RMSNorm
    with ``norm_weight``, RoPE, optionally Hadamard) is stored at index ``pos // m`` in the store's
    layout, the window rows are cleared and (overlap) the window's ``a`` halves become the
    previous window's. Writes other than the entry's may differ from the batched path only in the
    store's unread sink row. With ``S >= 2`` and a log (``state.log_kv``, speculative verify, at
    least ``S`` rows) the tokens' rows (``C``, ``Z + ape``) are logged at rows ``0 .. S - 1`` for
    the rollback, as ``Compressor.forward`` logs them.

    Returns ``(positions + 1) // m`` (shaped like ``positions``): the entries each query sees
    after its token (:meth:`ForwardContext.visible_entries`), what the indexer and HCA attention
    mask by.
    """
    m, B = state.ratio, slots.shape[0]
    pos = positions.reshape(B, -1)
    S = pos.shape[1]
    kv, gate = kv.reshape(B, S, -1).float(), gate.reshape(B, S, -1).float()
    cos, sin = cos.reshape(B, S, -1), sin.reshape(B, S, -1)
    if S > 1 and state.log_kv is not None and S <= state.log_kv.shape[1]:
        state.log_kv[slots, :S] = kv
        state.log_gate[slots, :S] = gate + ape[pos % m]
    for i in range(S):
        _compressor_token(kv[:, i], gate[:, i], ape, state, slots, pos[:, i], norm_weight, eps, cos[:, i], sin[:, i],
                          rotate)
    return (positions + 1) // m


def _compressor_token(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object, slots: torch.Tensor,
                      pos: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                      rotate: bool) -> None:
    """One token per slot of :func:`compressor_step`: ``kv``, ``gate`` ``[B, width]``, ``pos [B]``,
    ``cos``/``sin`` ``[B, rd/2]``."""
    m, B = state.ratio, slots.shape[0]
    r = pos % m
    b = torch.arange(B, device=kv.device)
    win_kv = state.win_kv[slots].index_put((b, r), kv)                               # [B, m, width]
    win_gate = state.win_gate[slots].index_put((b, r), gate + ape[r])
    prev_kv = prev_gate = None
    if state.prev_kv is not None:
        prev_kv, prev_gate = state.prev_kv[slots], state.prev_gate[slots]
    entry = compress_windows(win_kv, win_gate, prev_kv, prev_gate)                     # [B, dim] fp32
    entry = apply_rope(rms_norm(entry, norm_weight, eps), cos, sin)
    if rotate:
        entry = hadamard(entry)
    closed = r == m - 1
    state.entries.write(slots, torch.where(closed, pos // m, state.max_entries), entry)
    open_ = ~closed.view(B, 1, 1)
    state.win_kv[slots] = torch.where(open_, win_kv, 0.0)
    state.win_gate[slots] = torch.where(open_, win_gate, 0.0)
    if prev_kv is not None:
        d = prev_kv.shape[-1]
        state.prev_kv[slots] = torch.where(open_, prev_kv, win_kv[..., :d])
        state.prev_gate[slots] = torch.where(open_, prev_gate, win_gate[..., :d])


def queries_prepare(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, iq: torch.Tensor,
                    fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A CSA layer's two query preparations at the same positions: the attention's
    (:func:`rope_qnorm` of ``q [..., H, hd]``) and the indexer's (:func:`rope_hadamard` of
    ``iq [..., nI, d]``); ``cos``/``sin`` broadcast against both (``[..., 1, rd/2]``)."""
    return rope_qnorm(q, cos, sin, eps), rope_hadamard(iq, cos, sin, fp4)


def compressor_step_pair(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object,
                         norm_weight: torch.Tensor, eps: float, rotate: bool, kv2: torch.Tensor, gate2: torch.Tensor,
                         ape2: torch.Tensor, state2: object, norm_weight2: torch.Tensor, eps2: float, rotate2: bool,
                         slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> torch.Tensor:
    """Two compressors' steps on the same tokens (a CSA layer's KV compressor and its indexer's:
    same slots, positions, ratio, hence the same window RoPE): :func:`compressor_step` of each.
    Returns their (common) visible entry counts."""
    visible = compressor_step(kv, gate, ape, state, slots, positions, norm_weight, eps, cos, sin, rotate)
    compressor_step(kv2, gate2, ape2, state2, slots, positions, norm_weight2, eps2, cos, sin, rotate2)
    return visible


def window_rollback(state: object, saved: tuple[torch.Tensor, ...], slots: torch.Tensor, start: torch.Tensor,
                    S: int, kept: torch.Tensor, plans: dict | None = None) -> None:
    """Roll a compressor's open (and, overlap, previous) window back after a forward of ``S >= 2``
    tokens at ``start [B]`` in ``slots [B]`` that logged its window rows (``state.log_kv`` /
    ``log_gate``, row ``i`` = position ``start + i``) and whose windows were copied into ``saved``
    (``CompressorState.save``: ``win_kv, win_gate[, prev_kv, prev_gate]`` of the slots, ``[B, m, ...]``)
    before it: keep its first ``kept [B]`` (0..S) positions, leaving what plain decoding of them
    leaves (:meth:`dsv4.model.cache.CompressorState.rollback` says how). ``plans``: a dict shared by
    the calls of one step, holding the index tensors (they depend only on ``m`` and the rows'
    positions). Pure selection: every value written is a copy of a logged or saved one, or zero."""
    m = state.ratio
    plans = {} if plans is None else plans
    if ("window", m) not in plans:
        sl, st = slots.unsqueeze(1), start.unsqueeze(1)
        length = (start + kept).unsqueeze(1)                                  # [B, 1]
        base = torch.div(length, m, rounding_mode="floor") * m                # the open window's first position
        closed = (base > st).unsqueeze(-1)                                    # a window closed at a kept position
        q = base + torch.arange(m, device=start.device)                       # [B, m] row r's position
        from_log = ((q < length) & (q >= st)).unsqueeze(-1)
        pq = q - m                                                            # the previous window's rows
        plans[("window", m)] = (sl, closed, from_log, (q - st).clamp(0, S - 1), (pq >= st).unsqueeze(-1),
                                (pq - st).clamp(0, S - 1))
    sl, closed, from_log, lj, from_step, pj = plans[("window", m)]
    if state.prev_kv is not None:
        # the window that closed last at a kept position: its rows from the log, or (positions
        # before the step) from the window as it was
        d = state.prev_kv.shape[-1]
        for prev, log, win, old in ((state.prev_kv, state.log_kv, saved[0], saved[2]),
                                    (state.prev_gate, state.log_gate, saved[1], saved[3])):
            rows = torch.where(from_step, log[sl, pj], win)[..., :d]
            prev[slots] = torch.where(closed, rows, old)
    for t, log, old in ((state.win_kv, state.log_kv, saved[0]), (state.win_gate, state.log_gate, saved[1])):
        t[slots] = torch.where(from_log, log[sl, lj], torch.where(closed, 0.0, old))


def _ring_rows(start: torch.Tensor, n: int, R: int) -> torch.Tensor:
    """``[B, n]``: the ring rows ``(start[b] + i) % R`` of positions ``start[b] + i``."""
    return (start.unsqueeze(1) + torch.arange(n, device=start.device)) % R


def rows_save(tensors: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor | None, n: int
              ) -> list[torch.Tensor]:
    """Copies of ``n`` rows of slots ``slots [B]`` of each state tensor ``t [slots, R, ...]`` (any
    dtype), ``[B, n, ...]`` each: rows ``(start[b] + i) % R`` (a ring's rows of positions ``start ..
    start + n - 1``; ``n <= R``) or, with ``start`` None, rows ``0 .. n - 1`` (a whole window,
    ``n == R``). What a verify forward may overwrite, for :func:`rows_restore` or a window rollback."""
    if start is None:
        return [t[slots, :n] for t in tensors]
    rows = _ring_rows(start, n, tensors[0].shape[1])
    return [t[slots.unsqueeze(1), rows] for t in tensors]


def rows_restore(tensors: list[torch.Tensor], saved: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor,
                 kept: torch.Tensor) -> None:
    """Put back the ring rows :func:`rows_save` copied (``saved [B, n, ...]``, positions ``start[b] +
    i``) for the rejected positions, ``i >= kept[b]``; the kept ones stay as the forward wrote them."""
    n = saved[0].shape[1]
    rows = _ring_rows(start, n, tensors[0].shape[1])
    sl = slots.unsqueeze(1)
    undo = torch.arange(n, device=start.device) >= kept.unsqueeze(1)  # [B, n] rejected
    for t, old in zip(tensors, saved):
        u = undo.view(*undo.shape, *([1] * (old.dim() - 2)))
        t[sl, rows] = torch.where(u, old, t[sl, rows])


__all__ = ["linear_pair", "mhc_pre_norm", "mhc_post_pre_norm", "hc_head_norm", "rope_qnorm", "q_kv_prepare",
           "store_rows",
           "rope_hadamard", "compressor_step", "compressor_step_pair", "queries_prepare", "window_rollback",
           "rows_save", "rows_restore"]
