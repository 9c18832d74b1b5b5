"""DeepSeek-V4 attention: shared K=V head, sliding window, compressed entries, sinks.

DSV4_FACTS section 2, "Attention". ``qr = q_norm(wq_a x)``; ``q = wq_b qr`` per head RMS-normed
without weight; ``kv = kv_norm(wkv x)`` is one head used as key and value; RoPE on the last ``rd``
dims (interleaved pairs; YaRN-scaled ``compress_rope_theta`` on CSA/HCA layers). A query at ``t``
sees the window ``t-W+1 .. t`` plus the compressed entries: all visible ones (HCA) or the indexer's
top-k (CSA). Softmax in fp32 with a per-head sink; the output gets the inverse RoPE (values carried
rope because K=V), then the grouped output projection ``wo_a`` (per group) and ``wo_b``.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..engine.state import LayerState
from .common import ForwardContext, Linear, RMSNorm, fp32_param
from .compressor import Compressor
from .indexer import Indexer


class Attention(nn.Module):
    """Official parameter names: ``wq_a q_norm wq_b wkv kv_norm wo_a wo_b attn_sink compressor indexer``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        c = config
        self.kind, self.ratio = c.layer_kind(layer), c.layer_ratio(layer)
        self.n_heads, self.head_dim, self.rope_dim = c.num_attention_heads, c.head_dim, c.rope_dim
        self.window, self.groups, self.eps = c.sliding_window, c.o_groups, c.rms_norm_eps
        self.rope_kind = "main" if self.kind == "sliding" else "compress"
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, c.num_attention_heads * c.head_dim, dtype)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank, dtype)
        self.wo_b = Linear(c.o_groups * c.o_lora_rank, c.hidden_size, dtype)
        self.attn_sink = fp32_param(c.num_attention_heads)
        if self.kind != "sliding":
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, self.kind == "csa",
                                         c.rms_norm_eps, dtype)
        if self.kind == "csa":
            self.indexer = Indexer(c, self.ratio, dtype)

    def _kv_qat(self, kv: torch.Tensor, qat: bool) -> torch.Tensor:
        """QAT simulation of the KV cache: FP8 rounding of the non-rope dims."""
        if not qat:
            return kv
        nope = self.head_dim - self.rope_dim
        return torch.cat([ops.fp8_sim(kv[..., :nope]), kv[..., nope:]], dim=-1)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, state: LayerState) -> torch.Tensor:
        """``x [B, S, D]`` (attention-normed block input) -> ``[B, S, D]``; updates ``state``."""
        B, S, _ = x.shape
        rope = ctx.rope[self.rope_kind]
        cos_h, sin_h = rope.cos.unsqueeze(2), rope.sin.unsqueeze(2)    # broadcast over heads

        qr = self.q_norm(ops.linear(x, self.wq_a.weight))
        q = ops.linear(qr, self.wq_b.weight).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.apply_rope(ops.rms_norm_unweighted(q, self.eps), cos_h, sin_h)      # [B, S, H, hd]
        kv = self.kv_norm(ops.linear(x, self.wkv.weight))
        kv = self._kv_qat(ops.apply_rope(kv, rope.cos, rope.sin), ctx.qat_sim)      # [B, S, hd]

        keys, valid = self._window_keys(kv, ctx, state)
        if self.kind != "sliding":
            comp_keys, comp_valid = self._compressed_keys(x, qr, ctx, state)
            keys = torch.cat([keys, comp_keys], dim=1)
            valid = torch.cat([valid, comp_valid], dim=2)

        o = ops.sparse_attention(q, keys, valid, self.attn_sink, self.head_dim ** -0.5)  # [B, S, H, hd]
        o = ops.apply_rope(o, cos_h, sin_h, inverse=True)
        o = ops.grouped_linear(o.flatten(2).unflatten(-1, (self.groups, -1)), self.wo_a.weight, self.groups)
        return ops.linear(o.flatten(2), self.wo_b.weight)

    def _window_keys(self, kv: torch.Tensor, ctx: ForwardContext, state: LayerState
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys ``[B, W + S, hd]`` (ring then new rows) and their mask ``[B, S, W + S]``; then store
        the newest ``min(S, W)`` rows in the ring at ``pos % W``."""
        W, S = self.window, kv.shape[1]
        dev = kv.device
        ring = state.ring[ctx.slots]                                       # [B, W, hd]
        start, t = ctx.start.unsqueeze(1), ctx.positions                   # [B, 1], [B, S]
        r = torch.arange(W, device=dev)
        ring_pos = start - 1 - torch.remainder(start - 1 - r, W)          # [B, W] newest pos in row r
        ring_ok = (ring_pos >= 0).unsqueeze(1) & (ring_pos.unsqueeze(1) > t.unsqueeze(2) - W)
        s = torch.arange(S, device=dev)
        new_ok = (s.view(1, -1) <= s.view(-1, 1)) & (s.view(1, -1) > s.view(-1, 1) - W)  # [S, S]
        valid = torch.cat([ring_ok, new_ok.unsqueeze(0).expand(kv.shape[0], -1, -1)], dim=2)
        keys = torch.cat([ring, kv.to(ring.dtype)], dim=1)

        keep = min(S, W)
        rows = torch.remainder(t[:, S - keep:], W)                         # [B, keep]
        state.ring[ctx.slots.unsqueeze(1), rows] = kv[:, S - keep:].to(ring.dtype)
        return keys, valid

    def _compressed_keys(self, x: torch.Tensor, qr: torch.Tensor, ctx: ForwardContext, state: LayerState
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the compressor (and indexer) on the new tokens; return all entries ``[B, n, hd]`` of
        the slots and which of them each query attends to ``[B, S, n]``."""
        def finish(entry: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            cos, sin = ctx.rope_at("compress", pos)
            return self._kv_qat(ops.apply_rope(entry, cos, sin), ctx.qat_sim)

        comp = state.compressor
        self.compressor(x, ctx, comp, finish)
        n = comp.max_entries
        keys = comp.entries[ctx.slots, :n]
        if self.kind == "csa":
            valid = self.indexer(x, qr, ctx, state.indexer)
        else:
            visible = (ctx.positions + 1) // self.ratio
            valid = torch.arange(n, device=x.device) < visible.unsqueeze(-1)
        return keys, valid
