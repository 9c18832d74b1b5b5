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
from .mhc import Mixer, add_mixer_params
from .moe import MoE


class Block(nn.Module):
    """``h = post(attn(attn_norm(pre_attn(h))))`` then the same with the MoE and ``ffn_norm``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 prefix: str | None = None):
        super().__init__()
        c = config
        prefix = prefix or f"layers.{layer}"
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        add_mixer_params(self, "hc_attn", c.hc_mult, c.hidden_size)
        add_mixer_params(self, "hc_ffn", c.hc_mult, c.hidden_size)
        self.attn = Attention(c, layer, dtype, tp, f"{prefix}.attn")
        self.ffn = MoE(c, layer, dtype, tp, f"{prefix}.ffn")
        self._mix_attn = Mixer(self, "hc_attn", c)
        self._mix_ffn = Mixer(self, "hc_ffn", c)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> torch.Tensor:
        """``h [B, S, nc, D]`` -> ``[B, S, nc, D]``."""
        y, post, comb = self._mix_attn.pre(h)
        h = Mixer.post(self.attn(self.attn_norm(y), ctx, cache), h, post, comb)
        y, post, comb = self._mix_ffn.pre(h)
        return Mixer.post(self.ffn(self.ffn_norm(y), ctx), h, post, comb)
