"""Fixed-shape generation state (DESIGN decision 3, DSV4_FACTS section 3).

Every buffer is allocated once from ``max_slots x max_context`` and never grows: a ring of the last
``sliding_window`` K=V rows per layer, the compressed entries of CSA/HCA layers (and the indexer's
keys on CSA layers), and each compressor's open-window rows. A slot's position lives in
``positions`` on the device; forwards read and write the buffers by slot index with device-side
masks, so a decode step has no host branch on device values and is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import ContextOverflowError  # noqa: F401  (raised by the runner; defined with the other user errors)


@dataclass
class CompressorState:
    """One compressor's buffers (main KV compressor or the indexer's).

    ``entries [slots, max_entries + 1, dim]``: emitted entries (after norm/RoPE); the extra last row
    is a write sink for windows that did not close, so writes never need a host branch.
    ``win_kv/win_gate [slots, ratio, width]`` fp32: the open window's ``C`` and ``Z + ape`` rows,
    row ``pos % ratio``. ``prev_kv/prev_gate [slots, ratio, dim]`` fp32 (overlap only): the last
    closed window's ``a`` halves; the gate is ``-inf`` before the first window closes.
    """

    ratio: int
    entries: torch.Tensor
    win_kv: torch.Tensor
    win_gate: torch.Tensor
    prev_kv: torch.Tensor | None
    prev_gate: torch.Tensor | None

    @property
    def max_entries(self) -> int:
        return self.entries.shape[1] - 1

    @classmethod
    def allocate(cls, slots: int, max_context: int, ratio: int, dim: int, overlap: bool,
                 dtype: torch.dtype, device: torch.device) -> "CompressorState":
        width = 2 * dim if overlap else dim
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            ratio=ratio,
            entries=torch.zeros(slots, max_context // ratio + 1, dim, dtype=dtype, device=device),
            win_kv=torch.zeros(slots, ratio, width, **f32),
            win_gate=torch.zeros(slots, ratio, width, **f32),
            prev_kv=torch.zeros(slots, ratio, dim, **f32) if overlap else None,
            prev_gate=torch.full((slots, ratio, dim), float("-inf"), **f32) if overlap else None,
        )

    def reset(self, slots: torch.Tensor) -> None:
        if self.prev_gate is not None:
            self.prev_gate.index_fill_(0, slots, float("-inf"))


@dataclass
class LayerState:
    """One layer's state: the sliding ring ``[slots, window, hd]`` and optional compressors."""

    ring: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


class GenerationState:
    """All layers' buffers for ``max_slots`` sequences of up to ``max_context`` positions."""

    def __init__(self, config: ModelConfig, max_slots: int, max_context: int, dtype: torch.dtype,
                 device: torch.device | str, include_mtp: bool = False):
        if max_slots <= 0 or max_context <= 0:
            raise ValueError(f"max_slots ({max_slots}) and max_context ({max_context}) must be positive")
        device = torch.device(device)
        self.config, self.max_slots, self.max_context = config, max_slots, max_context
        self.dtype, self.device = dtype, device
        n = config.num_hidden_layers + (config.num_nextn_predict_layers > 0 and include_mtp)
        self.layers = [self._allocate_layer(i) for i in range(n)]
        self.positions = torch.zeros(max_slots, dtype=torch.int64, device=device)

    def _allocate_layer(self, layer: int) -> LayerState:
        c, kind = self.config, self.config.layer_kind(layer)
        ring = torch.zeros(self.max_slots, c.sliding_window, c.head_dim, dtype=self.dtype, device=self.device)
        state = LayerState(ring=ring)
        if kind != "sliding":
            ratio = c.layer_ratio(layer)
            state.compressor = CompressorState.allocate(self.max_slots, self.max_context, ratio, c.head_dim,
                                                        kind == "csa", self.dtype, self.device)
            if kind == "csa":
                state.indexer = CompressorState.allocate(self.max_slots, self.max_context, ratio,
                                                         c.index_head_dim, True, self.dtype, self.device)
        return state

    def reset(self, slots: list[int] | torch.Tensor) -> None:
        """Make ``slots`` empty (position 0) so they can take a new sequence."""
        slots = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        self.positions.index_fill_(0, slots, 0)
        for layer in self.layers:
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    comp.reset(slots)

    def nbytes(self) -> int:
        total = self.positions.numel() * 8
        for layer in self.layers:
            total += layer.ring.numel() * layer.ring.element_size()
            for comp in (layer.compressor, layer.indexer):
                if comp is not None:
                    for t in (comp.entries, comp.win_kv, comp.win_gate, comp.prev_kv, comp.prev_gate):
                        if t is not None:
                            total += t.numel() * t.element_size()
        return total
