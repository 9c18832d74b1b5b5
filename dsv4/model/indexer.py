"""The lightning indexer of CSA layers: picks each query's top-k compressed entries.

DSV4_FACTS section 2, "Lightning indexer". Its own overlapping compressor (width ``index_head_dim``)
produces keys ``K_I`` that get RoPE, a Walsh-Hadamard rotation and (QAT simulation) FP4 rounding;
queries ``q_I = wq_b(qr)`` get the same. Score of entry ``s`` for query ``t``:
``sum_h w[t, h] * relu(q_I[t, h] . K_I[s])`` with ``w = weights_proj(x) * d**-0.5 * n_heads**-0.5``.
Entries not yet visible (``s >= (t + 1) // m``) score ``-inf``; the top ``min(index_topk, entries)``
are kept and picks past the visible range are dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..engine.state import CompressorState
from .common import ForwardContext, Linear
from .compressor import Compressor


class Indexer(nn.Module):
    """Parameters ``wq_b [nI*d, q_lora_rank]``, ``weights_proj [nI, D]``, ``compressor.*``."""

    def __init__(self, config: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.n_heads, self.dim, self.topk, self.ratio = c.index_n_heads, c.index_head_dim, c.index_topk, ratio
        self.rope_dim, self.eps = c.rope_dim, c.rms_norm_eps
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, dtype)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, dtype)
        self.compressor = Compressor(c.hidden_size, c.index_head_dim, ratio, True, c.rms_norm_eps, dtype)

    def _rotate(self, x: torch.Tensor, qat: bool) -> torch.Tensor:
        """Hadamard rotation over the head dim, then the FP4 QAT simulation."""
        x = ops.hadamard(x)
        return ops.fp4_sim(x) if qat else x

    def forward(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, state: CompressorState
                ) -> torch.Tensor:
        """Update the indexer keys with ``x [B, S, D]`` and return the selection mask
        ``[B, S, max_entries]`` bool (True where the query attends to that compressed entry)."""
        rope = ctx.rope["compress"]

        def finish(entry: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            cos, sin = ctx.rope_at("compress", pos)
            return self._rotate(ops.apply_rope(entry, cos, sin), ctx.qat_sim)

        self.compressor(x, ctx, state, finish)

        B, S, _ = x.shape
        q = ops.linear(qr, self.wq_b.weight).unflatten(-1, (self.n_heads, self.dim))   # [B, S, nI, d]
        q = self._rotate(ops.apply_rope(q, rope.cos.unsqueeze(2), rope.sin.unsqueeze(2)), ctx.qat_sim)
        w = ops.linear(x, self.weights_proj.weight).float() * (self.dim ** -0.5 * self.n_heads ** -0.5)
        n = state.max_entries
        keys = state.entries[ctx.slots, :n]                                          # [B, n, d]
        scores = ops.indexer_scores(q, keys, w)                                      # [B, S, n]
        visible = (ctx.positions + 1) // self.ratio                                  # [B, S]
        entry_ids = torch.arange(n, device=x.device)
        scores = scores.masked_fill(entry_ids >= visible.unsqueeze(-1), float("-inf"))
        picks = scores.topk(min(self.topk, n), dim=-1).indices                      # [B, S, k]
        picks = torch.where(picks < visible.unsqueeze(-1), picks, torch.full_like(picks, n))
        mask = torch.zeros(B, S, n + 1, dtype=torch.bool, device=x.device)
        mask.scatter_(-1, picks, True)
        return mask[..., :n]
