"""Building blocks shared by the model modules: weight-holding Linear, RMSNorm, forward context.

Module attribute names follow DeepSeek's official checkpoint names, so ``state_dict()`` keys are
the official tensor names (``layers.0.attn.wq_a.weight``, ``layers.0.attn.wq_a.scale``), except the
mHC modules' and the stacked routed experts', which :mod:`dsv4.weights.names` maps. The linears'
numerics (W8A8 / W4A8 under the QAT simulation) are DSV4_FACTS section 2b; RMSNorm and RoPE are
section 2 ("Attention").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup


class Linear(nn.Module):
    """Holds one linear weight ``[out, in]`` in its checkpoint format (DESIGN decision 2).

    A plain weight is the parameter ``weight``. A packed one (``Fp8BlockWeight``, ``Mxfp4Weight``,
    ``Nvfp4Weight``, or a stack of experts ``[E, out, in]``) is registered as buffers under its
    on-disk names (``weight`` + ``scale``, or ModelOpt's ``weight_scale``/``weight_scale_2``/
    ``input_scale``), so ``.to()``, ``state_dict()`` and ``named_buffers()`` see every byte;
    :attr:`w` is the typed weight the ops consume, rebound whenever the buffers move.

    The module owns how it multiplies: ``self.wq_a(x)``. Its format is fixed at load
    (:meth:`set_weight`) and whether it rounds its input (the QAT simulation, DSV4_FACTS 2b) is set
    once per mode (:func:`set_qat_sim`); :func:`dsv4.ops.linear` then dispatches on
    ``(op, device, weight format)`` to a registered kernel or the reference.
    """

    # How a call is dispatched (dsv4.ops): the weight's type picks the kernel, never a flag.
    #
    #   self.wq_a(x) -> ops.linear(x, w, act_quant, pow2) -> kernel for ("linear", x.device, type(w))
    #       type(w):  torch.Tensor (bf16/fp32)   Fp8BlockWeight   Mxfp4Weight   Nvfp4Weight
    #       act_quant on (QAT):  input as is      x -> e4m3 per 1x128 block, then W8A8 / W4A8
    #
    # No kernel registered for that key (the CPU, or a shape a kernel refuses): the reference.

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.bfloat16,
                 experts: int = 0, qat_act: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.experts = in_features, out_features, experts
        #: whether the QAT simulation rounds this projection's input (False: router, head, ``wo_a``)
        self.qat_act = qat_act
        #: the multiplication mode, set once by :func:`set_qat_sim` (not per call): round the input
        #: to e4m3 per 1x128 block before an FP8/FP4 weight (W8A8 / W4A8), with power-of-two scales
        #: when ``pow2``. Plain weights never round their input (see :func:`dsv4.ops.linear`).
        self.act_quant, self.pow2 = False, True
        shape = (experts, out_features, in_features) if experts else (out_features, in_features)
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.packed: object | None = None  # the typed weight when the checkpoint format is packed

    @property
    def w(self) -> object:
        """The weight as the ops consume it: a tensor, or a typed packed weight."""
        return self.packed if self.packed is not None else self.weight

    @property
    def format_name(self) -> str:
        return self.packed.dtype_name if self.packed is not None else str(self.weight.dtype).removeprefix("torch.")

    def set_weight(self, weight: object) -> None:
        """Replace the weight with a tensor or a packed weight of the same logical shape."""
        want = (self.experts, self.out_features, self.in_features) if self.experts else \
            (self.out_features, self.in_features)
        if tuple(weight.shape) != want:
            raise ValueError(f"weight shape {tuple(weight.shape)} != expected {want}")
        self._drop_weight()
        self.__dict__.pop("weight", None)
        if isinstance(weight, torch.Tensor):
            self.packed = None
            self.weight = nn.Parameter(weight, requires_grad=False)
            return
        self.packed = weight
        for name, t in weight.tensors().items():
            self.register_buffer(name, t)

    def _drop_weight(self) -> None:
        """Unregister the weight: the parameter, or the packed weight's buffers (other buffers of
        subclasses, such as the router's ``tid2eid``, stay)."""
        if self.packed is not None:
            for name in self.packed.tensors():
                self._buffers.pop(name, None)
        self._parameters.pop("weight", None)
        self.packed = None

    def release(self) -> None:
        """Drop the weight's storage (it moved elsewhere, e.g. into a stacked expert weight)."""
        self._drop_weight()

    def _rebind(self) -> None:
        if self.packed is not None:
            self.packed = self.packed.with_tensors({k: self._buffers[k] for k in self.packed.tensors()})

    def _apply(self, fn, recurse: bool = True):  # .to(), .cuda(), ... move the buffers: follow them
        names = list(self.packed.tensors()) if self.packed is not None else []
        before = {k: self._buffers[k].dtype for k in names}
        super()._apply(fn, recurse)
        if self.packed is not None:
            changed = [k for k in names if self._buffers[k].dtype != before[k]]
            if changed:
                raise TypeError(f"a packed {self.packed.dtype_name} weight cannot change dtype "
                                f"(buffers {changed}); move it with .to(device) only")
            self._rebind()
        return self

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._rebind()

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._parameters.values(), *self._buffers.values())
                   if t is not None)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` (``out_dtype``, default ``x.dtype``; fp32 accumulation),
        by the op registered for ``(linear, x.device, weight format)``."""
        return ops.linear(x, self.w, self.act_quant, self.pow2, out_dtype)


class GroupedLinear(Linear):
    """A block-diagonal projection (attention's ``wo_a``): weight ``[G*r, K]``, input ``[..., G, K]``,
    group ``g`` times rows ``g*r:(g+1)*r`` -> ``[..., G, r]``. Its input is never rounded (DeepSeek's
    code runs it as a BF16 einsum over the dequantized weight)."""

    def __init__(self, in_features: int, out_features: int, groups: int, dtype: torch.dtype = torch.bfloat16):
        super().__init__(in_features, out_features, dtype, qat_act=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.grouped_linear(x, self.w, self.groups)


def set_qat_sim(module: nn.Module, on: bool, pow2: bool) -> None:
    """Set how every :class:`Linear` under ``module`` multiplies: with ``on`` (the QAT simulation,
    DSV4_FACTS 2b) those that take part (``qat_act``) round their FP8/FP4 input, scales power-of-two
    when ``pow2``. Called when the mode changes (:meth:`~dsv4.model.transformer.Transformer.set_qat_sim`),
    never per forward."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.act_quant, m.pow2 = on and m.qat_act, pow2


class VocabEmbedding(nn.Module):
    """Token embedding ``weight [V/N, D]``: rows ``[vocab_start, vocab_start + V/N)`` of the vocabulary
    on this rank (vocab parallel; the whole table at world size 1).

    A rank looks up the ids it holds and writes zeros for the others; the sum over ranks (one
    all-reduce) is then every token's row, exactly (``x + 0``).
    """

    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE, name: str = "embed"):
        super().__init__()
        self.tp, self.vocab = tp, vocab
        self.vocab_start, stop = tp.local_range(vocab, "vocab entries (vocab_size)", f"{name}.weight")
        self.weight = nn.Parameter(torch.empty(stop - self.vocab_start, dim, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [...]`` int64 -> ``[..., D]``."""
        # Vocab parallel, V = 8 on 2 ranks: rank 0 holds rows 0..3, rank 1 rows 4..7. Token 6:
        #   rank 0: not mine -> zeros      rank 1: local row 2 -> embed[6]      sum -> embed[6]
        if not self.tp.parallel:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = nn.functional.embedding(torch.where(mine, local, 0), self.weight)
        return self.tp.all_reduce_sum(rows * mine.unsqueeze(-1).to(rows.dtype))


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
class RopeSpec:
    """The RoPE tables of a forward, made in one pass (:meth:`tables`): table ``k`` is ``names[k]``,
    taken at the positions rounded down to a multiple of ``step[k]``, with ``inv_freq[k]``.

    The model's (:meth:`~dsv4.model.transformer.Transformer.rope_spec`): ``main`` (``rope_theta``)
    and ``compress`` (``compress_rope_theta``) at the positions (step 1), and ``window:m`` for each
    compress ratio ``m``: the compress theta at each token's window start ``pos // m * m``, where
    the entry its window emits sits (a decode step's compressor rotates the entry that closes at the
    token with it). One pass makes all of them with the launches one table took (the four tables
    of a CSA + HCA model: six launches, where each took four).
    """

    names: tuple[str, ...]
    step: torch.Tensor          # [K, 1, 1] int64
    inv_freq: torch.Tensor      # [K, 1, 1, rd/2] fp32

    def tables(self, positions: torch.Tensor) -> dict[str, RopeTables]:
        """``{name: RopeTables}`` of ``positions [B, S]`` (each table contiguous)."""
        at = positions.unsqueeze(0) // self.step * self.step                      # [K, B, S]
        cos, sin = ops.rope_cos_sin(at, self.inv_freq)                             # [K, B, S, rd/2]
        return {name: RopeTables(cos[k], sin[k]) for k, name in enumerate(self.names)}


@dataclass
class ForwardContext:
    """Everything a layer needs besides its input, for one forward over ``B`` slots x ``S`` tokens.

    ``start [B]`` is each row's first position (a device tensor: decode never reads it on the host);
    ``positions [B, S] = start + arange(S)``; ``slots [B]`` indexes the generation state's buffers.
    ``context_bound`` is a host-known bound on ``positions + 1`` over the batch (the longest
    context any row can see this forward; a captured graph uses the state's full length), which
    bounds how many compressed entries the ops read. ``qat_sim``: the QAT simulation is on (the
    indexer rounds its queries to FP4; the linears know it already, :func:`set_qat_sim`, and the
    cache rounds by its layout).
    """

    config: ModelConfig
    token_ids: torch.Tensor   # [B, S] int64
    slots: torch.Tensor       # [B] int64
    start: torch.Tensor       # [B] int64
    positions: torch.Tensor   # [B, S] int64
    #: "main" (sliding layers), "compress" (CSA/HCA layers), "window:m" (their compressors' decode step)
    rope: dict[str, RopeTables]
    inv_freq: dict[str, torch.Tensor]
    qat_sim: bool
    context_bound: int
    #: a varlen forward (:meth:`varlen`): the rows as groups of equal length, each a context of its
    #: own over a contiguous run of the flattened tokens. ``None``: the whole ``[B, S]`` is one group.
    groups: tuple["ForwardContext", ...] | None = None
    #: within a varlen forward: this group's first token in the flattened order
    offset: int = 0
    #: prefix caching, a group of one prompt row: ``(start, boundary, stage)`` per block boundary
    #: strictly inside the row, host ints; each layer leaves its ``window`` pieces as they are at
    #: ``boundary`` in slot ``stage`` of its :attr:`~dsv4.model.cache.LayerCache.stage` state
    snaps: tuple[tuple[int, int, int], ...] = ()

    # A varlen forward, rows of lengths 3, 3 and 1 (a prefill chunk of two rows and one decode):
    #
    #   token_ids [T = 7]:  a0 a1 a2 | b0 b1 b2 | c0
    #   groups:             group 0: b = 2 rows x s = 3 (offset 0) | group 1: 1 x 1 (offset 6)
    #
    # Token-wise layers (linears, MoE, mHC, norms) see all 7 tokens as [1, 7]; attention, the
    # compressor and the indexer run once per group on its [b, s] view (per_group).
    @classmethod
    def varlen(cls, config: ModelConfig, token_ids: torch.Tensor, groups: list[tuple[torch.Tensor, torch.Tensor, int, int]],
               rope_spec: RopeSpec, inv_freq: dict[str, torch.Tensor], qat_sim: bool,
               snaps: dict[int, tuple[tuple[int, int, int], ...]] | None = None) -> "ForwardContext":
        """One forward over rows of different lengths (DESIGN decision 6): ``token_ids [T]`` are the
        rows' tokens back to back, in ``groups`` of rows of equal length ``s``: ``(slots [b],
        start [b], s, context_bound)`` each, ``b * s`` tokens. Token-wise layers see ``[1, T]``;
        attention, the compressor and the indexer run once per group (:meth:`per_group`).
        ``rope_spec`` makes the RoPE tables; ``inv_freq`` by theta (``main``, ``compress``) serves
        :meth:`rope_at`. ``snaps``: by group index (groups of one row), the boundaries to snapshot (:attr:`snaps`)."""
        parts, lo = [], 0
        for slots, start, s, bound in groups:
            b = slots.shape[0]
            parts.append((lo, b, s, slots, start, bound))
            lo += b * s
        if lo != token_ids.numel():
            raise ValueError(f"varlen groups cover {lo} tokens, token_ids has {token_ids.numel()}")
        positions = torch.cat([(start.unsqueeze(1) + torch.arange(s, device=token_ids.device)).flatten()
                               for _, _, s, _, start, _ in parts]).unsqueeze(0)                   # [1, T]
        rope = rope_spec.tables(positions)
        flat = token_ids.view(1, -1)
        subs = []
        snaps = snaps or {}
        for i, (lo, b, s, slots, start, bound) in enumerate(parts):
            if snaps.get(i) and b != 1:
                raise ValueError(f"varlen group {i}: snapshots need a group of one row, it has {b}")
            cut = lambda t: t.flatten(0, 1)[lo:lo + b * s].unflatten(0, (b, s))   # noqa: E731
            subs.append(cls(config, cut(flat), slots, start, cut(positions),
                            {k: RopeTables(cut(r.cos), cut(r.sin)) for k, r in rope.items()}, inv_freq, qat_sim,
                            bound, offset=lo, snaps=tuple(snaps.get(i, ()))))
        return cls(config, flat, torch.cat([g.slots for g in subs]), torch.cat([g.start for g in subs]), positions,
                   rope, inv_freq, qat_sim, max(g.context_bound for g in subs), groups=tuple(subs))

    def per_group(self, fn, *tensors: torch.Tensor, **kwargs) -> torch.Tensor:
        """``fn(group_ctx, *group_tensors, **kwargs)`` for each group of equal-length rows, on the
        group's ``[b, s, ...]`` slices of the token-wise ``tensors``; the results joined back in
        token order. Without groups: ``fn(self, *tensors)``."""
        if self.groups is None:
            return fn(self, *tensors, **kwargs)
        if len(self.groups) == 1:          # one group (a decode step): its result as is, no copy
            g = self.groups[0]
            b, s = g.token_ids.shape
            return fn(g, *(t.flatten(0, 1).unflatten(0, (b, s)) for t in tensors), **kwargs).flatten(0, 1).unsqueeze(0)
        outs = []
        for g in self.groups:
            b, s = g.token_ids.shape
            cut = [t.flatten(0, 1)[g.offset:g.offset + b * s].unflatten(0, (b, s)) for t in tensors]
            outs.append(fn(g, *cut, **kwargs).flatten(0, 1))
        return torch.cat(outs).unsqueeze(0)

    def rope_at(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for other positions (compressed entries sit at their window's first position)."""
        return ops.rope_cos_sin(positions, self.inv_freq[kind])

    def window_rope(self, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, S, rd/2]`` at each token's window start ``pos // ratio * ratio`` (where its
        compressed entry sits), compress theta: made with the forward's other tables (:class:`RopeSpec`)."""
        table = self.rope[f"window:{ratio}"]
        return table.cos, table.sin

    def visible_entries(self, ratio: int) -> torch.Tensor:
        """``[B, S]``: how many compressed entries (ratio ``ratio``) each query sees, ``(pos + 1) // ratio``
        (entry ``w`` is visible from position ``(w + 1) * ratio - 1`` on); once per forward and ratio."""
        cache = self.__dict__.setdefault("_visible", {})
        if ratio not in cache:
            cache[ratio] = (self.positions + 1) // ratio
        return cache[ratio]

    def ring_rows(self, window: int) -> torch.Tensor:
        """``[B, S]``: each token's window ring row ``pos % window``; once per forward and window."""
        cache = self.__dict__.setdefault("_ring_rows", {})
        if window not in cache:
            cache[window] = torch.remainder(self.positions, window)
        return cache[window]

    def snapshot_rows(self, window: int) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """Per :attr:`snaps` entry ``(start, b, stage)``: the stage slot ``[1]``, the ring rows
        ``[1, n]`` of positions ``lo .. b - 1`` (``lo = max(start, b - window)``: the chunk's rows the
        ring holds at ``b``) and ``lo``; once per forward and window."""
        cache = self.__dict__.setdefault("_snapshot_rows", {})
        if window not in cache:
            dev = self.positions.device
            # made on the device (fills, no host -> device copy that could wait for the stream)
            cache[window] = [(torch.full((1,), k, device=dev), torch.arange(lo, b, device=dev).remainder(window)[None], lo)
                             for start, b, k in self.snaps for lo in [max(start, b - window)]]
        return cache[window]

    @property
    def one_token_rows(self) -> bool:
        """Every row of this forward has one token (a decode step; host-known)."""
        if self.groups is None:
            return self.token_ids.shape[1] == 1
        return all(g.token_ids.shape[1] == 1 for g in self.groups)

    def entry_bound(self, ratio: int, max_entries: int) -> int:
        """How many compressed entries (ratio ``ratio``) any query of this forward can see, >= 1."""
        return max(1, min(max_entries, self.context_bound // ratio))

    @property
    def seq_len(self) -> int:
        return self.token_ids.shape[1]
