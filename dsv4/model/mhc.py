"""Manifold-constrained hyper-connections (mHC): ``nc`` residual streams per token.

DSV4_FACTS section 2, "mHC pre/post" and "Head"; the paper's mHC (eqs. for ``H_pre``, ``H_post``,
``H_res`` with Sinkhorn-projected ``H_res``). The residual is ``nc = hc_mult`` (4) copies of the
hidden state. Each block has two :class:`HyperConnection` (``hc_attn`` around attention, ``hc_ffn``
around the MoE); the model and each MTP block end in a :class:`HyperHead` that collapses the
streams. The math lives in :func:`dsv4.ops.fused.mhc_pre_norm` / :func:`dsv4.ops.mhc_post` /
:func:`dsv4.ops.fused.hc_head_norm` (each collapse fused with the RMSNorm that follows it: the block's
``attn_norm`` / ``ffn_norm``, the model's final ``norm``), and in :func:`dsv4.ops.fused.mhc_post_pre_norm`
(a block's attention post with its MoE pre: one op); these modules own the parameters (checkpoint
names ``hc_attn_fn``, ``hc_attn_base``, ``hc_attn_scale``, mapped in :mod:`dsv4.weights.names`).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops import fused
from ..config import ModelConfig
from .common import RMSNorm, fp32_param


# One block, the four streams h[0..3] of one token (nc = hc_mult = 4):
#
#   h[0]  h[1]  h[2]  h[3]                      [nc, D] residual streams
#     \     |     |     /
#      pre: y = sum_j pre_j * h[j]               one [D] block input; pre, post, comb all come from
#             |                                  fn . rmsnorm(flatten(h)), scaled and shifted
#      attn_norm -> attention -> out             (the second mixer: ffn_norm -> MoE)
#             |
#      post: h'[k] = post_k * out + sum_j comb[j, k] * h[j]
#     /     |     |     \                        comb: [nc, nc], Sinkhorn-normalised (rows and
#   h'[0] h'[1] h'[2] h'[3]                      columns sum to ~1), not symmetric: comb.T @ h
#
# The streams start as nc copies of the embedding (Transformer.hidden_streams) and end in the
# HyperHead, which collapses them with its own sigmoid weights before the final norm.


class HyperConnection(nn.Module):
    """One mHC mixer: ``fn [(2+nc)*nc, nc*D]``, ``base [(2+nc)*nc]``, ``scale [3]`` (fp32).

    ``fn`` projects the RMS-normed flattened streams to the ``nc`` pre weights, ``nc`` post weights
    and the ``nc x nc`` comb logits; ``base`` and ``scale`` shift and scale the three parts."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        nc, n_mix = config.hc_mult, (2 + config.hc_mult) * config.hc_mult
        self.fn = fp32_param(n_mix, nc * config.hidden_size)
        self.base = fp32_param(n_mix)
        self.scale = fp32_param(3)
        self.iters, self.norm_eps, self.hc_eps = config.hc_sinkhorn_iters, config.rms_norm_eps, config.hc_eps

    def pre(self, h: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [B, S, nc, D]`` -> block input ``norm(y)`` ``[B, S, D]`` (``y`` the collapsed streams, ``norm``
        the block's ``attn_norm`` / ``ffn_norm``), ``post [B, S, nc]``, ``comb [B, S, nc, nc]``."""
        return fused.mhc_pre_norm(h, self.fn, self.base, self.scale, self.iters, self.norm_eps, self.hc_eps,
                                      norm.weight, norm.eps)

    @staticmethod
    def post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Mix the block output ``out [B, S, D]`` back into the streams ``h [B, S, nc, D]``."""
        return ops.mhc_post(out, h, post, comb)

    def post_pre(self, out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The previous mixer's :meth:`post` (its ``post``, ``comb``), then this one's :meth:`pre`, in
        one op (the streams are projected as they are made): ``(h_next, norm(y), post, comb)``."""
        return fused.mhc_post_pre_norm(out, h, post, comb, self.fn, self.base, self.scale, self.iters, self.norm_eps,
                                       self.hc_eps, norm.weight, norm.eps)


class HyperHead(nn.Module):
    """The final collapse of the streams: ``fn [nc, nc*D]``, ``base [nc]``, ``scale [1]`` (fp32);
    ``h [B, S, nc, D]`` -> ``sum_j w_j * h[j]`` ``[B, S, D]`` with sigmoid weights from ``fn``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        nc = config.hc_mult
        self.fn = fp32_param(nc, nc * config.hidden_size)
        self.base = fp32_param(nc)
        self.scale = fp32_param(1)
        self.norm_eps, self.hc_eps = config.rms_norm_eps, config.hc_eps

    def forward(self, h: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``h [..., nc, D]`` -> ``norm(collapse(h))`` ``[..., D]`` (``norm``: the final RMSNorm)."""
        return fused.hc_head_norm(h, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, norm.weight,
                                      norm.eps)
