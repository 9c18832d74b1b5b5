"""The KV compressor of CSA (ratio m with overlap) and HCA (ratio m', no overlap) layers.

DSV4_FACTS section 2, "Compressor". Per token, in fp32: ``C = x W_kv^T``, ``Z = x W_gate^T + ape[pos % m]``.
A window of ``m`` tokens that closes (``(pos + 1) % m == 0``) emits one entry:
HCA: ``sum softmax_m(Z) * C``; CSA: softmax over ``2m`` slots, the ``a`` halves of the previous
window and the ``b`` halves of this one. The entry is RMS-normed, rotated (RoPE at the window's
first position) and, under QAT simulation, rounded like the cache it simulates.

Rows of up to :func:`step_tokens` new tokens (decode, speculative verify, short chunks) step them
one after another in one fused op (:meth:`Compressor.decode_step`). Longer chunks take the batched
path (:meth:`Compressor.forward`): the ``S`` new rows of each slot are scattered into an aligned
buffer behind the slot's open-window rows, every window of that buffer is pooled, and closed ones
are written to ``entries`` by a device-side mask (others go to the sink row). No host read of
positions, fixed shapes for a given ``(B, S)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ops
from ..ops import fused
from .cache import CompressorState
from .common import ForwardContext, Linear, RMSNorm, fp32_param


#: Up to this many new tokens a row (decode, a speculative verify step of 1 + k, a short prompt
#: chunk), a layer steps its compressor one token after another in one launch (:meth:`Compressor.decode_step`)
#: instead of the batched chunk path (:meth:`Compressor.forward`, ~30 small ops a compressor
#: whatever the length); the stepping is sequential within a row, so long chunks keep the batched path.
STEP_TOKENS = 8
#: the same where the step is a kernel (:func:`step_tokens`): a step with a short prompt chunk is
#: host-bound, and the batched path's ~30 launches a compressor cost the host far more than the
#: kernel's sequential steps cost the GPU (the reference steps token by token in torch ops).
#: H100, Flash x4, 15 decode rows + one chunk (bench/profile_mixed.py): chunks of 16 / 64 / 128
#: tokens 34.4 / 34.2 / 38.0 -> 16.5 / 19.9 / 18.2 ms a step, GPU time +0.2 ms at most; at 256
#: tokens no gain (35.8 -> 34.4 ms, GPU +0.5 ms), so longer chunks keep the batched path
KERNEL_STEP_TOKENS = 128


def step_tokens(device: torch.device) -> int:
    """Rows of up to this many new tokens step the compressor (:meth:`Compressor.decode_step`)."""
    return KERNEL_STEP_TOKENS if ops.has_kernel("compressor_step", device) else STEP_TOKENS


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

        A few tokens a row (``S <= step_tokens(device)``) take :meth:`decode_step` instead (one fused op).
        """
        m, slots = self.ratio, ctx.slots
        B, S, _ = x.shape
        kv, gate = self.project(x)
        plan = window_plan(ctx, m)
        gate = gate + self.ape[plan.ape_row]
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
        # (the index tensors depend only on the rows' positions and m: `plan`, shared by every
        # compressor of ratio m in this forward)
        n_win = plan.n_win
        rows = plan.rows.expand(-1, -1, kv.shape[-1])
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
        if self.overlap and state.stage is not None and ctx.snaps:
            # prefix caching: the last closed window at each boundary b inside this one-row chunk
            # (the predecessor of the buffer's window that starts at b) into the stage's slot
            for start, b, k in ctx.snaps:
                j = b // m - start // m
                state.stage.prev_kv[k] = prev_kv[0, j]
                state.stage.prev_gate[k] = prev_gate[0, j]
        entry = ops.compress_windows(win_kv, win_gate, prev_kv, prev_gate)   # [B, n_win, dim] fp32
        entry = self.norm(entry)

        # The new open window is window n_closed of the buffer; the last closed one feeds the
        # overlap: window n_closed's predecessor, which is `prev_*` above (the state's own when no
        # window closed)
        pick = plan.n_closed.expand(-1, 1, m, win_kv.shape[-1])
        state.win_kv[slots] = win_kv.gather(1, pick).squeeze(1)
        state.win_gate[slots] = win_gate.gather(1, pick).squeeze(1)
        if self.overlap:
            pick = plan.n_closed.expand(-1, 1, m, self.dim)
            state.prev_kv[slots] = prev_kv.gather(1, pick).squeeze(1)
            state.prev_gate[slots] = prev_gate.gather(1, pick).squeeze(1)
        return entry, plan.entry_pos

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``C = x wkv^T`` and ``Z = x wgate^T`` (without ``ape``), fp32: one GEMV for both at decode
        (plain weights never round their input)."""
        return fused.linear_pair(x, self.wkv.w, self.wgate.w, self.wkv.act_quant, self.wkv.pow2, torch.float32)

    def decode_step(self, x: torch.Tensor, ctx: ForwardContext, state: CompressorState) -> torch.Tensor:
        """:meth:`forward` of ``x [B, S, D]`` token by token in one op: each token's window row, the
        entry of a window it closes, rotated (RoPE, and the Hadamard with ``rotate``) and stored, and
        (``S >= 2``, verify) the rows logged for the rollback. Returns ``[B, S]`` the entries each
        query sees after its token, ``(pos + 1) // m`` (:meth:`ForwardContext.visible_entries`, from
        the same launch)."""
        # the same math as forward, one token at a time (tests/test_triton_small.py checks the two
        # agree); RoPE at each token's window start, where the entry it closes sits
        kv, gate = self.project(x)
        cos, sin = ctx.window_rope(self.ratio)
        return fused.compressor_step(kv, gate, self.ape, state, ctx.slots, ctx.positions, self.norm.weight,
                                     self.norm.eps, cos, sin, self.rotate)

    def decode_step_with(self, other: "Compressor", x: torch.Tensor, ctx: ForwardContext, state: CompressorState,
                         other_state: CompressorState) -> torch.Tensor:
        """:meth:`decode_step` for this compressor and ``other`` (same ratio: a CSA layer's and its
        indexer's), the two steps in one launch; returns the visible entry counts."""
        kv, gate = self.project(x)
        kv2, gate2 = other.project(x)
        cos, sin = ctx.window_rope(self.ratio)
        return fused.compressor_step_pair(kv, gate, self.ape, state, self.norm.weight, self.norm.eps, self.rotate,
                                          kv2, gate2, other.ape, other_state, other.norm.weight, other.norm.eps,
                                          other.rotate, ctx.slots, ctx.positions, cos, sin)

    @staticmethod
    def _aligned(window_rows: torch.Tensor, length: int) -> torch.Tensor:
        """``[B, m, w]`` open-window rows followed by zero rows, ``[B, length, w]``."""
        B, m, w = window_rows.shape
        pad = window_rows.new_zeros(B, length - m, w)
        return torch.cat([window_rows, pad], dim=1)


@dataclass
class WindowPlan:
    """The index tensors of a multi-token compressor update (``S >= 2`` tokens of ``B`` rows at
    ratio ``m``), which depend only on the rows' positions: computed once per forward and ratio
    (:func:`window_plan`) and shared by every compressor of that ratio (the attention's and the
    indexer's, on every layer)."""

    m: int
    ape_row: torch.Tensor       # [B, S] pos % m: the row of ``ape`` each token adds
    n_win: int                  # windows of the aligned buffer
    rows: torch.Tensor          # [B, S, 1] each token's row in the aligned buffer (offset + i)
    n_closed: torch.Tensor      # [B, 1, 1, 1] windows the chunk closes: the new open window's index
    entry_pos: torch.Tensor     # [B, n_win] each buffer window's first position
    last_pos: torch.Tensor      # [B, 1] the chunk's last position
    #: the entries' RoPE tables ("rope") and store rows (by store size), made on first use
    memo: dict = field(default_factory=dict)

    def entry_rope(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at each window's first position (where its entry sits), compress theta."""
        if "rope" not in self.memo:
            self.memo["rope"] = ctx.rope_at("compress", self.entry_pos)
        return self.memo["rope"]

    def store_rows(self, max_entries: int) -> torch.Tensor:
        """``[B, n_win]``: the entry row of each window that closed within the chunk (its last
        position ``pos + m - 1`` reached), else the sink row ``max_entries``, which no read unmasks."""
        if max_entries not in self.memo:
            m = self.m
            closed = self.entry_pos + m <= self.last_pos + 1
            self.memo[max_entries] = torch.where(closed, self.entry_pos // m,
                                                 torch.full_like(self.entry_pos, max_entries))
        return self.memo[max_entries]


def window_plan(ctx: ForwardContext, m: int) -> WindowPlan:
    """The :class:`WindowPlan` of ``ctx``'s rows at ratio ``m``, made on first use in this forward."""
    plans = ctx.__dict__.setdefault("_window_plans", {})
    if m not in plans:
        B, S = ctx.positions.shape
        dev = ctx.positions.device
        offset = ctx.start % m                   # [B] rows already in the open window
        n_win = (m - 1 + S) // m + 1            # windows that can close, +1 for the next open one
        plans[m] = WindowPlan(
            m=m, ape_row=ctx.positions % m, n_win=n_win,
            rows=(offset.unsqueeze(1) + torch.arange(S, device=dev)).unsqueeze(-1),
            n_closed=((offset + S) // m).view(B, 1, 1, 1),
            entry_pos=((ctx.start // m).unsqueeze(1) + torch.arange(n_win, device=dev)) * m,
            last_pos=ctx.positions[:, -1:])
    return plans[m]


def store_entries(state: CompressorState, ctx: ForwardContext, entries: torch.Tensor, positions: torch.Tensor
                  ) -> None:
    """Store ``entries [B, W, dim]`` (rotated, from :meth:`Compressor.forward`) of the windows that
    start at ``positions [B, W]``: a window that closed within the chunk (its last position
    ``pos + m - 1`` reached) at row ``pos // m``, the others on the sink row ``max_entries`` (a
    write with no host branch). The store rounds them as it keeps them (FP8 / FP4 under the QAT
    simulation)."""
    m = state.ratio
    plan = window_plan(ctx, m)
    if positions is plan.entry_pos:         # from Compressor.forward: the plan's rows, shared
        rows = plan.store_rows(state.max_entries)
    else:
        # a window [pos, pos + m) closed if the chunk reached its last position pos + m - 1; the
        # others (still open) are written to the sink row, which no read ever unmasks
        closed = positions + m <= ctx.positions[:, -1:] + 1                   # [B, W]
        rows = torch.where(closed, positions // m, torch.full_like(positions, state.max_entries))
    fused.store_rows(state.entries, ctx.slots.unsqueeze(1), rows, entries)
