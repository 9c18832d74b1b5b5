"""The one dispatch point for every hot operation (DESIGN decision 1).

The model calls ``dsv4.ops.<op>(...)`` and never knows which implementation runs. Each op picks
an implementation from the tensors' device (and, for ``linear``, the weight's format type):
a registered fast kernel for that device when there is one, else the plain-torch reference in
:mod:`dsv4.ops.reference`. Kernels register themselves with :func:`register`; a kernel that
cannot handle its inputs must raise, never fall back silently to different numerics.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from . import reference

_KERNELS: dict[tuple[str, str], Callable] = {}


def register(op: str, device_type: str) -> Callable[[Callable], Callable]:
    """Decorator: make ``fn`` the implementation of ``op`` for tensors on ``device_type``."""
    def wrap(fn: Callable) -> Callable:
        _KERNELS[(op, device_type)] = fn
        return fn
    return wrap


def _pick(op: str, x: torch.Tensor) -> Callable:
    return _KERNELS.get((op, x.device.type)) or getattr(reference, op)


def linear(x: torch.Tensor, weight: object) -> torch.Tensor:
    """``x [..., K] @ weight.T -> [..., N]`` for a plain tensor or a quantized weight object.

    A plain tensor is used in ``x``'s dtype. Quantized weights (``dsv4.weights.formats``) are
    consumed in their packed form by the format's matmul, never expanded whole.
    """
    if isinstance(weight, torch.Tensor):
        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.linear(x, weight)
    fn = _KERNELS.get(("linear", x.device.type))
    if fn is not None:
        return fn(x, weight)
    from .quant_reference import quant_linear  # packed formats: tile-wise reference matmul
    return quant_linear(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _pick("rms_norm", x)(x, weight, eps)


def rms_norm_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _pick("rms_norm_unweighted", x)(x, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    return _pick("apply_rope", x)(x, cos, sin, inverse)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    return _pick("hadamard", x)(x)


def fp8_sim(x: torch.Tensor, block: int = 64, pow2_scale: bool = True) -> torch.Tensor:
    return _pick("fp8_sim", x)(x, block, pow2_scale)


def fp4_sim(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    return _pick("fp4_sim", x)(x, block)


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
            norm_eps: float, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _pick("mhc_pre", h)(h, fn, base, scale, iters, norm_eps, hc_eps)


def mhc_post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return _pick("mhc_post", h)(out, h, post, comb)


def hc_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float) -> torch.Tensor:
    return _pick("hc_head", h)(h, fn, base, scale, norm_eps, hc_eps)


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    return _pick("sparse_attention", q)(q, kv, valid, sink, scale)


def compress_windows(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor | None = None,
                     prev_gate: torch.Tensor | None = None) -> torch.Tensor:
    return _pick("compress_windows", kv)(kv, gate, prev_kv, prev_gate)


def indexer_scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return _pick("indexer_scores", q)(q, keys, weights)


def router_scores(logits: torch.Tensor, func: str) -> torch.Tensor:
    return _pick("router_scores", logits)(logits, func)


def route(scores: torch.Tensor, k: int, bias: torch.Tensor | None = None,
          fixed_ids: torch.Tensor | None = None, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return _pick("route", scores)(scores, k, bias, fixed_ids, scale)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return _pick("swiglu", gate)(gate, up, limit)


def grouped_linear(x: torch.Tensor, weight: object, groups: int) -> torch.Tensor:
    """Block-diagonal projection: group ``g`` of ``x [..., G, K]`` times rows ``g*r:(g+1)*r`` of
    ``weight [G*r, K]`` (the grouped output projection ``wo_a``). Returns ``[..., G, r]``."""
    if isinstance(weight, torch.Tensor):
        w = weight.to(x.dtype).unflatten(0, (groups, -1))  # [G, r, K]
        return torch.einsum("...gk,grk->...gr", x, w)
    fn = _KERNELS.get(("grouped_linear", x.device.type))
    if fn is not None:
        return fn(x, weight, groups)
    rows = weight.shape[-2] // groups
    outs = [F.linear(x[..., g, :], weight.dequantize_rows(g * rows, (g + 1) * rows, x.dtype))
            for g in range(groups)]
    return torch.stack(outs, dim=-2)


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: list, limit: float
                ) -> torch.Tensor:
    """Routed experts: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

    ``x [T, D]``, ``weights [T, k]`` fp32, ``ids [T, k]``; ``experts[e]`` has ``w1, w2, w3`` weights.
    Expert math in fp32 (``g = x w1^T``, ``u = x w3^T``, clamped SwiGLU, ``w2``).
    The reference runs every expert over every token with a dense per-expert weight (zero where
    not selected): no host read of the routing, so the step stays graph-capturable; fast kernels
    gather only the selected tokens.
    """
    fn = _KERNELS.get(("moe_experts", x.device.type))
    if fn is not None:
        return fn(x, weights, ids, experts, limit)
    dense = torch.zeros(x.shape[0], len(experts), dtype=torch.float32, device=x.device)
    dense.scatter_add_(1, ids, weights.float())
    xf = x.float()
    out = torch.zeros_like(xf)
    for e, expert in enumerate(experts):
        h = reference.swiglu(linear(xf, expert.w1.weight), linear(xf, expert.w3.weight), limit)
        weight = dense[:, e:e + 1]
        # where, not a plain product: an unselected expert's inf/NaN must not reach the token (0 * inf)
        out += torch.where(weight != 0, weight * linear(h, expert.w2.weight), 0.0)
    return out.to(x.dtype)
