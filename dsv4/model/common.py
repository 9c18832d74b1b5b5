"""Building blocks shared by the model modules: weight-holding Linear, RMSNorm, forward context.

Module attribute names follow DeepSeek's official checkpoint names, so ``state_dict()`` keys are
the official tensor names (``layers.0.attn.wq_a.weight``) and loading needs no renaming.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig


class Linear(nn.Module):
    """``y = x @ W.T`` where ``W`` is a tensor or a packed quantized weight object.

    The weight keeps its checkpoint format (DESIGN decision 2): :meth:`set_weight` swaps in an
    ``Fp8BlockWeight`` / ``Mxfp4Weight`` / ``Nvfp4Weight`` and :func:`dsv4.ops.linear` consumes it.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def set_weight(self, weight: object) -> None:
        """Replace the weight with a tensor or a quantized weight of the same ``[out, in]`` shape."""
        shape = tuple(weight.shape)[-2:]
        if shape != (self.out_features, self.in_features):
            raise ValueError(f"weight shape {shape} != expected {(self.out_features, self.in_features)}")
        if isinstance(weight, torch.Tensor):
            self._parameters.pop("weight", None)
            self.__dict__.pop("weight", None)
            self.weight = nn.Parameter(weight, requires_grad=False)
        else:
            self._parameters.pop("weight", None)
            object.__setattr__(self, "weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm with an fp32 weight (the precision floor keeps norms in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


@dataclass
class RopeTables:
    """cos/sin ``[B, S, rd/2]`` fp32 of the query positions, for one rope theta."""

    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input, for one forward over ``B`` slots x ``S`` tokens.

    ``start [B]`` is each row's first position (a device tensor: decode never reads it on the host);
    ``positions [B, S] = start + arange(S)``; ``slots [B]`` indexes the generation state's buffers.
    """

    config: ModelConfig
    token_ids: torch.Tensor   # [B, S] int64
    slots: torch.Tensor       # [B] int64
    start: torch.Tensor       # [B] int64
    positions: torch.Tensor   # [B, S] int64
    rope: dict[str, RopeTables]  # "main" (sliding layers) and "compress" (CSA/HCA layers)
    inv_freq: dict[str, torch.Tensor]
    qat_sim: bool

    def rope_at(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for other positions (compressed entries sit at their window's first position)."""
        return ops.reference.rope_cos_sin(positions, self.inv_freq[kind])

    @property
    def seq_len(self) -> int:
        return self.token_ids.shape[1]
