"""The DeepSeek-V4 network: embedding into ``nc`` streams, blocks, ``hc_head``, norm, fp32 head.

DSV4_FACTS section 2 ("Embedding and streams", "Block", "Head"). Written once; every hot operation goes through :mod:`dsv4.ops`. A forward
runs ``B`` slots x ``S`` new tokens against the generation state (a list of per-layer
:class:`~dsv4.model.cache.LayerCache`; prefill chunks and batched decode are the same call with
different ``S``).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup
from ..weights.names import official_state_dict
from .block import Block
from .cache import LayerCache
from .common import ForwardContext, Linear, RMSNorm, RopeSpec, VocabEmbedding, set_qat_sim
from .mhc import HyperHead
from .mtp import MTPBlock


class Transformer(nn.Module):
    """Official names: ``embed``, ``layers.{i}``, ``hc_head_*``, ``norm``, ``head`` (+ ``mtp.{i}``).

    ``parallel`` (default: world size 1) builds this rank's shard of the network with local sizes:
    vocab-parallel ``embed`` and ``head``, attention heads/groups and experts split (see
    :mod:`dsv4.parallel`). A size that does not divide raises :class:`~dsv4.parallel.ShardError`
    naming the tensor.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, with_mtp: bool = True,
                 parallel: ParallelGroup | None = None):
        super().__init__()
        c = self.config = config
        tp = self.tp = parallel or SINGLE
        self.dtype = dtype
        self.hc_head = HyperHead(c)     # first: the checkpoint's order (hc_head_* before embed), see Block
        self.embed = VocabEmbedding(c.vocab_size, c.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(Block(c, i, dtype, tp) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, tp.split(c.vocab_size, "vocab entries (vocab_size)", "head.weight"), dtype,
                           qat_act=False)
        if with_mtp and c.num_nextn_predict_layers:
            self.mtp = nn.ModuleList(MTPBlock(c, dtype, tp, f"mtp.{i}") for i in range(c.num_nextn_predict_layers))
        self.init_rope(self.embed.weight.device)
        self._qat_mode = (False, True)     # (QAT simulation on, power-of-two scales): the Linear default

    def set_qat_sim(self, on: bool) -> "Transformer":
        """Set the multiplication mode of every linear: the QAT simulation's FP8 rounding of the
        inputs of FP8/FP4 weights (W8A8 / W4A8, DSV4_FACTS 2b), scales as the config's
        ``kv_scale_pow2``. Walks the modules only when the mode changes (a runner sets it once; a
        forward with the other ``qat_sim`` switches it). Returns ``self``."""
        mode = (bool(on), self.config.kv_scale_pow2)
        if mode != self._qat_mode:
            set_qat_sim(self, *mode)
            self._qat_mode = mode
        return self

    #: the buffers :meth:`init_rope` computes (a random or loaded build skips them)
    ROPE_BUFFERS = ("inv_freq_main", "inv_freq_compress", "rope_step", "rope_inv_freq")

    def init_rope(self, device: torch.device | str) -> None:
        """(Re)compute the RoPE inverse frequencies on ``device`` (after a meta-device build), and
        the stacked step and frequencies of :meth:`rope_spec`'s tables."""
        c = self.config
        device = torch.device(device)
        ratios = sorted({c.layer_ratio(i) for i in range(c.num_hidden_layers + 1)} - {0})
        self._rope_names = ("main", "compress", *(f"window:{m}" for m in ratios))
        K, half = len(self._rope_names), c.rope_dim // 2
        if device.type == "meta":   # a skeleton: shapes only (computing on meta costs seconds of imports)
            for kind in ("main", "compress"):
                self.register_buffer(f"inv_freq_{kind}", torch.empty(half, device=device), persistent=False)
            self.register_buffer("rope_step", torch.empty(K, 1, 1, dtype=torch.int64, device=device), persistent=False)
            self.register_buffer("rope_inv_freq", torch.empty(K, 1, 1, half, device=device), persistent=False)
            return
        with torch.device("cpu"):
            inv = {"main": ops.rope_inv_freq(c.rope_dim, c.rope_theta),
                   "compress": ops.rope_inv_freq(c.rope_dim, c.compress_rope_theta, c.yarn)}
        for kind, freqs in inv.items():
            self.register_buffer(f"inv_freq_{kind}", freqs.to(device), persistent=False)
        step = torch.tensor([1, 1, *ratios], dtype=torch.int64).view(K, 1, 1)
        stacked = torch.stack([inv["main"], *[inv["compress"]] * (K - 1)]).view(K, 1, 1, half)
        self.register_buffer("rope_step", step.to(device), persistent=False)
        self.register_buffer("rope_inv_freq", stacked.to(device), persistent=False)

    @property
    def rope_spec(self) -> RopeSpec:
        """The RoPE tables every forward makes (:class:`~dsv4.model.common.RopeSpec`): ``main``,
        ``compress`` and a ``window:m`` per compress ratio, over the buffers wherever they moved."""
        return RopeSpec(self._rope_names, self.rope_step, self.rope_inv_freq)

    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` under the checkpoint's official names (:func:`dsv4.weights.names.official_state_dict`:
        ``hc_attn_fn``, and ``ffn.experts.{e}.w1.weight`` as views of the stacked weights)."""
        return official_state_dict(self.state_dict())

    def context(self, token_ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, qat_sim: bool,
                context_bound: int) -> ForwardContext:
        """Positions and RoPE tables for ``token_ids [B, S]`` starting at ``start [B]`` in ``slots [B]``."""
        self.set_qat_sim(qat_sim)       # a no-op unless the mode changed
        S = token_ids.shape[1]
        positions = start.unsqueeze(1) + torch.arange(S, device=token_ids.device)
        # the RoPE tables, made once per forward: sliding layers use rope_theta, CSA/HCA layers the
        # YaRN-scaled compress_rope_theta (DSV4_FACTS 2, "Attention"), their compressors' decode step
        # the latter at each token's window start; every layer of a kind shares its tables
        inv = {"main": self.inv_freq_main, "compress": self.inv_freq_compress}
        rope = self.rope_spec.tables(positions)
        return ForwardContext(self.config, token_ids, slots, start, positions, rope, inv, qat_sim, context_bound)

    def hidden_streams(self, ctx: ForwardContext, caches: list[LayerCache]) -> torch.Tensor:
        """Embed and run every block: final streams ``[B, S, nc, D]`` (MTP input)."""
        # ids -> embed -> nc copies (the mHC streams) -> blocks -> hc_head collapse -> norm -> head
        #   [B, S] -> [B, S, D] -> [B, S, nc, D] -> ... -> [B, S, nc, D]  (logits: see `logits`)
        h = self.embed(ctx.token_ids)
        h = h.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()
        # each block's last mHC post runs in the next block's first pre (one op); the last block's alone
        pending = None
        for layer, cache in zip(self.layers, caches):
            pending = layer.run(h, ctx, cache, pending)
        return h if pending is None else self.layers[-1].hc_ffn.post(*pending)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Streams ``[..., nc, D]`` -> fp32 logits ``[..., vocab]``."""
        # collapse the nc streams (HyperHead) and the final RMSNorm (one op), then the BF16 head in fp32: only for the
        # rows that need logits (the caller slices h first: last token, or the sampled rows)
        y = self.hc_head(h, self.norm)
        return self.project_head(y)

    def project_head(self, y: torch.Tensor) -> torch.Tensor:
        """Normed hidden ``[..., D]`` -> fp32 logits ``[..., vocab]`` (each rank computes its vocab
        slice; one all-gather assembles them)."""
        return self.tp.all_gather(self.head(y, torch.float32), dim=-1)

    def forward(self, token_ids: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                caches: list[LayerCache], qat_sim: bool = False, last_only: bool = False,
                context_bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``token_ids [B, S]`` at positions ``start [B] + arange(S)`` in ``slots [B]``.

        ``caches`` is the per-layer state (``GenerationState.layers``), updated in place (the caller
        advances positions). ``context_bound`` is a host-known bound on the positions + 1 of this
        forward (default: the state's full length). Returns fp32 logits ``[B, S, vocab]``
        (``[B, 1, vocab]`` with ``last_only``) and the final streams.
        """
        if context_bound is None:
            context_bound = max_context_of(caches, self.config)
        ctx = self.context(token_ids, slots, start, qat_sim, context_bound)
        h = self.hidden_streams(ctx, caches)
        return self.logits(h[:, -1:] if last_only else h), h


    def forward_varlen(self, token_ids: torch.Tensor, groups: list[tuple[torch.Tensor, torch.Tensor, int, int]],
                       caches: list[LayerCache], logit_rows: torch.Tensor, qat_sim: bool = False,
                       streams: bool = False, snaps: dict[int, tuple[tuple[int, int, int], ...]] | None = None):
        """One forward over rows of different lengths (DESIGN decision 6): ``token_ids [T]`` back to
        back in ``groups`` of equal-length rows ``(slots [b], start [b], s, context_bound)`` (see
        :meth:`ForwardContext.varlen`). Token-wise layers (linears, MoE, mHC, norms) run once over
        all ``T`` tokens; attention, compressor and indexer once per group. Returns fp32 logits
        ``[R, vocab]`` of the flattened token indices ``logit_rows [R]`` only (with ``streams``,
        also the final streams ``[1, T, nc, D]`` and the context: the MTP block's input).
        ``snaps``: block-boundary snapshots inside prompt rows, by group (:attr:`ForwardContext.snaps`)."""
        self.set_qat_sim(qat_sim)
        inv = {"main": self.inv_freq_main, "compress": self.inv_freq_compress}
        ctx = ForwardContext.varlen(self.config, token_ids, groups, self.rope_spec, inv, qat_sim, snaps)
        h = self.hidden_streams(ctx, caches)                                      # [1, T, nc, D]
        logits = self.logits(h[0].index_select(0, logit_rows))
        return (logits, h, ctx) if streams else logits


def max_context_of(caches: list[LayerCache], config: ModelConfig) -> int:
    """The longest context the state holds (from its entry stores; the window when none)."""
    for cache in caches:
        if cache.compressor is not None:
            return cache.compressor.max_entries * cache.compressor.ratio
    return 1 << 62
