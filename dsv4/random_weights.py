"""Models with random weights made directly on a device, for benchmarks and the GPU tests (no
checkpoint, no host copy of the whole). Production code does not import this module.

Real geometries are large (one V4-Flash layer holds ~3 GB of MXFP4 experts, 13 GB in BF16), so
nothing is built on the CPU or in BF16 first: the network is laid out on the ``meta`` device (routed
experts stacked from the start) and every weight is then made on the device in its target format.

- :func:`build_random_model`: one process, one generator, layouts ``bf16``, ``fp8-mxfp4`` (DeepSeek's
  release: FP8-block (ue8m0) attention, indexer ``wq_b`` and shared expert; MXFP4 routed experts;
  BF16 precision floor: head, router, compressor/indexer helpers) and ``fp8-nvfp4`` (NVIDIA's NVFP4
  export: the same with NVFP4 routed experts).
- :func:`random_sharded`: a rank's shard under tensor/expert parallel, every tensor seeded by its
  checkpoint name, so one process and N processes hold the same network.

The small models of the CPU tests and the embedded tiny model use :func:`dsv4.model.init.init_random`.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from .config import ModelConfig
from .model.common import Linear
from .model.transformer import Transformer
from .weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
from .weights.names import module_to_official

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
        if p.is_meta and name not in Transformer.ROPE_BUFFERS:
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
    from .parallel import SINGLE
    from .weights.quantize import QuantSpec
    from .weights.sharding import split_dim

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
        if p.device.type == "meta" and name not in Transformer.ROPE_BUFFERS:
            owner, leaf = _owner(model, name)
            official = module_to_official(name)        # seeded by the checkpoint's name
            value = draw.plain(official, p, split_dim(official))
            if isinstance(p, nn.Parameter):
                owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[leaf] = value
    model.init_rope(device)
    return model.eval()


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
            from .parallel import ShardError
            raise ShardError(f"cannot shard `{name}` ({target}, logical {list(full)}) across {self.tp.world_size} "
                             f"ranks: each rank's {share} {'rows' if dim == 0 else 'columns'} are not a multiple "
                             f"of the {align}-wide blocks")

    def linear(self, name: str, full: tuple[int, int], dim: int | None, target: str | None, dtype: torch.dtype):
        """A linear weight of logical shape ``full`` in ``target`` format (None: plain ``dtype``), this
        rank's slice along ``dim``."""
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
        """Parameters and buffers other than linear weights, by the rules of :func:`~dsv4.model.init.init_random`."""
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
