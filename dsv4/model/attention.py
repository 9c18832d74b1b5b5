"""DeepSeek-V4 attention: shared K=V head, sliding window, compressed entries, sinks.

DSV4_FACTS section 2, "Attention". ``qr = q_norm(wq_a x)``; ``q = wq_b qr`` per head RMS-normed
without weight; ``kv = kv_norm(wkv x)`` is one head used as key and value; RoPE on the last ``rd``
dims (interleaved pairs; YaRN-scaled ``compress_rope_theta`` on CSA/HCA layers). A query at ``t``
sees the window ``t-W+1 .. t`` plus the compressed entries: all visible ones (HCA) or the indexer's
top-k (CSA). Softmax in fp32 with a per-head sink; the output gets the inverse RoPE (values carried
rope because K=V), then the grouped output projection ``wo_a`` (per group) and ``wo_b``.

The paper's hybrid attention: sliding-window attention on every layer, plus Compressed Sparse
Attention (CSA: ratio 4, indexer top-k) or Heavily Compressed Attention (HCA: ratio 128, dense over
the entries). The QAT simulation's FP8 rounding of the K=V rows is the cache's (DSV4_FACTS 2b, 3).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..ops import fused
from ..config import ModelConfig
from ..parallel import SINGLE, ParallelGroup
from .cache import LayerCache
from .common import ForwardContext, GroupedLinear, Linear, RMSNorm, fp32_param
from .compressor import Compressor, step_tokens, store_entries, window_plan
from .indexer import Indexer


class Attention(nn.Module):
    """Official parameter names: ``wq_a q_norm wq_b wkv kv_norm wo_a wo_b attn_sink compressor indexer``.

    Tensor parallel (``tp``): a rank holds ``H/N`` query heads (``wq_b`` rows, ``attn_sink``) and the
    ``G/N`` output groups made of exactly those heads (``wo_a`` rows, ``wo_b`` columns); ``wo_b``'s
    partial outputs are summed over the ranks. ``wq_a``, the K=V head ``wkv``, the compressor and the
    indexer are replicated (every rank keeps the same cache).
    """

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, tp: ParallelGroup = SINGLE,
                 prefix: str | None = None):
        super().__init__()
        c = config
        prefix = prefix or f"layers.{layer}.attn"
        self.tp = tp
        self.kind, self.ratio = c.layer_kind(layer), c.layer_ratio(layer)
        self.head_dim, self.rope_dim = c.head_dim, c.rope_dim
        self.window, self.eps = c.sliding_window, c.rms_norm_eps
        # heads follow their groups: N must divide the groups (it then divides the heads too)
        self.groups = tp.split(c.o_groups, "output groups (o_groups)", f"{prefix}.wo_a.weight")
        self.n_heads = tp.split(c.num_attention_heads, "heads (num_attention_heads)", f"{prefix}.wq_b.weight")
        self.rope_kind = "main" if self.kind == "sliding" else "compress"
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, dtype)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * c.head_dim, dtype)
        self.wkv = Linear(c.hidden_size, c.head_dim, dtype)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.wo_a = GroupedLinear(c.num_attention_heads * c.head_dim // c.o_groups, self.groups * c.o_lora_rank,
                                  self.groups, dtype)
        self.wo_b = Linear(self.groups * c.o_lora_rank, c.hidden_size, dtype)
        self.attn_sink = fp32_param(self.n_heads)
        if self.kind != "sliding":
            self.compressor = Compressor(c.hidden_size, c.head_dim, self.ratio, self.kind == "csa",
                                         c.rms_norm_eps, dtype)
        if self.kind == "csa":
            self.indexer = Indexer(c, self.ratio, dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> torch.Tensor:
        """``x [B, S, D]`` (attention-normed block input) -> ``[B, S, D]``; updates ``cache``."""
        rope = ctx.rope[self.rope_kind]
        cos_h, sin_h = rope.cos.unsqueeze(2), rope.sin.unsqueeze(2)    # broadcast over heads

        # wq_a and wkv read the same x: one GEMV for both (they round x alike: both take part in QAT);
        # then one launch makes both rows ready:
        #   qr = q_norm(x wq_a)                                        the queries' low-rank rows
        #   kv = kv_norm(x wkv), RoPE on its last rd dims, rounded as the ring stores it (QAT: FP8)
        # A decode step (one token a row) also stores kv in the ring there: its ring row pos % W
        # holds position pos - W, which no query of the step sees. Longer rows store after
        # attention (their earlier queries still read the rows they overwrite).
        qa, kv = fused.linear_pair(x, self.wq_a.w, self.wkv.w, self.wq_a.act_quant, self.wq_a.pow2)
        at = (ctx.slots.view(ctx.positions.shape), ctx.ring_rows(self.window)) if ctx.one_token_rows else ()
        qr, kv = fused.q_kv_prepare(qa, self.q_norm.weight, self.q_norm.eps, kv, self.kv_norm.weight,
                                    self.kv_norm.eps, rope.cos, rope.sin, cache.ring, *at)  # kv [B, S, hd] as stored
        # queries: low-rank (wq_a, q_norm, wq_b), then per head an RMS norm without weight and RoPE.
        # CSA: the indexer's queries project the same qr (its own wq_b): one GEMV for both, then
        # one launch prepares both (the indexer's: RoPE, Hadamard, QAT: FP4; see Indexer.forward)
        if self.kind == "csa":
            q, iq = fused.linear_pair(qr, self.wq_b.w, self.indexer.wq_b.w, self.wq_b.act_quant, self.wq_b.pow2)
            q, iq = fused.queries_prepare(q.unflatten(-1, (self.n_heads, self.head_dim)), cos_h, sin_h, self.eps,
                                          iq.unflatten(-1, (self.indexer.n_heads, self.indexer.dim)), ctx.qat_sim)
        else:
            q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
            q, iq = fused.rope_qnorm(q, cos_h, sin_h, self.eps), qr                 # iq: unused

        o = ctx.per_group(self._attend, q, kv, x, iq, cache=cache, stored=bool(at))  # [B, S, H, hd]
        # grouped output projection: heads in G groups, group g times its own r rows of wo_a
        #   o [B, S, H*hd] -> [B, S, G, H*hd/G] --wo_a (per group)--> [B, S, G, r] --wo_b--> [B, S, D]
        o = self.wo_a(o.flatten(2).unflatten(-1, (self.groups, -1)))
        return self.tp.all_reduce_sum(self.wo_b(o.flatten(2)))     # tensor parallel: sum of the ranks' heads

    def _attend(self, ctx: ForwardContext, q: torch.Tensor, kv: torch.Tensor, x: torch.Tensor, iq: torch.Tensor,
                cache: LayerCache, stored: bool) -> torch.Tensor:
        """The part of attention that reads and writes a row's own state, for rows of one length:
        compressor and indexer (``iq``: its prepared queries), sparse attention over window +
        compressed entries, then the window store (unless ``stored``: the decode step's
        ``q_kv_prepare`` wrote the rows already). ``q [b, s, H, hd]`` -> ``[b, s, H, hd]``."""
        # What a query at t attends to, one softmax with the head's sink logit in the denominator:
        #
        #   sliding:  [ window t-W+1 .. t ]
        #   HCA:      [ window ] + [ every entry w with (w + 1) * m <= t + 1 ]        (m = 128)
        #   CSA:      [ window ] + [ the indexer's top-k of those entries ]           (m = 4)
        comp = dict(comp=None)
        if self.kind != "sliding":
            comp = self._compressed(x, iq, ctx, cache)
        # K=V output un-rotation (done by the attention as it writes its output). The values are
        # the keys, so they carry RoPE at their *key* positions s; the softmax-weighted sum mixes
        # them. Rotating the output back by the *query* position t leaves each value's rope dims
        # rotated by the relative angle s - t:
        #
        #   key/value row s:   [ nope dims | R(s) . rope dims ]
        #   o_t = sum_s p_ts v_s  ->  R(-t) o_t = sum_s p_ts [ nope | R(s - t) . rope ]
        #
        # (the nope dims pass through untouched; DSV4_FACTS 2, "Output").
        rope = ctx.rope[self.rope_kind]
        o = ops.sparse_attention(q, kv, cache.ring, ctx.slots, ctx.start, self.window, self.attn_sink,
                                 self.head_dim ** -0.5, **comp, cos=rope.cos, sin=rope.sin)
        if not stored:
            self._store_window(kv, ctx, cache)
        return o

    def _store_window(self, kv: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> None:
        """Store the newest ``min(S, W)`` K=V rows in the ring at row ``pos % W`` (after attention:
        the chunk's older queries still need the rows these overwrite)."""
        # The ring: W rows per slot, position p lives in row p % W, so the ring always holds the
        # last W positions and a query at t sees rows for t-W+1 .. t (its own row included).
        # W = 8, after position 10 was stored (the chunk's own rows come from `kv`, not the ring):
        #
        #   row:       0   1   2   3   4   5   6   7
        #   position:  8   9  10   3   4   5   6   7      <- rows 0..2 overwritten by 8, 9, 10
        #                        ^ newest  ^ oldest kept (t - W + 1 = 3)
        #
        # A chunk of S > W tokens writes only its last W rows: the earlier ones would be overwritten
        # within the same store (and the chunk's queries read them from `kv` directly).
        S = kv.shape[1]
        if cache.stage is not None and ctx.snaps:
            self._snapshot_window(kv, ctx, cache)
        keep = min(S, self.window)
        rows = ctx.ring_rows(self.window)[:, S - keep:]                              # [B, keep]
        fused.store_rows(cache.ring, ctx.slots.unsqueeze(1), rows, kv[:, S - keep:])

    def _snapshot_window(self, kv: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> None:
        """Prefix caching: for each block boundary ``b`` inside this one-row chunk (``ctx.snaps``),
        leave the ring as it is at ``b`` in the stage's slot: the chunk's rows of the last ``W``
        positions before ``b``, stored exactly as the slot's own store would (the same rounding),
        over the slot's ring before this chunk's store when the chunk starts less than ``W`` before
        ``b`` (its older rows are from before the chunk)."""
        for (start, b, _), (stage_slot, rows, lo) in zip(ctx.snaps, ctx.snapshot_rows(self.window)):
            if lo > b - self.window:         # rows from before the chunk (else the chunk fills the ring)
                for dst, src in zip(cache.stage.ring.tensors(), cache.ring.tensors()):  # bytes: FP8 has no index_copy
                    dst.view(torch.uint8).index_copy_(0, stage_slot, src.view(torch.uint8).index_select(0, ctx.slots))
            fused.store_rows(cache.stage.ring, stage_slot.view(1, 1), rows, kv[:, lo - start:b - start])

    def _compressed(self, x: torch.Tensor, iq: torch.Tensor, ctx: ForwardContext, cache: LayerCache) -> dict:
        """Run the compressor (and indexer) on the new tokens; return the compressed-entry arguments
        of :func:`dsv4.ops.sparse_attention`: the store and the indexer's picks (CSA) or each
        query's visible length (HCA)."""
        # compressed entries first (a query sees entries of windows that closed at or before it)
        comp = cache.compressor
        bound = ctx.entry_bound(self.ratio, comp.max_entries)
        if ctx.seq_len <= step_tokens(x.device) and not ctx.snaps:
            # decode, a verify step, a short chunk: the compressor's fused step over the rows' few
            # tokens (CSA: the KV compressor's and the indexer's, same tokens, positions and ratio, in
            # one launch), which also counts each query's visible entries; then (CSA) the indexer's
            # queries against its keys. (A chunk with prefix-cache snapshots takes the batched path,
            # which leaves the state at the boundaries inside it.)
            if self.kind == "csa":
                visible = self.compressor.decode_step_with(self.indexer.compressor, x, ctx, comp, cache.indexer)
                return dict(comp=comp.entries, comp_idx=self.indexer(x, iq, ctx, cache.indexer, visible=visible),
                            comp_bound=bound)
            return dict(comp=comp.entries, comp_len=self.compressor.decode_step(x, ctx, comp), comp_bound=bound)
        # a chunk: RoPE at each window's first position, then store
        entries, pos = self.compressor(x, ctx, comp)
        cos, sin = window_plan(ctx, self.ratio).entry_rope(ctx)      # shared by the ratio's compressors
        store_entries(comp, ctx, ops.apply_rope(entries, cos, sin), pos)
        if self.kind == "csa":
            return dict(comp=comp.entries, comp_idx=self.indexer(x, iq, ctx, cache.indexer), comp_bound=bound)
        # HCA attends to every visible entry: entry w is visible from position (w + 1) * m - 1 on
        return dict(comp=comp.entries, comp_len=ctx.visible_entries(self.ratio), comp_bound=bound)
