"""The lightning indexer of CSA layers: picks each query's top-k compressed entries.

DSV4_FACTS section 2, "Lightning indexer". Its own overlapping compressor (width ``index_head_dim``)
produces keys ``K_I`` that get RoPE, a Walsh-Hadamard rotation and (QAT simulation) FP4 rounding;
queries ``q_I = wq_b(qr)`` get the same. Score of entry ``s`` for query ``t``:
``sum_h w[t, h] * relu(q_I[t, h] . K_I[s])`` with ``w = weights_proj(x) * d**-0.5 * n_heads**-0.5``.
Entries not yet visible (``s >= (t + 1) // m``) score ``-inf``; the top ``min(index_topk, entries)``
are kept and picks past the visible range are dropped.

The paper's CSA: the indexer is what makes compressed attention sparse (each query attends to
``index_topk`` of the ``t / 4`` entries, plus its sliding window). Its keys live in the state
beside the KV entries (FP4 under the QAT simulation, DSV4_FACTS 2b).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .cache import CompressorState
from .common import ForwardContext, Linear
from .compressor import Compressor, store_entries, window_plan


class Indexer(nn.Module):
    """Parameters ``wq_b [nI*d, q_lora_rank]``, ``weights_proj [nI, D]``, ``compressor.*``."""

    def __init__(self, config: ModelConfig, ratio: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.n_heads, self.dim, self.topk, self.ratio = c.index_n_heads, c.index_head_dim, c.index_topk, ratio
        self.rope_dim, self.eps = c.rope_dim, c.rms_norm_eps
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, dtype)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, dtype)
        self.compressor = Compressor(c.hidden_size, c.index_head_dim, ratio, True, c.rms_norm_eps, dtype,
                                     rotate=True)

    def forward(self, x: torch.Tensor, iq: torch.Tensor, ctx: ForwardContext, state: CompressorState,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """Update the indexer keys with ``x [B, S, D]`` and return each query's picks
        ``[B, S, k]`` int64: compressed-entry indices, ``-1`` where fewer than ``k`` are visible.
        ``iq [B, S, nI, d]``: the queries, ``wq_b(qr)`` rotated like the keys (RoPE, then the Hadamard
        rotation; QAT: FP4), which the attention prepares beside its own (same ``qr``, same positions).
        ``visible [B, S]``: given by a decode step, whose keys are in the state already (the attention
        ran this compressor's step beside its own, which also counted each query's visible entries).

        ``k = min(index_topk, bound)`` with ``bound`` the entries this forward can see at most.
        """
        if visible is None:                     # a chunk: RoPE, the Hadamard rotation, then store
            entries, pos = self.compressor(x, ctx, state)
            cos, sin = window_plan(ctx, self.ratio).entry_rope(ctx)      # shared by the ratio's compressors
            store_entries(state, ctx, ops.hadamard(ops.apply_rope(entries, cos, sin)), pos)  # FP4 under QAT
            visible = ctx.visible_entries(self.ratio)                                    # [B, S]

        w = self.weights_proj(x, torch.float32)
        # Score every entry a query of this forward could see, masked per query. Ratio m = 4,
        # query at t = 13 (visible: (13 + 1) // 4 = 3 entries), bound = 5 (a longer row's reach):
        #
        #   entry s:    0     1     2     3     4
        #   score:     1.2   0.3   0.9   -inf  -inf     (s >= 3: its window has not closed for t)
        #   top-4:   picks 0, 2, 1, 3  ->  0, 2, 1, -1   (a pick at s >= visible, a -inf tie, is dropped)
        bound = ctx.entry_bound(self.ratio, state.max_entries)
        scores = ops.indexer_scores(iq, state.entries, ctx.slots, w, bound, self.dim ** -0.5 * self.n_heads ** -0.5,
                                    visible)                                             # [B, S, bound]
        return ops.topk_indices(scores, min(self.topk, bound), visible)                 # [B, S, k]
