"""The per-slot generation state: what each layer keeps between forwards (DSV4_FACTS section 3).

DESIGN decision 3: every buffer has a fixed shape ``[slots, rows, ...]`` sized once by the engine
(:mod:`dsv4.engine.state`), and forwards read and write rows by device-side slot and row indices,
so a decode step has no host branch on device values.

Per layer: the sliding window ring (``window`` K=V rows, row ``pos % window``); on CSA/HCA layers
the compressed entries and the compressor's open window; on CSA layers also the indexer's keys
and its compressor window. Entry stores have one extra last row, a write sink for windows that
did not close (writes never need a host branch).

How rows are stored (:class:`RowStore`), chosen by the QAT simulation:

- ``plain``: the activation dtype (BF16 checkpoints, the transformers parity).
- ``fp8`` (K=V rows and compressed entries, QAT on): the non-rope dims as float8_e4m3fn with one
  scale per 64 (an e8m0 byte for power-of-two ``ue8m0`` scales, else fp32), the rope dims in the
  activation dtype. At V4 geometry and BF16 that is 448 + 7 + 128 bytes an entry (584 with the
  padding byte other engines keep), the numbers the QAT simulation produces, bit for bit.
- ``fp4`` (CSA indexer keys, QAT on): e2m1 codes two a byte with an e8m0 scale per 32.

Each layer declares its state here (:meth:`LayerCache.allocate`, :meth:`LayerCache.pieces`); the
engine only sizes and holds it. Every buffer is a :class:`StatePiece` of one :data:`PIECE_KINDS`
kind, which says what of it a sequence needs at a *block boundary* (a position that is a multiple of
every compression ratio and of the window, :func:`block_size`), the point where the prefix cache
saves a slot and speculative decoding can roll one back:

- ``entries``: append-only, one row per ``ratio`` positions (compressed KV entries, indexer keys);
  rows below ``pos // ratio`` never change again, so blocks of them can be shared by every prefix
  that contains them.
- ``window``: fixed size, all of it needed to continue (the K=V ring, the overlapping compressors'
  last closed window).
- ``open``: a compressor's open window; at a boundary every window has just closed, so it holds
  nothing that will be read (its rows are rewritten before the next window closes).

Speculative decoding rolls a slot back to *any* position (:meth:`LayerCache.save` before a verify
step of ``S`` tokens at ``start``, :meth:`LayerCache.rollback` once the device knows how many were
kept), leaving exactly what plain decoding of the kept tokens leaves, by device-side masks:

- ring (``window``): the ``S`` rows the step overwrites (``S <= window``, each row once) are saved
  and put back for the rejected positions.
- ``entries``: nothing to undo. A rejected token only writes rows at or above the kept length's
  ``pos // ratio``, which no query reads before the window closes again and rewrites them.
- open window and last closed window (``open``, ``window``): a verify step saves both windows and
  logs its ``S`` new rows (``log_kv``/``log_gate``, written by the compressor); rollback rebuilds
  each row by position from the log, the saved copy, or zero (a window that closed is cleared), see
  :meth:`CompressorState.rollback`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..ops import fused, numerics

LAYOUTS = ("plain", "fp8", "fp4")
FP8_BLOCK = 64   # KV cache: one FP8 scale per 64 non-rope values
FP4_BLOCK = 32   # indexer keys: one e2m1 scale per 32 values
PIECE_KINDS = ("entries", "window", "open")


def block_size(config: ModelConfig) -> int:
    """The prefix-cache block, in positions: the least common multiple of the window and every
    compression ratio (128 on Flash and Pro: window 128, ratios 4 and 128; 16 on the tiny model:
    window 8, ratios 4 and 16). At a multiple of it every compressor window has closed and the ring
    holds exactly the last ``window`` positions, so the state there is the entry rows before it plus
    the ``window`` pieces, nothing else (see :data:`PIECE_KINDS`)."""
    ratios = [config.layer_ratio(i) for i in range(config.num_hidden_layers)]
    return math.lcm(config.sliding_window, *[r for r in ratios if r])


@dataclass
class StatePiece:
    """One buffer of a layer's state, ``tensor [slots, rows, ...]``, of kind ``kind``
    (:data:`PIECE_KINDS`); ``ratio``: positions per row of an ``entries`` piece (its last row is the
    write sink for windows that did not close)."""

    name: str
    tensor: torch.Tensor
    kind: str
    ratio: int = 0

    def nbytes_per_slot(self) -> int:
        return self.tensor[0].numel() * self.tensor.element_size()

    def nbytes_per_row(self) -> int:
        return self.tensor[0, 0].numel() * self.tensor.element_size()


@dataclass
class RowStore:
    """Rows of ``dim``-wide vectors, ``[slots, rows, dim]`` logically, in one :data:`LAYOUTS` layout.

    ``data``: plain ``[S, R, dim]`` (activation dtype); fp8 ``[S, R, dim - rope_dim]``
    float8_e4m3fn; fp4 ``[S, R, dim / 2]`` uint8. ``scale``: fp8 ``[S, R, ceil(nope / 64)]`` uint8
    e8m0 (``pow2``) or fp32; fp4 ``[S, R, dim / 32]`` uint8 e8m0. ``rope``: fp8 ``[S, R, rope_dim]``
    in the activation dtype. Writers give values in any float dtype; readers get ``dtype``.
    """

    layout: str
    dim: int
    dtype: torch.dtype
    data: torch.Tensor
    scale: torch.Tensor | None = None
    rope: torch.Tensor | None = None
    pow2: bool = True

    @classmethod
    def allocate(cls, layout: str, slots: int, rows: int, dim: int, dtype: torch.dtype,
                 device: torch.device | str, rope_dim: int = 0, pow2: bool = True) -> "RowStore":
        """Zero-filled storage for ``slots x rows`` vectors of width ``dim``."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown row layout {layout!r}; known: {LAYOUTS}")
        lead = (slots, rows)
        if layout == "plain":
            return cls(layout, dim, dtype, torch.zeros(*lead, dim, dtype=dtype, device=device), pow2=pow2)
        if layout == "fp8":
            nope = dim - rope_dim
            n_scales = -(-nope // FP8_BLOCK)
            return cls(layout, dim, dtype,
                       data=torch.zeros(*lead, nope, dtype=torch.float8_e4m3fn, device=device),
                       scale=torch.zeros(*lead, n_scales, dtype=torch.uint8 if pow2 else torch.float32,
                                         device=device),
                       rope=torch.zeros(*lead, rope_dim, dtype=dtype, device=device), pow2=pow2)
        if dim % 2:
            raise ValueError(f"fp4 rows need an even width, got {dim}")
        return cls(layout, dim, dtype,
                   data=torch.zeros(*lead, dim // 2, dtype=torch.uint8, device=device),
                   scale=torch.zeros(*lead, -(-dim // FP4_BLOCK), dtype=torch.uint8, device=device))

    @property
    def rows(self) -> int:
        return self.data.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale, self.rope) if t is not None]

    def nbytes_per_row(self) -> int:
        """Bytes one row (one slot) takes."""
        return sum(t[0, 0].numel() * t.element_size() for t in self.tensors())

    def encode(self, values: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``values [..., dim]`` -> the stored parts, in the order of :meth:`tensors`."""
        if self.layout == "plain":
            return (values.to(self.dtype),)
        if self.layout == "fp8":
            nope = self.data.shape[-1]
            q, scale = numerics.fp8_quantize(values[..., :nope], FP8_BLOCK, self.pow2)
            scale = numerics.pow2_to_e8m0(scale) if self.pow2 else scale
            return q, scale, values[..., nope:].to(self.dtype)
        return numerics.fp4_quantize(values, FP4_BLOCK)

    def decode(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Stored parts -> values ``[..., dim]`` in ``self.dtype`` (fp32 math, one rounding)."""
        if self.layout == "plain":
            return parts[0]
        if self.layout == "fp8":
            q, scale, rope = parts
            return torch.cat([numerics.fp8_dequantize(q, scale, FP8_BLOCK, self.dtype), rope], dim=-1)
        return numerics.fp4_dequantize(parts[0], parts[1], FP4_BLOCK, self.dtype)

    def write(self, slot_idx: torch.Tensor, row_idx: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``values [..., dim]`` at ``(slot_idx, row_idx)`` (index tensors broadcast to ``...``)."""
        for t, part in zip(self.tensors(), self.encode(values)):
            t[slot_idx, row_idx] = part

    def read(self, slot_idx: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
        """Values at ``(slot_idx, row_idx)`` (broadcast) -> ``[..., dim]`` in ``self.dtype``."""
        return self.decode(tuple(t[slot_idx, row_idx] for t in self.tensors()))

    def round_trip(self, values: torch.Tensor) -> torch.Tensor:
        """What reading ``values`` back after a write gives (the QAT-rounded values), ``self.dtype``."""
        return self.decode(self.encode(values))


@dataclass
class CompressorState:
    """One compressor's state (the attention's KV compressor or the indexer's).

    ``entries``: emitted entries (after norm / RoPE / rotation), ``[slots, max_entries + 1, dim]``;
    the last row is the sink for windows that did not close. ``win_kv / win_gate [slots, ratio,
    width]`` fp32: the open window's ``C`` and ``Z + ape`` rows, row ``pos % ratio``.
    ``prev_kv / prev_gate [slots, ratio, dim]`` fp32 (overlap only): the last closed window's ``a``
    halves; the gate is ``-inf`` before the first window closes.
    """

    ratio: int
    entries: RowStore
    win_kv: torch.Tensor
    win_gate: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None
    #: speculative decoding (:meth:`enable_log`): a multi-token forward's new window rows ``[slots,
    #: S_max, width]`` fp32 (``C`` and ``Z + ape``), row ``i`` = the step's position ``start + i``
    log_kv: torch.Tensor | None = None
    log_gate: torch.Tensor | None = None
    #: prefix caching: where a prompt chunk leaves this state as it was at a block boundary inside
    #: the chunk (the same layout, one slot per snapshot; see :attr:`LayerCache.stage`)
    stage: "CompressorState | None" = None

    @property
    def max_entries(self) -> int:
        return self.entries.rows - 1

    def tensors(self) -> list[torch.Tensor]:
        return self.entries.tensors() + [t for t in (self.win_kv, self.win_gate, self.prev_kv, self.prev_gate)
                                         if t is not None]

    def pieces(self, name: str) -> list[StatePiece]:
        out = [StatePiece(f"{name}.entries.{i}", t, "entries", self.ratio) for i, t in enumerate(self.entries.tensors())]
        out += [StatePiece(f"{name}.{n}", t, "open") for n, t in (("win_kv", self.win_kv), ("win_gate", self.win_gate))]
        out += [StatePiece(f"{name}.{n}", t, "window") for n, t in (("prev_kv", self.prev_kv), ("prev_gate", self.prev_gate))
                if t is not None]
        return out

    @classmethod
    def allocate(cls, entries: RowStore, slots: int, ratio: int, dim: int, overlap: bool,
                 device: torch.device | str) -> "CompressorState":
        """Zeroed windows (``-inf`` previous gates: no window closed yet) for ``entries``."""
        width = 2 * dim if overlap else dim
        f32 = dict(dtype=torch.float32, device=device)
        return cls(ratio=ratio, entries=entries,
                   win_kv=torch.zeros(slots, ratio, width, **f32),
                   win_gate=torch.zeros(slots, ratio, width, **f32),
                   prev_kv=torch.zeros(slots, ratio, dim, **f32) if overlap else None,
                   prev_gate=torch.full((slots, ratio, dim), float("-inf"), **f32) if overlap else None)

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the slots' open windows (entries need no reset: reads are masked by position)."""
        if self.prev_gate is not None:
            self.prev_gate.index_fill_(0, slots, float("-inf"))

    def enable_log(self, max_tokens: int) -> None:
        """Keep the window rows of forwards of up to ``max_tokens`` tokens (speculative verify)."""
        slots, _, width = self.win_kv.shape
        self.log_kv = self.win_kv.new_zeros(slots, max_tokens, width)
        self.log_gate = self.win_gate.new_zeros(slots, max_tokens, width)

    def save(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of the windows a forward may rewrite (a multi-token forward writes the whole new
        open window), for :meth:`rollback`: ``win_kv, win_gate[, prev_kv, prev_gate]`` of the slots
        (one op, :func:`dsv4.ops.fused.rows_save`)."""
        windows = [self.win_kv, self.win_gate] + ([self.prev_kv, self.prev_gate] if self.prev_kv is not None else [])
        return tuple(fused.rows_save(windows, slots, None, self.ratio))

    def rollback(self, saved: tuple[torch.Tensor, ...], slots: torch.Tensor, start: torch.Tensor, S: int,
                 kept: torch.Tensor, plans: dict | None = None) -> None:
        """After a forward of ``S >= 2`` tokens at ``start [B]`` (logged, see :meth:`enable_log`),
        keep its first ``kept [B]`` (0..S) positions: the windows become what plain decoding of those
        positions leaves. Plain decoding (``compressor_step``) writes row ``pos % ratio`` and clears
        the window when it closes, so row ``r`` holds position ``length // ratio * ratio + r`` if that
        is below the length, else zero if a window closed during the kept positions, else what it held.

        ``plans``: a dict shared by the rollbacks of one step (every layer's compressors of one
        ratio use the same index tensors, made once). One op (:func:`dsv4.ops.fused.window_rollback`:
        one kernel on the GPU)."""
        fused.window_rollback(self, saved, slots, start, S, kept, plans)


@dataclass
class LayerCache:
    """One layer's state: the sliding ring and, by layer kind, the compressor and the indexer's."""

    ring: RowStore
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None
    #: prefix caching: a small state of the same layout whose slots take snapshots of the
    #: ``window`` pieces at a block boundary *inside* a prompt chunk (the ring as it was there, the
    #: overlapping compressors' last closed window), so the cache can save that boundary without the
    #: chunk ending there (``ForwardContext.snaps``; the ``entries`` before a boundary never change,
    #: they are saved from the slot after the forward). Not part of :meth:`tensors` / :meth:`pieces`.
    stage: "LayerCache | None" = None

    def tensors(self) -> list[torch.Tensor]:
        out = self.ring.tensors()
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                out += comp.tensors()
        return out

    def save(self, slots: torch.Tensor, start: torch.Tensor, S: int) -> list:
        """What a forward of ``S`` tokens at ``start [B]`` in ``slots [B]`` may overwrite, for
        :meth:`rollback` (``S <= window``; compressors must have :meth:`CompressorState.enable_log`):
        one op for the ring's rows, one for each compressor's windows (:func:`dsv4.ops.fused.rows_save`)."""
        ring = fused.rows_save(self.ring.tensors(), slots, start, S)
        return [ring] + [c.save(slots) if c is not None else None for c in (self.compressor, self.indexer)]

    def rollback(self, saved: list, slots: torch.Tensor, start: torch.Tensor, S: int, kept: torch.Tensor,
                 plans: dict | None = None) -> None:
        """Keep the first ``kept [B]`` of the ``S`` positions a forward wrote since :meth:`save`:
        the state becomes what plain decoding of them leaves (device ops only: capturable): the ring's
        rejected rows put back in one op (:func:`dsv4.ops.fused.rows_restore`), each compressor's
        windows rebuilt in one. ``plans``: a dict shared by the rollbacks of one step (the compressors'
        index tensors, made once, not per layer)."""
        plans = {} if plans is None else plans
        fused.rows_restore(self.ring.tensors(), saved[0], slots, start, kept)
        for comp, s in zip((self.compressor, self.indexer), saved[1:]):
            if comp is not None:
                comp.rollback(s, slots, start, S, kept, plans)

    def pieces(self) -> list[StatePiece]:
        """Every buffer with its kind, in :meth:`tensors` order."""
        out = [StatePiece(f"ring.{i}", t, "window") for i, t in enumerate(self.ring.tensors())]
        for name, comp in (("compressor", self.compressor), ("indexer", self.indexer)):
            if comp is not None:
                out += comp.pieces(name)
        return out

    @classmethod
    def allocate(cls, config: ModelConfig, layer: int, slots: int, max_context: int, dtype: torch.dtype,
                 device: torch.device | str, qat_sim: bool) -> "LayerCache":
        """Layer ``layer``'s state for ``slots`` sequences of ``max_context`` positions: the ring; on
        CSA/HCA layers the compressor's entries (``max_context // ratio`` rows + the sink) and
        windows; on CSA layers the indexer's keys and windows. ``qat_sim`` stores K=V rows and
        entries as FP8 and indexer keys as FP4 (the QAT grid), else in ``dtype``."""
        c, kind = config, config.layer_kind(layer)
        kv_layout, key_layout = ("fp8", "fp4") if qat_sim else ("plain", "plain")
        pow2 = c.kv_scale_pow2
        ring = RowStore.allocate(kv_layout, slots, c.sliding_window, c.head_dim, dtype, device, c.rope_dim, pow2)
        cache = cls(ring=ring)
        if kind != "sliding":
            ratio = c.layer_ratio(layer)
            entries = RowStore.allocate(kv_layout, slots, max_context // ratio + 1, c.head_dim, dtype, device,
                                        c.rope_dim, pow2)
            cache.compressor = CompressorState.allocate(entries, slots, ratio, c.head_dim, kind == "csa", device)
            if kind == "csa":
                keys = RowStore.allocate(key_layout, slots, max_context // ratio + 1, c.index_head_dim, dtype,
                                         device)
                cache.indexer = CompressorState.allocate(keys, slots, ratio, c.index_head_dim, True, device)
        return cache
