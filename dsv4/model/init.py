"""Deterministic random weights for a network (the embedded tiny model, tests, benchmarks).

Scales are chosen so activations stay O(1) through many layers: linear weights ~ N(0, 1/in),
norm weights near 1, small mHC projections, distinct hash-routing experts per token.
"""

from __future__ import annotations

import math
import zlib

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
        if name.endswith("tid2eid"):
            vocab, k = b.shape
            n_experts = _n_experts(model, name)
            b.copy_(torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(vocab)]).to(b.dtype))
    return model


def _n_experts(model: nn.Module, tid2eid_name: str) -> int:
    gate = model.get_submodule(tid2eid_name.rsplit(".", 1)[0])
    return gate.weight.shape[0]


# ----------------------------------------------------------------------------- random, sharded, on device
#: routed-expert formats and dense (attention + shared expert) formats :func:`random_sharded` makes
EXPERT_FORMATS = ("mxfp4", "nvfp4", "fp8", "bf16")
DENSE_FORMATS = ("fp8", "bf16")
_E2M1_RMS = 2.93        # root mean square of a uniformly random e2m1 code's value


@torch.no_grad()
def random_sharded(config, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                   parallel=None, seed: int = 0, experts: str = "mxfp4", dense: str = "fp8",
                   with_mtp: bool = False) -> nn.Module:
    """This rank's shard of a model with random weights made directly on ``device``: no checkpoint,
    no host copy of the whole (the 2xH200 benchmark builds the full V4-Flash geometry this way).

    Layout of a release (DSV4_FACTS 4): ``dense`` (``fp8``: FP8 block with ue8m0 scales, or ``bf16``)
    for attention projections, ``indexer.wq_b`` and the shared expert; ``experts`` (``mxfp4``,
    ``nvfp4``, ``fp8`` or ``bf16``) for the routed experts; the precision floor (head, router,
    compressor and indexer helpers, embedding, norms, mHC) in ``dtype``/fp32. Every tensor is drawn
    from its own generator seeded by ``(seed, name)`` as the full tensor and then sliced for this
    rank, and each routed expert from ``(seed, name, expert)``: the same network whatever the world
    size, so one process and N processes give the same logits. Packed values are random codes with
    scales that keep activations O(1) (weights ~ 1/sqrt(in)).
    """
    from ..parallel import SINGLE
    from ..weights.quantize import QuantSpec
    from ..weights.sharding import split_dim
    from .common import Linear
    from ..weights.names import module_to_official
    from .transformer import Transformer

    if experts not in EXPERT_FORMATS or dense not in DENSE_FORMATS:
        raise ValueError(f"random_sharded: experts must be one of {EXPERT_FORMATS} and dense one of "
                         f"{DENSE_FORMATS}; got {experts!r}, {dense!r}")
    tp = parallel or SINGLE
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(config, dtype, with_mtp=with_mtp, parallel=tp)
    draw = _Draw(seed, device, tp, config.n_routed_experts)
    spec = QuantSpec("mxfp4")    # which linears a release quantizes (attention, indexer.wq_b, shared expert)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if module.experts:
            moe = model.get_submodule(name.rsplit(".experts.", 1)[0])
            module.set_weight(draw.experts(name, module, moe.expert_start, experts, dtype))
            continue
        target = None if dense == "bf16" else spec.target(name)
        weight_name, dim = f"{name}.weight", split_dim(f"{name}.weight")
        full = list(module.weight.shape)
        if dim is not None:
            full[dim] *= tp.world_size
        module.set_weight(draw.linear(weight_name, tuple(full), dim, target, dtype))
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if p.device.type == "meta" and not name.startswith("inv_freq"):
            owner, leaf = _owner(model, name)
            official = module_to_official(name)        # seeded by the checkpoint's name
            value = draw.plain(official, p, split_dim(official))
            if isinstance(p, nn.Parameter):
                owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[leaf] = value
    model.init_rope(device)
    return model.eval()


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


class _Draw:
    """Random tensors on one device, each from a generator seeded by its name (order independent)."""

    def __init__(self, seed: int, device: torch.device, tp, n_experts: int):
        self.seed, self.device, self.tp, self.n_experts = seed, device, tp, n_experts

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def _mine(self, t: torch.Tensor, dim: int | None) -> torch.Tensor:
        """This rank's slice of a full tensor along ``dim`` (a contiguous copy; the full one is freed)."""
        if dim is None or self.tp.world_size == 1:
            return t
        return t.chunk(self.tp.world_size, dim)[self.tp.rank].contiguous()

    def _check(self, name: str, full: tuple[int, int], dim: int | None, target: str | None) -> None:
        """The loader's rule (:mod:`dsv4.weights.sharding`): splits fall on the format's blocks."""
        if dim is None or target is None or self.tp.world_size == 1:
            return
        align = 128 if target == "fp8" or dim == 1 else 1
        share = full[dim] // self.tp.world_size
        if share % align:
            from ..parallel import ShardError
            raise ShardError(f"cannot shard `{name}` ({target}, logical {list(full)}) across {self.tp.world_size} "
                             f"ranks: each rank's {share} {'rows' if dim == 0 else 'columns'} are not a multiple "
                             f"of the {align}-wide blocks")

    def linear(self, name: str, full: tuple[int, int], dim: int | None, target: str | None, dtype: torch.dtype):
        """A linear weight of logical shape ``full`` in ``target`` format (None: plain ``dtype``), this
        rank's slice along ``dim``."""
        from ..weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
        self._check(name, full, dim, target)
        g, (n, k), dev = self.gen(name), full, self.device
        if target is None:
            return self._mine(torch.randn(n, k, generator=g, device=dev, dtype=dtype) / k ** 0.5, dim)
        if target == "fp8":
            w = torch.randn(n, k, generator=g, device=dev).to(torch.float8_e4m3fn)
            # N(0, 1) codes times 2^-round(log2 sqrt(K)), one exponent lower on a random quarter of blocks
            low = torch.rand(-(-n // 128), -(-k // 128), generator=g, device=dev) < 0.25
            e = 127 - round(math.log2(k) / 2) - low.int()
            return Fp8BlockWeight(self._mine(w, dim), self._mine(e.to(torch.uint8), dim), name=name)
        packed = torch.randint(0, 256, (n, k // 2), generator=g, device=dev, dtype=torch.uint8)
        if target == "mxfp4":
            low = torch.rand(n, -(-k // 32), generator=g, device=dev) < 0.25
            e = 127 - round(math.log2(_E2M1_RMS * k ** 0.5)) - low.int()
            return Mxfp4Weight(self._mine(packed, dim), self._mine(e.to(torch.uint8), dim), name=name)
        bs = torch.ones(n, -(-k // 16), device=dev).to(torch.float8_e4m3fn)
        return Nvfp4Weight(self._mine(packed, dim), self._mine(bs, dim),
                           torch.tensor(1 / (_E2M1_RMS * k ** 0.5), device=dev), name=name)

    def experts(self, name: str, module: nn.Module, start: int, fmt: str, dtype: torch.dtype) -> object:
        """Stacked ``[E_local, N, K]`` weight of experts ``start ..``, each drawn from its own seed
        under its official name (``layers.0.ffn.experts.{e}.w1.weight``)."""
        head, proj = name.rsplit(".experts.", 1)
        per = [self.linear(f"{head}.experts.{start + e}.{proj}.weight", (module.out_features, module.in_features),
                           None, None if fmt == "bf16" else fmt, dtype) for e in range(module.experts)]
        return torch.stack(per) if isinstance(per[0], torch.Tensor) else type(per[0]).stack(per, name=f"{name}.weight")

    def plain(self, name: str, p: torch.Tensor, dim: int | None) -> torch.Tensor:
        """Parameters and buffers other than linear weights, by the rules of :func:`init_random`."""
        g, dev = self.gen(name), self.device
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= self.tp.world_size
        leaf = name.rsplit(".", 1)[-1]

        def randn() -> torch.Tensor:
            return torch.randn(*shape, generator=g, device=dev)

        if name.endswith("tid2eid"):     # k distinct experts per token
            vocab, k = shape
            return torch.rand(vocab, self.n_experts, generator=g, device=dev).argsort(-1)[:, :k].to(p.dtype)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * randn()
        elif leaf.endswith("_fn"):
            value = randn() * (0.5 / shape[1] ** 0.5)
        elif leaf.endswith("_base"):
            value = 0.2 * randn()
        elif leaf.endswith("_scale"):
            value = 0.5 + 0.5 * torch.rand(*shape, generator=g, device=dev)
        elif leaf in ("attn_sink", "bias", "ape"):
            value = 0.5 * randn()
        elif name == "embed.weight":
            value = torch.randn(*shape, generator=g, device=dev, dtype=p.dtype)
        elif len(shape) >= 2:
            value = randn() / shape[-1] ** 0.5
        else:
            value = randn()
        return self._mine(value.to(p.dtype), dim)
