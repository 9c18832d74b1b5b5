"""Deterministic random weights for a network (the embedded tiny model, tests, benchmarks).

Scales are chosen so activations stay O(1) through many layers: linear weights ~ N(0, 1/in),
norm weights near 1, small mHC projections, distinct hash-routing experts per token.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_random(model: nn.Module, seed: int = 0) -> nn.Module:
    """Fill every parameter and buffer of ``model`` from ``seed`` (independent of device), in the
    checkpoint's order and by official name (:func:`~dsv4.weights.names.official_state_dict`): a
    routed expert is drawn on its own, into its slice of the stacked weight."""
    from ..weights.names import official_state_dict
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    # Scales that keep a deep random network's activations O(1): linear weights ~ N(0, 1/in) (unit
    # gain), norm weights ~1, small mHC projections (its sigmoids stay near 0.5, the Sinkhorn comb
    # near uniform), sinks/biases/ape O(0.5). The draw order is the checkpoint's (see
    # official_state_dict), so a model keeps its weights whatever shape our modules give them.
    for name, p in official_state_dict(dict(model.named_parameters())).items():
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * randn(*p.shape)
        elif leaf.endswith("_fn"):
            value = randn(*p.shape) * (0.5 / p.shape[1] ** 0.5)
        elif leaf.endswith("_base"):
            value = 0.2 * randn(*p.shape)
        elif leaf.endswith("_scale"):
            value = 0.5 + 0.5 * torch.rand(*p.shape, generator=g)
        elif leaf in ("attn_sink", "bias", "ape"):
            value = 0.5 * randn(*p.shape)
        elif name == "embed.weight":
            value = randn(*p.shape)
        elif p.dim() >= 2:
            value = randn(*p.shape) / p.shape[-1] ** 0.5
        else:
            value = randn(*p.shape)
        p.copy_(value.to(p.dtype))
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):       # hash routing: k distinct experts per token
            vocab, k = b.shape
            n_experts = _n_experts(model, name)
            b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(vocab)]).to(b.dtype))
    return model


def _n_experts(model: nn.Module, tid2eid_name: str) -> int:
    gate = model.get_submodule(tid2eid_name.rsplit(".", 1)[0])
    return gate.weight.shape[0]
