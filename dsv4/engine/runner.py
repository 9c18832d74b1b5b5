"""Runs the network over generation slots: chunked prefill and batched decode.

The runner owns the :class:`GenerationState`. Prefill feeds one slot's prompt in chunks (same
result as one shot: the compressor and ring carry state across chunks). Decode runs one token for
each of several slots at their own positions in one forward; positions advance on the device and
the host only keeps its own count of each slot's length (it issued every token, so it knows),
which it uses to refuse a context overflow before touching any state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..model.transformer import Transformer
from .state import ContextOverflowError, GenerationState


class Runner:
    """One model + its fixed-shape state for ``max_slots`` sequences of ``max_context`` positions."""

    def __init__(self, model: Transformer, max_slots: int = 4, max_context: int = 4096,
                 qat_sim: bool = False, prefill_chunk: int = 512):
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be positive, got {prefill_chunk}")
        self.model, self.qat_sim, self.prefill_chunk = model, qat_sim, prefill_chunk
        device = model.embed.weight.device
        self.device = device
        self.state = GenerationState(model.config, max_slots, max_context, model.dtype, device, qat_sim=qat_sim)
        self.lengths = [0] * max_slots  # host mirror of state.positions

    @property
    def max_slots(self) -> int:
        return self.state.max_slots

    @property
    def max_context(self) -> int:
        return self.state.max_context

    def reset(self, slots: Sequence[int]) -> None:
        """Free ``slots`` for new sequences."""
        for s in slots:
            self._check_slot(s)
            self.lengths[s] = 0
        self.state.reset(list(slots))

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise IndexError(f"slot {slot} out of range (max_slots={self.max_slots})")

    def _reserve(self, slot: int, n: int) -> int:
        self._check_slot(slot)
        start = self.lengths[slot]
        if start + n > self.max_context:
            raise ContextOverflowError(
                f"slot {slot}: {start} + {n} tokens exceed max_context={self.max_context}")
        return start

    @torch.inference_mode()
    def prefill(self, slot: int, token_ids: Sequence[int] | torch.Tensor, all_logits: bool = False
                ) -> torch.Tensor:
        """Append ``token_ids`` to ``slot``; return fp32 logits of the last token ``[vocab]``
        (or of every token ``[n, vocab]`` with ``all_logits``)."""
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().to(self.device)
        n = ids.numel()
        if n == 0:
            raise ValueError("prefill needs at least one token")
        start = self._reserve(slot, n)
        slots = torch.tensor([slot], device=self.device)
        outs = []
        for lo in range(0, n, self.prefill_chunk):
            chunk = ids[lo:lo + self.prefill_chunk].unsqueeze(0)
            begin = torch.tensor([start + lo], device=self.device)
            bound = start + lo + chunk.shape[1]   # host-known: the longest context this chunk sees
            logits, _ = self.model(chunk, slots, begin, self.state.layers, self.qat_sim,
                                   last_only=not all_logits, context_bound=bound)
            outs.append(logits[0])
        self.lengths[slot] = start + n
        self.state.positions[slot] = start + n
        return torch.cat(outs) if all_logits else outs[-1][-1]

    @torch.inference_mode()
    def decode(self, slots: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
        """One token for each of ``slots`` (any mix of positions) -> fp32 logits ``[B, vocab]``."""
        if len(set(slots)) != len(slots):
            raise ValueError(f"decode got a slot twice: {list(slots)}")
        if token_ids.numel() != len(slots):
            raise ValueError(f"decode got {token_ids.numel()} token ids for {len(slots)} slots")
        for s in slots:
            self._reserve(s, 1)
        slot_t = torch.as_tensor(list(slots), dtype=torch.int64, device=self.device)
        ids = token_ids.to(self.device, torch.int64).view(-1, 1)
        start = self.state.positions[slot_t]
        bound = max(self.lengths[s] for s in slots) + 1
        logits, _ = self.model(ids, slot_t, start, self.state.layers, self.qat_sim, context_bound=bound)
        self.state.positions[slot_t] = start + 1
        for s in slots:
            self.lengths[s] += 1
        return logits[:, 0]
