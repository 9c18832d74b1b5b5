"""Manifold-constrained hyper-connections (mHC): ``nc`` residual streams per token.

DSV4_FACTS section 2, "mHC pre/post" and "Head". Each block has two mixers (``hc_attn_*`` before
attention, ``hc_ffn_*`` before the MoE) with parameters ``fn [(2+nc)*nc, nc*D]``,
``base [(2+nc)*nc]``, ``scale [3]``; the model has a final ``hc_head_*`` (``fn [nc, nc*D]``,
``base [nc]``, ``scale [1]``) that collapses the streams before the final norm. The math lives in
:func:`dsv4.ops.mhc_pre` / :func:`dsv4.ops.mhc_post` / :func:`dsv4.ops.hc_head`.

    streams h [B,S,nc,D] --pre--> block input y [B,S,D] --block--> out [B,S,D]
    h_next[k] = post_k * out + sum_j comb[j,k] * h[j]          (comb is not symmetric)
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from .common import fp32_param


def add_mixer_params(module: nn.Module, prefix: str, nc: int, hidden: int) -> None:
    """Register ``{prefix}_fn``, ``{prefix}_base``, ``{prefix}_scale`` (official names) on ``module``."""
    n_mix = (2 + nc) * nc
    module.register_parameter(f"{prefix}_fn", fp32_param(n_mix, nc * hidden))
    module.register_parameter(f"{prefix}_base", fp32_param(n_mix))
    module.register_parameter(f"{prefix}_scale", fp32_param(3))


def add_head_params(module: nn.Module, nc: int, hidden: int) -> None:
    """Register ``hc_head_fn [nc, nc*D]``, ``hc_head_base [nc]``, ``hc_head_scale [1]`` on ``module``."""
    module.register_parameter("hc_head_fn", fp32_param(nc, nc * hidden))
    module.register_parameter("hc_head_base", fp32_param(nc))
    module.register_parameter("hc_head_scale", fp32_param(1))


class Mixer:
    """Reads one mixer's parameters off a module and applies mHC pre/post with them."""

    def __init__(self, module: nn.Module, prefix: str, config: ModelConfig):
        self.module, self.prefix = module, prefix
        self.iters, self.norm_eps, self.hc_eps = config.hc_sinkhorn_iters, config.rms_norm_eps, config.hc_eps

    def pre(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h [B, S, nc, D]`` -> block input ``[B, S, D]``, ``post [B, S, nc]``, ``comb [B, S, nc, nc]``."""
        m, p = self.module, self.prefix
        return ops.mhc_pre(h, getattr(m, f"{p}_fn"), getattr(m, f"{p}_base"), getattr(m, f"{p}_scale"),
                           self.iters, self.norm_eps, self.hc_eps)

    @staticmethod
    def post(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return ops.mhc_post(out, h, post, comb)


def collapse_head(module: nn.Module, h: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Final collapse of ``h [B, S, nc, D]`` with ``module``'s ``hc_head_*`` -> ``[B, S, D]``."""
    return ops.hc_head(h, module.hc_head_fn, module.hc_head_base, module.hc_head_scale,
                       config.rms_norm_eps, config.hc_eps)
