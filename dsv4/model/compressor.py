"""The KV compressor of CSA (ratio m with overlap) and HCA (ratio m', no overlap) layers.

DSV4_FACTS section 2, "Compressor". Per token, in fp32: ``C = x W_kv^T``, ``Z = x W_gate^T + ape[pos % m]``.
A window of ``m`` tokens that closes (``(pos + 1) % m == 0``) emits one entry:
HCA: ``sum softmax_m(Z) * C``; CSA: softmax over ``2m`` slots, the ``a`` halves of the previous
window and the ``b`` halves of this one. The entry is RMS-normed, rotated (RoPE at the window's
first position) and, under QAT simulation, rounded like the cache it simulates.

One code path serves prefill chunks and batched decode: the ``S`` new rows of each slot are
scattered into an aligned buffer behind the slot's open-window rows, every window of that buffer
is pooled, and closed ones are written to ``entries`` by a device-side mask (others go to the
sink row). No host read of positions, fixed shapes for a given ``(B, S)``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from .. import ops
from ..ops import fused
from .cache import CompressorState
from .common import ForwardContext, Linear, RMSNorm, fp32_param


class Compressor(nn.Module):
    """Parameters ``wkv``, ``wgate`` ``[width, D]``, ``ape [m, width]``, ``norm [dim]`` (official names).

    ``rotate``: entries get the indexer's Hadamard rotation after RoPE (what its ``finish`` does),
    for the fused decode step.
    """

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype,
                 rotate: bool = False):
        super().__init__()
        self.dim, self.ratio, self.overlap, self.rotate = dim, ratio, overlap, rotate
        width = 2 * dim if overlap else dim
        self.wkv = Linear(hidden, width, dtype)
        self.wgate = Linear(hidden, width, dtype)
        self.ape = fp32_param(ratio, width)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: CompressorState,
                finish: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        """Consume ``x [B, S, D]`` at ``ctx.positions``; write closed windows' entries into ``state``.

        ``finish(entry [B, W, dim] fp32, window_start_pos [B, W]) -> entry`` applies RoPE (and the
        indexer's rotation); the entry store then rounds the entry as it keeps it (FP8 / FP4 under
        the QAT simulation).
        """
        m, slots = self.ratio, ctx.slots
        B, S, _ = x.shape
        f32 = torch.float32
        kv = self.wkv(x, f32)                                                  # [B, S, width]
        gate = self.wgate(x, f32)
        if S == 1:       # decode: the window row, the closing entry and its store in one op
            cos, sin = ctx.window_rope(m)
            fused.compressor_step(kv, gate, self.ape, state, slots, ctx.positions, self.norm.weight, self.norm.eps,
                                  cos, sin, self.rotate)
            return
        gate = gate + self.ape[ctx.positions % m]

        # Aligned buffer: row j holds position w0*m + j, w0 = the slot's open window.
        n_win = (m - 1 + S) // m + 1            # windows that can close, +1 for the next open one
        offset = ctx.start % m                   # [B] rows already in the open window
        w0 = ctx.start // m                      # [B]
        rows = (offset.unsqueeze(1) + torch.arange(S, device=x.device)).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        buf_kv = self._aligned(state.win_kv[slots], n_win * m).scatter(1, rows, kv)
        buf_gate = self._aligned(state.win_gate[slots], n_win * m).scatter(1, rows, gate)
        win_kv = buf_kv.unflatten(1, (n_win, m))                              # [B, n_win, m, width]
        win_gate = buf_gate.unflatten(1, (n_win, m))

        prev_kv = prev_gate = None
        if self.overlap:
            d = self.dim
            prev_kv = torch.cat([state.prev_kv[slots].unsqueeze(1), win_kv[:, :-1, :, :d]], dim=1)
            prev_gate = torch.cat([state.prev_gate[slots].unsqueeze(1), win_gate[:, :-1, :, :d]], dim=1)
        entry = ops.compress_windows(win_kv, win_gate, prev_kv, prev_gate)   # [B, n_win, dim] fp32
        entry = self.norm(entry)
        index = w0.unsqueeze(1) + torch.arange(n_win, device=x.device)       # [B, n_win] entry index
        entry = finish(entry, index * m)

        # Write closed windows; the others land on the sink row (max_entries).
        n_closed = (offset + S) // m                                          # [B]
        closed = torch.arange(n_win, device=x.device).unsqueeze(0) < n_closed.unsqueeze(1)
        target = torch.where(closed, index, torch.full_like(index, state.max_entries))
        fused.store_rows(state.entries, slots.unsqueeze(1), target, entry)

        # The new open window is window n_closed of the buffer; the last closed one feeds the overlap.
        pick = n_closed.view(B, 1, 1, 1).expand(-1, 1, m, win_kv.shape[-1])
        state.win_kv[slots] = win_kv.gather(1, pick).squeeze(1)
        state.win_gate[slots] = win_gate.gather(1, pick).squeeze(1)
        if self.overlap:
            last = (n_closed - 1).clamp(min=0).view(B, 1, 1, 1).expand(-1, 1, m, self.dim)
            any_closed = (n_closed > 0).view(B, 1, 1)
            state.prev_kv[slots] = torch.where(any_closed, win_kv[..., :self.dim].gather(1, last).squeeze(1),
                                               state.prev_kv[slots])
            state.prev_gate[slots] = torch.where(any_closed, win_gate[..., :self.dim].gather(1, last).squeeze(1),
                                                 state.prev_gate[slots])

    @staticmethod
    def _aligned(window_rows: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, m, w]`` open-window rows followed by zero rows, ``[B, length, w]``."""
        B, m, w = window_rows.shape
        pad = window_rows.new_zeros(B, length - m, w)
        return torch.cat([window_rows, pad], dim=1)
