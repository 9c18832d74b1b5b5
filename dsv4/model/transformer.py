"""The DeepSeek-V4 network: embedding into ``nc`` streams, blocks, ``hc_head``, norm, fp32 head.

DSV4_FACTS section 2. Written once; every hot operation goes through :mod:`dsv4.ops`. A forward
runs ``B`` slots x ``S`` new tokens against a :class:`~dsv4.engine.state.GenerationState`
(prefill chunks and batched decode are the same call with different ``S``).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..engine.state import GenerationState, LayerState
from .attention import Attention
from .common import ForwardContext, Linear, RMSNorm, RopeTables
from .mhc import Mixer, add_head_params, add_mixer_params, collapse_head
from .moe import MoE


class Block(nn.Module):
    """``h = post(attn(attn_norm(pre_attn(h))))`` then the same with the MoE and ``ffn_norm``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        add_mixer_params(self, "hc_attn", c.hc_mult, c.hidden_size)
        add_mixer_params(self, "hc_ffn", c.hc_mult, c.hidden_size)
        self.attn = Attention(c, layer, dtype)
        self.ffn = MoE(c, layer, dtype)
        self._mix_attn = Mixer(self, "hc_attn", c)
        self._mix_ffn = Mixer(self, "hc_ffn", c)

    def forward(self, h: torch.Tensor, ctx: ForwardContext, state: LayerState) -> torch.Tensor:
        """``h [B, S, nc, D]`` -> ``[B, S, nc, D]``."""
        y, post, comb = self._mix_attn.pre(h)
        h = Mixer.post(self.attn(self.attn_norm(y), ctx, state), h, post, comb)
        y, post, comb = self._mix_ffn.pre(h)
        return Mixer.post(self.ffn(self.ffn_norm(y), ctx.token_ids), h, post, comb)


class Transformer(nn.Module):
    """Official names: ``embed``, ``layers.{i}``, ``hc_head_*``, ``norm``, ``head`` (+ ``mtp.{i}``)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True):
        super().__init__()
        c = self.config = config
        self.dtype = dtype
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.embed.weight.requires_grad_(False)
        self.layers = nn.ModuleList(Block(c, i, dtype) for i in range(c.num_hidden_layers))
        add_head_params(self, c.hc_mult, c.hidden_size)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.vocab_size, dtype)
        if with_mtp and c.num_nextn_predict_layers:
            from .mtp import MTPBlock
            self.mtp = nn.ModuleList(MTPBlock(c, dtype) for _ in range(c.num_nextn_predict_layers))
        self.init_rope(self.embed.weight.device)

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the RoPE inverse frequencies on ``device`` (after a meta-device build)."""
        c = self.config
        inv = {"main": ops.reference.rope_inv_freq(c.rope_dim, c.rope_theta),
               "compress": ops.reference.rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.yarn)}
        for kind, freqs in inv.items():
            self.register_buffer(f"inv_freq_{kind}", freqs.to(device), persistent=False)

    def context(self, token_ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, qat_sim: bool
                ) -> ForwardContext:
        """Positions and RoPE tables for ``token_ids [B, S]`` starting at ``start [B]`` in ``slots [B]``."""
        S = token_ids.shape[1]
        positions = start.unsqueeze(1) + torch.arange(S, device=token_ids.device)
        inv = {"main": self.inv_freq_main, "compress": self.inv_freq_compress}
        rope = {k: RopeTables(*ops.reference.rope_cos_sin(positions, f)) for k, f in inv.items()}
        return ForwardContext(self.config, token_ids, slots, start, positions, rope, inv, qat_sim)

    def hidden_streams(self, ctx: ForwardContext, state: GenerationState) -> torch.Tensor:
        """Embed and run every block: final streams ``[B, S, nc, D]`` (MTP input)."""
        h = self.embed(ctx.token_ids)
        h = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer, layer_state in zip(self.layers, state.layers):
            h = layer(h, ctx, layer_state)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams ``[..., nc, D]`` -> fp32 logits ``[..., vocab]``."""
        y = self.norm(collapse_head(self, h, self.config))
        return ops.linear(y.float(), self.head.weight)

    def forward(self, token_ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                state: GenerationState, qat_sim: bool = False, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``token_ids [B, S]`` at positions ``start [B] + arange(S)`` in ``slots [B]``.

        Updates ``state`` (the caller advances ``state.positions``). Returns fp32 logits
        ``[B, S, vocab]`` (``[B, 1, vocab]`` with ``last_only``) and the final streams.
        """
        ctx = self.context(token_ids, slots, start, qat_sim)
        h = self.hidden_streams(ctx, state)
        return self.logits(h[:, -1:] if last_only else h), h
