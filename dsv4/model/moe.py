"""Mixture of experts: hash or sqrtsoftplus router, clamped SwiGLU experts, one shared expert.

DSV4_FACTS section 2, "MoE". Router in fp32: ``s = score(x gate^T)``; hash layers select
``tid2eid[token_id]``, the others ``topk(s + bias)`` (the bias only selects); the selected scores,
normalised to sum 1 and times ``routed_scaling_factor``, weight the experts' outputs. Each expert is
``w2(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L))``; the shared expert is the same and always on.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .common import Linear, fp32_param


class Expert(nn.Module):
    """One SwiGLU expert: ``w1`` (gate) and ``w3`` (up) ``[I, D]``, ``w2`` (down) ``[D, I]``."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden, inter, dtype)
        self.w2 = Linear(inter, hidden, dtype)
        self.w3 = Linear(hidden, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        h = ops.swiglu(ops.linear(xf, self.w1.weight), ops.linear(xf, self.w3.weight), self.limit)
        return ops.linear(h, self.w2.weight).to(x.dtype)


class Gate(Linear):
    """Router: ``weight [E, D]``; ``bias [E]`` (top-k layers) or ``tid2eid [vocab, k]`` (hash layers)."""

    def __init__(self, config: ModelConfig, is_hash: bool, dtype: torch.dtype):
        c = config
        super().__init__(c.hidden_size, c.n_routed_experts, dtype)
        self.is_hash, self.topk, self.func = is_hash, c.num_experts_per_tok, c.scoring_func
        self.scale = c.routed_scaling_factor
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.int32))
        else:
            self.bias = fp32_param(c.n_routed_experts)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]``, ``token_ids [T]`` -> ``(weights [T, k] fp32, expert ids [T, k])``."""
        scores = ops.router_scores(ops.linear(x.float(), self.weight), self.func)
        if self.is_hash:
            return ops.route(scores, self.topk, fixed_ids=self.tid2eid[token_ids], scale=self.scale)
        return ops.route(scores, self.topk, bias=self.bias, scale=self.scale)


class MoE(nn.Module):
    """Official names: ``gate``, ``experts.{e}.w1/w2/w3``, ``shared_experts.w1/w2/w3``."""

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype):
        super().__init__()
        c = config
        is_hash = layer < c.num_hidden_layers and c.hash_layers[layer]
        self.limit = c.swiglu_limit
        self.gate = Gate(c, is_hash, dtype)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype)
                                     for _ in range(c.n_routed_experts))
        self.shared_experts = (Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype)
                               if c.n_shared_experts else None)

    def stack_experts(self) -> None:
        """Stack the routed experts' weights into ``[E, N, K]`` tensors / packed weights (for grouped
        kernels) and make each expert's weight a view of its row, so memory is held once."""
        from ..weights.formats import QuantWeight

        self.stacked = {}
        for proj in ("w1", "w2", "w3"):
            ws = [getattr(e, proj).weight for e in self.experts]
            if isinstance(ws[0], torch.Tensor):
                stacked = torch.stack([w.data for w in ws])
                views = list(stacked.unbind(0))
            elif all(type(w) is type(ws[0]) for w in ws) and isinstance(ws[0], QuantWeight):
                stacked = type(ws[0]).stack(ws, name=f"experts.{proj}")
                views = [stacked.expert(e) for e in range(len(ws))]
            else:
                raise ValueError(f"routed experts mix weight formats in {proj}: "
                                 f"{sorted({type(w).__name__ for w in ws})}")
            for expert, view in zip(self.experts, views):
                getattr(expert, proj).set_weight(view)
            self.stacked[proj] = stacked

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """``x [B, S, D]``, ``token_ids [B, S]`` -> ``[B, S, D]``."""
        flat = x.flatten(0, 1)
        weights, ids = self.gate(flat, token_ids.flatten())
        out = ops.moe_experts(flat, weights, ids, list(self.experts), self.limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view_as(x)
