"""Allocating and resetting the fixed-shape generation state (DESIGN decision 3).

What each layer keeps, and what kind of state each piece is, is declared by the model
(:meth:`dsv4.model.cache.LayerCache.allocate` / ``pieces``); the engine only decides how many
slots and positions, holds every buffer (allocated once), and resets slots for new sequences. A slot's position lives in ``positions`` on the device; forwards read and write the
buffers by slot index with device-side masks, so a decode step has no host branch on device values
and is CUDA-graph capturable. :func:`state_layout` tells the cost per token before anything is
allocated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ContextOverflowError  # noqa: F401  (raised by the runner; defined with the other user errors)
from ..model.cache import CompressorState, LayerCache, StatePiece
from .h2d import upload


@dataclass
class StateLayout:
    """Bytes of state for one slot: ``fixed`` (window rings, open compressor windows) plus
    ``per_token`` (compressed entries and indexer keys grow with the context), by layer kind."""

    fixed: dict[str, float]
    per_token: dict[str, float]
    layers: dict[str, int]

    def bytes(self, slots: int, context: int) -> int:
        per_slot = sum(self.fixed.values()) + sum(self.per_token.values()) * context
        return int(slots * per_slot)

    def max_context(self, budget_bytes: int, slots: int = 1) -> int:
        """The longest context whose state fits ``budget_bytes`` for ``slots`` sequences."""
        per_token = sum(self.per_token.values())
        spare = budget_bytes / max(slots, 1) - sum(self.fixed.values())
        return max(0, int(spare / per_token)) if per_token else (1 << 62 if spare >= 0 else 0)

    def describe(self) -> str:
        lines = []
        for kind, n in self.layers.items():
            lines.append(f"  {kind:<8} x{n:<3} {self.per_token[kind] / max(n, 1):9.1f} B/token/layer, "
                         f"{self.fixed[kind] / max(n, 1) / 1024:8.1f} KiB fixed/layer")
        return "\n".join(lines)


def state_layout(config: ModelConfig, dtype: torch.dtype, qat_sim: bool, include_mtp: bool = False
                 ) -> StateLayout:
    """Bytes per slot of every layer's state, by layer kind (allocates nothing)."""
    fixed: dict[str, float] = {}
    per_token: dict[str, float] = {}
    layers: dict[str, int] = {}
    for i in range(_n_layers(config, include_mtp)):
        cache = _allocate_layer(config, i, 1, 1, dtype, "meta", qat_sim)
        kind = config.layer_kind(i)
        pieces = cache.pieces()
        entries = sum(p.nbytes_per_row() / p.ratio for p in pieces if p.kind == "entries")
        fixed[kind] = fixed.get(kind, 0.0) + sum(p.nbytes_per_slot() for p in pieces if p.kind != "entries")
        per_token[kind] = per_token.get(kind, 0.0) + entries
        layers[kind] = layers.get(kind, 0) + 1
    return StateLayout(fixed, per_token, layers)


def _n_layers(config: ModelConfig, include_mtp: bool) -> int:
    return config.num_hidden_layers + int(bool(config.num_nextn_predict_layers) and include_mtp)


def _allocate_layer(config: ModelConfig, layer: int, slots: int, max_context: int, dtype: torch.dtype,
                    device: torch.device | str, qat_sim: bool) -> LayerCache:
    return LayerCache.allocate(config, layer, slots, max_context, dtype, device, qat_sim)


#: one compressor's state (tests and the kernel benchmarks build them directly)
_compressor = CompressorState.allocate


class GenerationState:
    """All layers' buffers for ``max_slots`` sequences of up to ``max_context`` positions.

    ``qat_sim`` picks the storage: FP8 K=V rows and entries plus FP4 indexer keys (the QAT
    simulation, stored as simulated) or the activation dtype.
    """

    def __init__(self, config: ModelConfig, max_slots: int, max_context: int, dtype: torch.dtype,
                 device: torch.device | str, include_mtp: bool = False, qat_sim: bool = False):
        if max_slots <= 0 or max_context <= 0:
            raise ValueError(f"max_slots ({max_slots}) and max_context ({max_context}) must be positive")
        device = torch.device(device)
        self.config, self.max_slots, self.max_context = config, max_slots, max_context
        self.dtype, self.device, self.qat_sim = dtype, device, qat_sim
        self.layers = [_allocate_layer(config, i, max_slots, max_context, dtype, device, qat_sim)
                       for i in range(_n_layers(config, include_mtp))]
        self.positions = torch.zeros(max_slots, dtype=torch.int64, device=device)

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        """Make ``slots`` empty (position 0) so they can take a new sequence."""
        slots = upload(torch.as_tensor(slots, dtype=torch.int64), self.device)   # no host stall
        self.positions.index_fill_(0, slots, 0)
        for layer in self.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.reset(slots)

    def pieces(self) -> list[StatePiece]:
        """Every layer's buffers with their kinds (:class:`~dsv4.model.cache.StatePiece`), layer by layer."""
        return [p for layer in self.layers for p in layer.pieces()]

    def nbytes(self) -> int:
        total = self.positions.numel() * self.positions.element_size()
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in layer.tensors())
        return total
