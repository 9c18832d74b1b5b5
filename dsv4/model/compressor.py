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

import torch
from torch import nn

from .. import ops
from ..ops import fused
from .cache import CompressorState
from .common import ForwardContext, Linear, RMSNorm, fp32_param


class Compressor(nn.Module):
    """Parameters ``wkv``, ``wgate`` ``[width, D]``, ``ape [m, width]``, ``norm [dim]`` (official names).

    ``rotate``: entries get the indexer's Hadamard rotation after RoPE (what the indexer does to
    the entries this module returns), for the fused decode step.
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

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: CompressorState
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Consume ``x [B, S, D]`` at ``ctx.positions``: update the open window in ``state`` and
        return ``(entries [B, W, dim] fp32, positions [B, W])``, the normed entry of every window
        the chunk touches and its window's first position; the caller rotates them (RoPE at that
        position, and the indexer's Hadamard) and stores them with :func:`store_entries` (windows
        still open go to the sink row).

        Decode (``S == 1``) runs the fused step instead, which also rotates (``rotate``) and stores
        the closing entry, and returns None.
        """
        m, slots = self.ratio, ctx.slots
        B, S, _ = x.shape
        kv, gate = self.project(x)
        if S == 1:       # decode: the window row, the closing entry and its store in one op
            # the same math as below for one token (tests/test_triton_small.py checks the two
            # agree); RoPE at the window's start, where the entry closing now sits
            cos, sin = ctx.window_rope(m)
            fused.compressor_step(kv, gate, self.ape, state, slots, ctx.positions, self.norm.weight, self.norm.eps,
                                  cos, sin, self.rotate)
            return
        gate = gate + self.ape[ctx.positions % m]
        if state.log_kv is not None and S <= state.log_kv.shape[1]:      # a verify step: rollback reads these
            state.log_kv[slots, :S] = kv
            state.log_gate[slots, :S] = gate

        # Aligned buffer: row j holds position w0*m + j, w0 = the slot's open window. The open
        # window's rows (kept in the state) come first, the chunk's S rows are scattered behind
        # them, zeros pad the rest; every m rows of the buffer are one window. m = 4, a slot whose
        # open window holds positions 8, 9 (start = 10, offset = 2) and a chunk of S = 7 tokens:
        #
        #   position:  8  9 10 11  | 12 13 14 15 | 16  .  .  .
        #   from:      state chunk | chunk       | chunk, zero rows     (n_win = 3 windows)
        #   window:    w0 = 2      | 3           | 4
        #              closes (11) | closes (15) | open: its rows (16, zeros) become the state
        #
        # n_closed = (offset + S) // m = 2 windows closed; entries are computed for all n_win
        # windows (fixed shapes), the open ones are written to the sink row by `store_entries`.
        n_win = (m - 1 + S) // m + 1            # windows that can close, +1 for the next open one
        offset = ctx.start % m                   # [B] rows already in the open window
        w0 = ctx.start // m                      # [B]
        rows = (offset.unsqueeze(1) + torch.arange(S, device=x.device)).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
        buf_kv = self._aligned(state.win_kv[slots], n_win * m).scatter(1, rows, kv)
        buf_gate = self._aligned(state.win_gate[slots], n_win * m).scatter(1, rows, gate)
        win_kv = buf_kv.unflatten(1, (n_win, m))                              # [B, n_win, m, width]
        win_gate = buf_gate.unflatten(1, (n_win, m))

        # CSA overlap: entry w pools 2m slots, the `a` halves (first dim channels) of window w-1 and
        # the `b` halves of window w; window w0's predecessor is the state's `prev_*` (gate -inf
        # before any window closed, so its slots weigh nothing):
        #
        #   window:     w-1              w
        #   channels: [ a | b ]       [ a | b ]
        #                 \_____________/   `---- b halves of w
        #                 a halves of w-1          -> softmax over the 2m slots per channel
        prev_kv = prev_gate = None
        if self.overlap:
            d = self.dim
            prev_kv = torch.cat([state.prev_kv[slots].unsqueeze(1), win_kv[:, :-1, :, :d]], dim=1)
            prev_gate = torch.cat([state.prev_gate[slots].unsqueeze(1), win_gate[:, :-1, :, :d]], dim=1)
        entry = ops.compress_windows(win_kv, win_gate, prev_kv, prev_gate)   # [B, n_win, dim] fp32
        entry = self.norm(entry)
        index = w0.unsqueeze(1) + torch.arange(n_win, device=x.device)       # [B, n_win] entry index

        # The new open window is window n_closed of the buffer; the last closed one feeds the overlap.
        n_closed = (offset + S) // m                                          # [B]
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
        return entry, index * m

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``C = x wkv^T`` and ``Z = x wgate^T`` (without ``ape``), fp32: one GEMV for both at decode
        (plain weights never round their input)."""
        return fused.linear_pair(x, self.wkv.w, self.wgate.w, self.wkv.act_quant, self.wkv.pow2, torch.float32)

    def decode_step_with(self, other: "Compressor", x: torch.Tensor, ctx: ForwardContext, state: CompressorState,
                         other_state: CompressorState) -> None:
        """:meth:`forward` at ``S = 1`` for this compressor and ``other`` (same ratio: a CSA layer's
        and its indexer's), the two steps in one launch."""
        kv, gate = self.project(x)
        kv2, gate2 = other.project(x)
        cos, sin = ctx.window_rope(self.ratio)
        fused.compressor_step_pair(kv, gate, self.ape, state, self.norm.weight, self.norm.eps, self.rotate,
                                   kv2, gate2, other.ape, other_state, other.norm.weight, other.norm.eps, other.rotate,
                                   ctx.slots, ctx.positions, cos, sin)

    @staticmethod
    def _aligned(window_rows: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, m, w]`` open-window rows followed by zero rows, ``[B, length, w]``."""
        B, m, w = window_rows.shape
        pad = window_rows.new_zeros(B, length - m, w)
        return torch.cat([window_rows, pad], dim=1)


def store_entries(state: CompressorState, ctx: ForwardContext, entries: torch.Tensor, positions: torch.Tensor
                  ) -> None:
    """Store ``entries [B, W, dim]`` (rotated, from :meth:`Compressor.forward`) of the windows that
    start at ``positions [B, W]``: a window that closed within the chunk (its last position
    ``pos + m - 1`` reached) at row ``pos // m``, the others on the sink row ``max_entries`` (a
    write with no host branch). The store rounds them as it keeps them (FP8 / FP4 under the QAT
    simulation)."""
    m = state.ratio
    # a window [pos, pos + m) closed if the chunk reached its last position pos + m - 1; the
    # others (still open) are written to the sink row, which no read ever unmasks
    closed = positions + m <= ctx.positions[:, -1:] + 1                       # [B, W]
    rows = torch.where(closed, positions // m, torch.full_like(positions, state.max_entries))
    fused.store_rows(state.entries, ctx.slots.unsqueeze(1), rows, entries)
