"""Dispatch of the fused decode ops (their specs: :mod:`dsv4.ops.reference_fused`).

Same rules as :mod:`dsv4.ops`: each call picks the kernel registered for ``(op, device type)``,
else the plain-torch reference (also when the kernel does not cover the call). The model calls ``ops.fused.<op>(...)``.
"""

from __future__ import annotations

import torch

from . import _call, _fmt


def linear_pair(x: torch.Tensor, w1: object, w2: object, act_quant: bool = False, pow2: bool = True,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x @ w1.T, x @ w2.T)`` in one launch where a kernel takes both formats; see
    :func:`reference_fused.linear_pair` (dispatched on the first weight's format)."""
    return _call("linear_pair", x.device, _fmt(w1), x, w1, w2, act_quant, pow2, out_dtype)


def mhc_pre_norm(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                 norm_eps: float, hc_eps: float, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC pre then the block's RMSNorm; see :func:`reference_fused.mhc_pre_norm`."""
    return _call("mhc_pre_norm", h.device, None, h, fn, base, scale, iters, norm_eps, hc_eps, weight, eps)


def mhc_post_pre_norm(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                      base: torch.Tensor, scale: torch.Tensor, iters: int, norm_eps: float, hc_eps: float,
                      weight: torch.Tensor, eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC post, then the next mixer's pre and RMSNorm; see :func:`reference_fused.mhc_post_pre_norm`."""
    return _call("mhc_post_pre_norm", h.device, None, out, h, post, comb, fn, base, scale, iters, norm_eps, hc_eps,
                 weight, eps)


def hc_head_norm(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
                 hc_eps: float, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The final stream collapse then the final RMSNorm; see :func:`reference_fused.hc_head_norm`."""
    return _call("hc_head_norm", h.device, None, h, fn, base, scale, norm_eps, hc_eps, weight, eps)


def rope_qnorm(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMS norm (no weight) then RoPE; see :func:`reference_fused.rope_qnorm`."""
    return _call("rope_qnorm", q.device, None, q, cos, sin, eps)


def q_kv_prepare(qa: torch.Tensor, q_weight: torch.Tensor, q_eps: float, kv: torch.Tensor, kv_weight: torch.Tensor,
                 kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, store: object,
                 slot_idx: torch.Tensor | None = None, row_idx: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_norm`` of the query's low-rank rows, and the K=V rows normed, rotated and rounded as stored
    (+ the write at ``slot_idx, row_idx``); see :func:`reference_fused.q_kv_prepare`."""
    return _call("q_kv_prepare", kv.device, None, qa, q_weight, q_eps, kv, kv_weight, kv_eps, cos, sin, store,
                 slot_idx, row_idx)


def store_rows(store: object, slot_idx: torch.Tensor, row_idx: torch.Tensor, values: torch.Tensor) -> None:
    """Encode and write rows into a ``RowStore``; see :func:`reference_fused.store_rows`."""
    return _call("store_rows", values.device, None, store, slot_idx, row_idx, values)


def compressor_step(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object, slots: torch.Tensor,
                    positions: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                    sin: torch.Tensor, rotate: bool) -> torch.Tensor:
    """A KV compressor's decode update in one call; returns the visible entry counts ``(positions +
    1) // m``. See :func:`reference_fused.compressor_step`."""
    return _call("compressor_step", kv.device, None, kv, gate, ape, state, slots, positions, norm_weight, eps,
                                                        cos, sin, rotate)


def queries_prepare(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, iq: torch.Tensor,
                    fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_qnorm(q)`` and ``rope_hadamard(iq)`` in one call; see :func:`reference_fused.queries_prepare`."""
    return _call("queries_prepare", q.device, None, q, cos, sin, eps, iq, fp4)


def compressor_step_pair(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, state: object,
                         norm_weight: torch.Tensor, eps: float, rotate: bool, kv2: torch.Tensor, gate2: torch.Tensor,
                         ape2: torch.Tensor, state2: object, norm_weight2: torch.Tensor, eps2: float, rotate2: bool,
                         slots: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> torch.Tensor:
    """Two compressors' decode steps in one call (returns the visible entry counts); see
    :func:`reference_fused.compressor_step_pair`."""
    return _call("compressor_step_pair", kv.device, None, kv, gate, ape, state, norm_weight, eps, rotate, kv2, gate2,
                 ape2, state2, norm_weight2, eps2, rotate2, slots, positions, cos, sin)


def window_rollback(state: object, saved: tuple[torch.Tensor, ...], slots: torch.Tensor, start: torch.Tensor,
                    S: int, kept: torch.Tensor, plans: dict | None = None) -> None:
    """A compressor's windows rolled back after a verify forward; see :func:`reference_fused.window_rollback`."""
    return _call("window_rollback", start.device, None, state, saved, slots, start, S, kept, plans)


def rows_save(tensors: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor | None, n: int
              ) -> list[torch.Tensor]:
    """Copies of the state rows a verify forward may overwrite, every tensor in one launch; see
    :func:`reference_fused.rows_save`."""
    return _call("rows_save", slots.device, None, tensors, slots, start, n)


def rows_restore(tensors: list[torch.Tensor], saved: list[torch.Tensor], slots: torch.Tensor, start: torch.Tensor,
                 kept: torch.Tensor) -> None:
    """The rejected positions' ring rows put back, every tensor in one launch; see
    :func:`reference_fused.rows_restore`."""
    return _call("rows_restore", slots.device, None, tensors, saved, slots, start, kept)


__all__ = ["linear_pair", "mhc_pre_norm", "mhc_post_pre_norm", "hc_head_norm", "rope_qnorm", "q_kv_prepare",
           "store_rows",
           "compressor_step", "compressor_step_pair", "queries_prepare", "window_rollback",
           "rows_save", "rows_restore"]
