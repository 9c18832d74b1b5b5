"""A compressor's window rollback after a speculative verify step in one launch
(``window_rollback``, spec in ``dsv4.ops.reference_fused``): the torch composition takes ~16 small
ops per compressor (and every layer has one or two). And the saves before a verify forward and the
ring's restore after it (``rows_save`` / ``rows_restore``): every tensor of a layer's ring (FP8
values, scales, RoPE part) or of a compressor's windows in one launch, as bytes (the torch
composition: one gather per tensor to save, a gather, a select and a scatter per tensor to restore).

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

from . import runtime
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


#: tensors one rows_save / rows_restore launch copies (a ring: values, scales, RoPE part; a
#: compressor: both windows and, overlapping, both previous windows)
MAX_ROW_TENSORS = 4


@triton.jit
def _copy_bytes(src, dst, src_at, dst_at, nbytes, ok, BLK: tl.constexpr):
    for c0 in range(0, nbytes, BLK):
        c = c0 + tl.arange(0, BLK)
        m = (c < nbytes) & ok
        tl.store(dst + dst_at + c, tl.load(src + src_at + c, mask=m), mask=m)


@triton.jit
def _rows_kernel(s0, s1, s2, s3, d0, d1, d2, d3, nb0, nb1, nb2, nb3, slots_ptr, start_ptr, kept_ptr, R, n,
                 NT: tl.constexpr, POSITIONAL: tl.constexpr, RESTORE: tl.constexpr, BLK: tl.constexpr):
    """Program ``(b, i)``: row ``i`` of batch row ``b`` of each of the ``NT`` tensors (byte rows of
    ``nb0 ..`` bytes), between the state (``[slots, R, row]``: row ``(start + i) % R`` when
    ``POSITIONAL``, else ``i``) and the saved copy (``[B, n, row]``). Save: state -> copy. ``RESTORE``:
    copy -> state, for the rejected positions only (``i >= kept[b]``)."""
    b = tl.program_id(0)
    i = tl.program_id(1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if POSITIONAL:
        row = (tl.load(start_ptr + b).to(tl.int64) + i) % R
    else:
        row = i.to(tl.int64)
    state_row = slot * R + row
    saved_row = (b * n + i).to(tl.int64)
    if RESTORE:
        ok = i >= tl.load(kept_ptr + b)
        src_row, dst_row = saved_row, state_row
    else:
        ok = i >= 0
        src_row, dst_row = state_row, saved_row
    _copy_bytes(s0, d0, src_row * nb0, dst_row * nb0, nb0, ok, BLK)
    if NT > 1:
        _copy_bytes(s1, d1, src_row * nb1, dst_row * nb1, nb1, ok, BLK)
    if NT > 2:
        _copy_bytes(s2, d2, src_row * nb2, dst_row * nb2, nb2, ok, BLK)
    if NT > 3:
        _copy_bytes(s3, d3, src_row * nb3, dst_row * nb3, nb3, ok, BLK)


def _byte_rows(op: str, tensors: list[torch.Tensor], name: str) -> tuple[list[torch.Tensor], list[int]]:
    """Each ``[A, B, ...]`` tensor as contiguous bytes ``[A, B, row bytes]`` (views) and its row bytes."""
    check(1 <= len(tensors) <= MAX_ROW_TENSORS, op, f"takes 1 to {MAX_ROW_TENSORS} tensors, got {len(tensors)}")
    views, nbytes = [], []
    for t in tensors:
        check(t.dim() >= 2 and t.is_contiguous(), op, f"{name} tensors must be contiguous [slots, rows, ...]")
        v = t.reshape(t.shape[0], t.shape[1], -1).view(torch.uint8)
        views.append(v)
        nbytes.append(v.shape[-1])
    return views, nbytes


def _launch_rows(op: str, states: list[torch.Tensor], copies: list[torch.Tensor], nbytes: list[int],
                 slots: torch.Tensor, start: torch.Tensor | None, kept: torch.Tensor | None, R: int, n: int,
                 restore: bool) -> None:
    B = slots.shape[0]
    if B == 0 or n == 0:
        return
    srcs, dsts = (copies, states) if restore else (states, copies)
    pad = MAX_ROW_TENSORS - len(states)
    srcs, dsts, nb = srcs + [srcs[0]] * pad, dsts + [dsts[0]] * pad, nbytes + [0] * pad
    slots = slots.reshape(B).contiguous()
    start_t = slots if start is None else start.reshape(B).contiguous()
    kept_t = slots if kept is None else kept.reshape(B).contiguous()
    _rows_kernel[(B, n)](*srcs, *dsts, *nb, slots, start_t, kept_t, R, n, NT=len(states),
                         POSITIONAL=start is not None, RESTORE=restore, BLK=min(1024, pow2(max(nbytes))),
                         num_warps=4 if max(nbytes) >= 1024 else 1)


def rows_save_triton(tensors: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor | None, n: int
                     ) -> list[torch.Tensor]:
    op = "rows_save"
    views, nbytes = _byte_rows(op, tensors, "state")
    R = tensors[0].shape[1]
    check(all(t.shape[1] == R for t in tensors), op, "the tensors need the same rows a slot")
    check(n <= R if start is not None else n == R, op, f"{n} rows of {R}: a ring saves at most its rows, a window all")
    out = [runtime.empty((slots.shape[0], n, *t.shape[2:]), t.dtype, t.device) for t in tensors]
    _launch_rows(op, views, [o.view(o.shape[0], n, -1).view(torch.uint8) for o in out], nbytes, slots, start,
                 None, R, n, False)
    return out


def rows_restore_triton(tensors: list[torch.Tensor], saved: list[torch.Tensor], slots: torch.Tensor,
                        start: torch.Tensor, kept: torch.Tensor) -> None:
    op = "rows_restore"
    views, nbytes = _byte_rows(op, tensors, "state")
    copies, cbytes = _byte_rows(op, saved, "saved")
    check(len(saved) == len(tensors) and cbytes == nbytes, op, "saved must be rows_save's copies of these tensors")
    R, n = tensors[0].shape[1], saved[0].shape[1]
    check(all(t.shape[1] == R for t in tensors) and n <= R, op, "the tensors need the same rows a slot")
    _launch_rows(op, views, copies, nbytes, slots, start, kept, R, n, True)


REGISTRATIONS = [("window_rollback", None, window_rollback_triton), ("rows_save", None, rows_save_triton),
                 ("rows_restore", None, rows_restore_triton)]
