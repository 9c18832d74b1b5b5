"""A model with random weights built directly on a device in a release layout (benchmarks).

Real geometries are large (one V4-Flash layer holds ~3 GB of MXFP4 experts, 13 GB in BF16), so
nothing is built on the CPU or in BF16 first: the network is laid out on the ``meta`` device, the
routed experts are stacked from the start, and every weight is then made on the device in its target
format, one expert at a time (:meth:`Fp8BlockWeight.random` and friends). Layouts:

- ``bf16``: every linear BF16 (a plain BF16 checkpoint).
- ``fp8-mxfp4``: DeepSeek's release: FP8-block (ue8m0) attention, indexer ``wq_b`` and shared
  expert; MXFP4 routed experts; BF16 precision floor (head, router, compressor/indexer helpers).
- ``fp8-nvfp4``: NVIDIA's NVFP4 export: the same with NVFP4 routed experts.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from ..weights.names import module_to_official
from .common import Linear
from .transformer import Transformer

LAYOUTS = ("bf16", "fp8-mxfp4", "fp8-nvfp4")
_FLOOR = ("head", ".gate", "compressor.wkv", "compressor.wgate", "indexer.weights_proj", "e_proj", "h_proj")


def linear_format(name: str, layout: str) -> str:
    """The format the linear ``name`` has in ``layout``: bf16, fp8, mxfp4 or nvfp4."""
    if layout == "bf16" or name == "head" or any(name.endswith(f) for f in _FLOOR):
        return "bf16"
    if ".experts." in name or name.endswith(".experts"):
        return layout.split("-")[1]
    return "fp8"


@torch.no_grad()
def build_random_model(config: ModelConfig, layout: str, device: torch.device | str,
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0, with_mtp: bool = False) -> Transformer:
    """A :class:`Transformer` in ``layout`` with random weights, materialised on ``device`` only."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config, dtype, with_mtp=with_mtp)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.set_weight(_random_linear(module, linear_format(name, layout), dtype, device, g))
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.is_meta:
            owner, leaf = _owner(model, name)
            value = _random_tensor(module_to_official(name), p, device, g, config)
            if isinstance(p, nn.Parameter):
                owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[leaf] = value
    model.init_rope(device)
    if layout != "bf16":
        model.config.expert_dtype = "fp4"
        model.config.scale_fmt = "ue8m0"
    return model.eval()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def _random_linear(module: Linear, fmt: str, dtype: torch.dtype, device: torch.device,
                   g: torch.Generator) -> object:
    shape = tuple(module.weight.shape)
    std = shape[-1] ** -0.5
    if fmt == "fp8":
        return Fp8BlockWeight.random(shape, std, device, g)
    if fmt == "mxfp4":
        return Mxfp4Weight.random(shape, std, device, g)
    if fmt == "nvfp4":
        return Nvfp4Weight.random(shape, std, device, g)
    w = torch.empty(shape, dtype=dtype, device=device)
    for m in (w.view(-1, *shape[-2:])):
        m.normal_(0.0, std, generator=g)
    return w


def _random_tensor(name: str, p: torch.Tensor, device: torch.device, g: torch.Generator,
                   config: ModelConfig) -> torch.Tensor:
    """Norm weights ~1, mHC projections small, sinks/biases/ape O(0.5), hash routes random."""
    if name.endswith("tid2eid"):
        return torch.randint(0, config.n_routed_experts, p.shape, device=device, generator=g).to(p.dtype)
    out = torch.empty(p.shape, dtype=p.dtype, device=device)
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return out.normal_(1.0, 0.1, generator=g)
    if leaf.endswith("_fn"):
        return out.normal_(0.0, 0.5 / p.shape[-1] ** 0.5, generator=g)
    if leaf.endswith("_scale"):
        return out.uniform_(0.5, 1.0, generator=g)
    if name == "embed.weight":
        return out.normal_(0.0, 1.0, generator=g)
    return out.normal_(0.0, 0.5 if p.dim() == 1 else p.shape[-1] ** -0.5, generator=g)
