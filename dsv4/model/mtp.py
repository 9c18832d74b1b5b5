"""The multi-token-prediction (MTP) block: one extra block that predicts token ``t + 2``.

DSV4_FACTS section 2, "MTP". For position ``t`` with the main model's final streams ``h_t`` and the
next token ``x_{t+1}``: ``e = enorm(embed(x_{t+1}))``, ``h' = hnorm(h_t)`` (per stream), input
streams ``e_proj(e) + h_proj(h')`` (``e`` broadcast over streams), one full block, its own
``hc_head``, ``norm`` and the shared ``head``. Used for speculative decoding.
"""

from __future__ import annotations

import torch

from .. import ops
from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup
from .cache import LayerCache
from .common import ForwardContext, Linear, RMSNorm
from .block import Block


class MTPBlock(Block):
    """Block parameters plus ``hc_head``, ``e_proj``, ``h_proj``, ``enorm``, ``hnorm``, ``norm``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: ParallelGroup = SINGLE, prefix: str = "mtp.0"):
        super().__init__(config, config.num_hidden_layers, dtype, tp, prefix, with_head=True)
        c = self.config = config
        self.e_proj = Linear(c.hidden_size, c.hidden_size, dtype)
        self.h_proj = Linear(c.hidden_size, c.hidden_size, dtype)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def predict(self, h: torch.Tensor, next_embed: torch.Tensor, ctx: ForwardContext, cache: LayerCache,
                head_weight: object, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``h [B, S, nc, D]`` main streams at ``ctx.positions``, ``next_embed [B, S, D]`` embedding of
        the next tokens -> (fp32 logits ``[B, S, vocab]`` for token ``t + 2``, MTP streams).

        ``head_weight``: the shared head's weight, or under tensor parallel the model's
        :meth:`~dsv4.model.transformer.Transformer.project_head` (local vocab slice + all-gather).
        ``rows [R]``: logits of these flattened positions only (``[R, vocab]``; speculative drafts)."""
        e = self.e_proj(self.enorm(next_embed))
        x = self.h_proj(self.hnorm(h)) + e.unsqueeze(2)
        x = super().forward(x, ctx, cache)
        y = x if rows is None else x.flatten(0, 1).index_select(0, rows).unsqueeze(0)
        y = self.hc_head(y, self.norm)
        logits = head_weight(y) if callable(head_weight) else ops.linear(y, head_weight, out_dtype=torch.float32)
        return (logits if rows is None else logits[0]), x
