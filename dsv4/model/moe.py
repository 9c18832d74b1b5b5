"""Mixture of experts: hash or sqrtsoftplus router, clamped SwiGLU experts, one shared expert.

DSV4_FACTS section 2, "MoE". Router in fp32: ``s = score(x gate^T)``; hash layers select
``tid2eid[token_id]``, the others ``topk(s + bias)`` (the bias only selects); the selected scores,
normalised to sum 1 and times ``routed_scaling_factor``, weight the experts' outputs. Each expert is
``w2(silu(min(x w1^T, L)) * clamp(x w3^T, -L, L))``; the shared expert is the same and always on.

The routed experts have one shape, from construction on: one stacked ``[E, N, K]`` weight per
projection (``experts.w1``, ...) in its checkpoint format, the form :func:`dsv4.ops.moe` consumes
(reading only the selected experts' bytes). A checkpoint holds them one by one
(``experts.{e}.w1``); the loader writes each into its slice ``e`` (:mod:`dsv4.weights.names`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup
from .common import ForwardContext, Linear, fp32_param


class Expert(nn.Module):
    """The shared expert's weights: ``w1`` (gate) and ``w3`` (up) ``[I, D]``, ``w2`` (down) ``[D, I]``.
    It runs inside :func:`dsv4.ops.moe` with the routed experts (one pair of launches for all)."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden, inter, dtype)
        self.w2 = Linear(inter, hidden, dtype)
        self.w3 = Linear(hidden, inter, dtype)

    def weights(self) -> tuple[object, object, object]:
        """``(w1, w3, w2)`` as the ops consume them."""
        return self.w1.w, self.w3.w, self.w2.w


class RoutedExperts(nn.Module):
    """The routed experts of a layer as three stacked weights ``w1, w3 [E, I, D]``, ``w2 [E, D, I]``."""

    def __init__(self, hidden: int, inter: int, n_experts: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(hidden, inter, dtype, experts=n_experts)
        self.w2 = Linear(inter, hidden, dtype, experts=n_experts)
        self.w3 = Linear(hidden, inter, dtype, experts=n_experts)
        self.limit = limit

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                shared: Expert | None = None) -> torch.Tensor:
        """``x [T, D]``, local expert ids ``[T, k]`` (``-1``: none), routing weights ``[T, k]`` ->
        ``[T, D]`` (plus the ``shared`` expert's output), by the op registered for ``(moe, x.device,
        routed expert format)``."""
        # One op for the three projections: the kernels read only the picked experts' slices, and
        # the routing weight multiplies silu(g) * u before w2's input is rounded (DSV4_FACTS 2b).
        # The mode (QAT rounding, scale format) is the projections' own, the same for w1, w2, w3 (and
        # the shared expert's: set_qat_sim sets every expert projection alike).
        w1 = self.w1
        return ops.moe(x, ids, weights, w1.w, self.w3.w, self.w2.w, self.limit, w1.act_quant, w1.pow2,
                       shared.weights() if shared is not None else None)


class Gate(Linear):
    """Router: ``weight [E, D]``; ``bias [E]`` (top-k layers) or ``tid2eid [vocab, k]`` (hash layers)."""

    def __init__(self, config: ModelConfig, is_hash: bool, dtype: torch.dtype):
        c = config
        super().__init__(c.hidden_size, c.n_routed_experts, dtype, qat_act=False)
        self.is_hash, self.topk, self.func = is_hash, c.num_experts_per_tok, c.scoring_func
        self.route_scale = c.routed_scaling_factor
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, c.num_experts_per_tok, dtype=torch.int32))
        else:
            self.bias = fp32_param(c.n_routed_experts)

    def route(self, x: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, D]``, ``token_ids [T]`` -> ``(weights [T, k] fp32, expert ids [T, k] int64)``."""
        # the router is the precision floor: a plain weight, fp32 logits, never QAT-rounded input;
        # projection, scores, selection and weights are one op (one kernel when decoding on the GPU)
        # hash layers (the first ones) route by token id through a fixed table; the scores still weigh
        if self.is_hash:
            return ops.router(x, self.w, self.func, self.topk, tid2eid=self.tid2eid, token_ids=token_ids,
                              scale=self.route_scale)
        return ops.router(x, self.w, self.func, self.topk, bias=self.bias, scale=self.route_scale)


class MoE(nn.Module):
    """Official names: ``gate``, ``experts.{e}.w1/w2/w3`` (stacked: ``experts.w1``), ``shared_experts.*``.

    Expert parallel (``tp``): a rank holds the ``E/N`` whole experts ``[expert_start, expert_start +
    E/N)`` under local indices ``0 .. E/N - 1`` and the shared expert's slice ``I/N`` of its
    intermediate dim (``w1``/``w3`` rows, ``w2`` columns). The router is replicated: every rank routes
    every token, runs the picks it holds (the others become ``-1``), and one all-reduce sums the
    routed and shared partial outputs of all ranks.
    """

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 prefix: str | None = None):
        super().__init__()
        c = config
        prefix = prefix or f"layers.{layer}.ffn"
        is_hash = layer < c.num_hidden_layers and c.hash_layers[layer]
        self.tp, self.limit, self.dtype = tp, c.swiglu_limit, dtype
        self.n_experts = c.n_routed_experts
        self.expert_start, stop = tp.local_range(c.n_routed_experts, "routed experts (n_routed_experts)",
                                                 f"{prefix}.experts")
        self.gate = Gate(c, is_hash, dtype)
        self.experts = RoutedExperts(c.hidden_size, c.moe_intermediate_size, stop - self.expert_start,
                                     c.swiglu_limit, dtype)
        inter = tp.split(c.moe_intermediate_size, "intermediate channels (moe_intermediate_size)",
                         f"{prefix}.shared_experts.w1.weight") if c.n_shared_experts else 0
        self.shared_experts = (Expert(c.hidden_size, inter, c.swiglu_limit, dtype) if c.n_shared_experts else None)

    #: the routed experts are always one stacked weight per projection (there is no other shape)
    stacked = True

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [B, S, D]`` -> ``[B, S, D]``."""
        # One token through the layer (k = num_experts_per_tok, E routed experts):
        #
        #   x --gate (fp32)--> scores [E] --hash: tid2eid[token] / top-k of scores + bias--> k ids
        #     weights = scores[ids] / sum * routed_scaling_factor
        #   out = sum_j weights_j * expert_{ids_j}(x)  +  shared_expert(x)
        #
        # Expert parallel: this rank holds experts [expert_start, expert_start + E/N) as its local
        # slices 0 .. E/N - 1; picks of other ranks' experts become -1 (skipped), and the
        # all-reduce adds the ranks' partial sums (each pick counted on exactly one rank).
        flat = x.flatten(0, 1)
        weights, ids = self.gate.route(flat, ctx.token_ids.flatten())
        # the shared expert runs in the same op (on the GPU: in the routed experts' two launches)
        out = self.experts(flat, self.local_ids(ids), weights, self.shared_experts)
        return self.tp.all_reduce_sum(out).view_as(x)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids ``[T, k]`` -> indices into this rank's experts, ``-1`` for other ranks'."""
        # 8 experts on 2 ranks, rank 1 holds experts 4..7 as 0..3:  ids [1, 6] -> [-1, 2]
        n_local = self.experts.w1.experts
        if n_local == self.n_experts:
            return ids
        local = ids - self.expert_start
        return torch.where((local >= 0) & (local < n_local), local, -1)
