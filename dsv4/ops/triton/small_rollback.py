"""A compressor's window rollback after a speculative verify step in one launch
(``window_rollback``, spec in ``dsv4.ops.reference_fused``): the torch composition takes ~16 small
ops per compressor (and every layer has one or two).

Grid: one program per (row of the batch, window row ``r``). With ``length = start + kept`` and
``base = length // m * m`` (the open window's first position), window row ``r`` holds position
``q = base + r``: its logged row when the step wrote it and it was kept, else zero when a window
closed at a kept position, else the saved row. The previous window (overlap) is the one before:
rows at ``q - m`` from the log or the saved window, first ``dim`` channels, when a window closed,
else the saved previous window. Every value is a copy (or zero): bit-exact with the reference.
Reads go to the log and the saved copies only, writes to the state: no program reads what another
writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .small_util import check, pow2


@triton.jit
def _win_rows(src, old, dst, log_at, old_at, win_at, W, from_log, closed, BLK: tl.constexpr):
    """Open window row: the logged row, else zero (a window closed), else the saved row."""
    for c0 in range(0, W, BLK):
        cols = c0 + tl.arange(0, BLK)
        cm = cols < W
        keep = tl.where(closed, 0.0, tl.load(old + old_at + cols, mask=cm, other=0.0))
        logged = tl.load(src + log_at + cols, mask=cm & from_log, other=0.0)
        tl.store(dst + win_at + cols, tl.where(from_log, logged, keep), mask=cm)


@triton.jit
def _prev_rows(src, old, oldp, dst, plog_at, old_at, oldp_at, prev_at, D, from_step, closed, BLK: tl.constexpr):
    """Previous window row (first ``D`` channels): when a window closed, the row before from the
    log or the saved window; else the saved previous row."""
    for c0 in range(0, D, BLK):
        cols = c0 + tl.arange(0, BLK)
        cm = cols < D
        logged = tl.load(src + plog_at + cols, mask=cm & from_step, other=0.0)
        rows = tl.where(from_step, logged, tl.load(old + old_at + cols, mask=cm, other=0.0))
        kept = tl.load(oldp + oldp_at + cols, mask=cm, other=0.0)
        tl.store(dst + prev_at + cols, tl.where(closed, rows, kept), mask=cm)


@triton.jit
def _window_rollback_kernel(win_kv_ptr, win_g_ptr, prev_kv_ptr, prev_g_ptr, log_kv_ptr, log_g_ptr,
                            old_kv_ptr, old_g_ptr, oldp_kv_ptr, oldp_g_ptr, slots_ptr, start_ptr, kept_ptr,
                            S, LOG_ROWS, M, W, D, OVERLAP: tl.constexpr, BLK: tl.constexpr):
    b = tl.program_id(0)
    r = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    st = tl.load(start_ptr + b).to(tl.int64)
    length = st + tl.load(kept_ptr + b).to(tl.int64)
    base = length // M * M                      # the open window's first position (length >= 0)
    closed = base > st                          # a window closed at a kept position
    q = base + r                                # this row's position
    from_log = (q < length) & (q >= st)
    lj = tl.minimum(tl.maximum(q - st, 0), S - 1)
    old_at = (b * M + r).to(tl.int64) * W
    # the previous window first (it reads the saved window only, as the open window's rows do)
    if OVERLAP:
        pq = q - M
        from_step = pq >= st
        pj = tl.minimum(tl.maximum(pq - st, 0), S - 1)
        plog_at = (slot * LOG_ROWS + pj) * W
        prev_at = (slot * M + r) * D
        oldp_at = (b * M + r).to(tl.int64) * D
        _prev_rows(log_kv_ptr, old_kv_ptr, oldp_kv_ptr, prev_kv_ptr, plog_at, old_at, oldp_at, prev_at, D,
                   from_step, closed, BLK)
        _prev_rows(log_g_ptr, old_g_ptr, oldp_g_ptr, prev_g_ptr, plog_at, old_at, oldp_at, prev_at, D,
                   from_step, closed, BLK)
    log_at = (slot * LOG_ROWS + lj) * W
    win_at = (slot * M + r) * W
    _win_rows(log_kv_ptr, old_kv_ptr, win_kv_ptr, log_at, old_at, win_at, W, from_log, closed, BLK)
    _win_rows(log_g_ptr, old_g_ptr, win_g_ptr, log_at, old_at, win_at, W, from_log, closed, BLK)


def window_rollback_triton(state: object, saved: tuple[torch.Tensor, ...], slots: torch.Tensor,
                           start: torch.Tensor, S: int, kept: torch.Tensor, plans: dict | None = None) -> None:
    op = "window_rollback"
    m, B = state.ratio, slots.shape[0]
    overlap = state.prev_kv is not None
    W = state.win_kv.shape[-1]
    D = state.prev_kv.shape[-1] if overlap else W
    check(state.log_kv is not None and 1 <= S <= state.log_kv.shape[1], op,
          f"needs the window log (enable_log) of at least {S} rows")
    check(len(saved) == (4 if overlap else 2), op, f"saved holds {len(saved)} tensors")
    named = [("win_kv", state.win_kv), ("win_gate", state.win_gate), ("log_kv", state.log_kv),
             ("log_gate", state.log_gate), ("saved win_kv", saved[0]), ("saved win_gate", saved[1])]
    if overlap:
        named += [("prev_kv", state.prev_kv), ("prev_gate", state.prev_gate), ("saved prev_kv", saved[2]),
                  ("saved prev_gate", saved[3])]
    for name, t in named:
        check(t.dtype == torch.float32 and t.is_contiguous(), op, f"{name} must be contiguous fp32")
    for name, t in named[4:6] + named[8:]:
        want = (B, m, D if "prev" in name else W)
        check(tuple(t.shape) == want, op, f"{name} has shape {tuple(t.shape)}; needs {want}")
    if B == 0:
        return
    prev_kv = state.prev_kv if overlap else state.win_kv
    prev_g = state.prev_gate if overlap else state.win_gate
    oldp_kv = saved[2] if overlap else saved[0]
    oldp_g = saved[3] if overlap else saved[1]
    _window_rollback_kernel[(B, m)](
        state.win_kv, state.win_gate, prev_kv, prev_g, state.log_kv, state.log_gate, saved[0], saved[1],
        oldp_kv, oldp_g, slots.reshape(B).contiguous(), start.reshape(B).contiguous(), kept.reshape(B).contiguous(),
        S, state.log_kv.shape[1], m, W, D, OVERLAP=overlap, BLK=min(1024, pow2(W)), num_warps=4)


REGISTRATIONS = [("window_rollback", None, window_rollback_triton)]
