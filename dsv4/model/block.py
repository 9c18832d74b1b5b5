"""One DeepSeek-V4 block: attention and MoE, each between an mHC pre (collapse the ``nc`` streams)
and an mHC post (mix the output back into them). DSV4_FACTS section 2, "Block"."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup
from .attention import Attention
from .cache import LayerCache
from .common import ForwardContext, RMSNorm
from .mhc import HyperConnection, HyperHead
from .moe import MoE


class Block(nn.Module):
    """``h = post(attn(attn_norm(pre_attn(h))))`` then the same with the MoE and ``ffn_norm``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 prefix: str | None = None, with_head: bool = False):
        super().__init__()
        c = config
        prefix = prefix or f"layers.{layer}"
        # the mHC modules first: parameters then come in the checkpoint's order (hc_attn_*, hc_ffn_*,
        # an MTP block's hc_head_*, then the norms), which the seeded random weights are drawn in
        self.hc_attn = HyperConnection(c)
        self.hc_ffn = HyperConnection(c)
        if with_head:
            self.hc_head = HyperHead(c)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, layer, dtype, tp, f"{prefix}.attn")
        self.ffn = MoE(c, layer, dtype, tp, f"{prefix}.ffn")

    def forward(self, h: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> torch.Tensor:
        """``h [B, S, nc, D]`` -> ``[B, S, nc, D]``."""
        return self.hc_ffn.post(*self.run(h, ctx, cache))

    def run(self, h: torch.Tensor, ctx: ForwardContext, cache: LayerCache,
            pending: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
        """The block but its last mHC post, which it hands back ``(out, h, post, comb)`` for
        :meth:`HyperConnection.post` (or for the next block's pre, in the same op: ``pending``, in
        which case ``h`` is not read: the streams are ``post(*pending)``)."""
        # h [B, S, nc, D] --pre--> y [B, S, D] --norm, attention--> out --post--> h [B, S, nc, D]
        # (pre and the norm are one op: the norm reads the collapsed row where pre wrote it; a post
        # and the pre after it are one op: the new streams are projected as they are made)
        if pending is None:
            x, post, comb = self.hc_attn.pre(h, self.attn_norm)
        else:
            h, x, post, comb = self.hc_attn.post_pre(*pending, self.attn_norm)
        # the same around the MoE, with its own mixer (mHC diagram: dsv4.model.mhc)
        h, x, post, comb = self.hc_ffn.post_pre(self.attn(x, ctx, cache), h, post, comb, self.ffn_norm)
        return self.ffn(x, ctx), h, post, comb
