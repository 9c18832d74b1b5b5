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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops import numerics

LAYOUTS = ("plain", "fp8", "fp4")
FP8_BLOCK = 64   # KV cache: one FP8 scale per 64 non-rope values
FP4_BLOCK = 32   # indexer keys: one e2m1 scale per 32 values


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

    @property
    def max_entries(self) -> int:
        return self.entries.rows - 1

    def tensors(self) -> list[torch.Tensor]:
        return self.entries.tensors() + [t for t in (self.win_kv, self.win_gate, self.prev_kv, self.prev_gate)
                                         if t is not None]

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the slots' open windows (entries need no reset: reads are masked by position)."""
        if self.prev_gate is not None:
            self.prev_gate.index_fill_(0, slots, float("-inf"))


@dataclass
class LayerCache:
    """One layer's state: the sliding ring and, by layer kind, the compressor and the indexer's."""

    ring: RowStore
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = self.ring.tensors()
        for comp in (self.compressor, self.indexer):
            if comp is not None:
                out += comp.tensors()
        return out
