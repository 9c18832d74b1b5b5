"""The model edits that switch decode to the fused small ops (``dsv4.ops.fused``), applied as
monkeypatches for measurements (``bench/count_launches.py --fused``) until the model has them.

Each function below is the model method as it reads after the proposed edit; the same edits
as a patch: ``bench/fused_model_edits.patch`` (``git apply`` it to switch the model itself).
:func:`apply` installs the ones the model lacks.
"""

from __future__ import annotations

import inspect

import torch

from dsv4 import ops
from dsv4.model import attention, common, compressor, indexer
from dsv4.ops import fused


def window_rope(self: common.ForwardContext, ratio: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[B, S, rd/2]`` at each token's window start ``pos // ratio * ratio`` (where a
    compressed entry sits), computed once per forward and ratio."""
    cache = self.__dict__.setdefault("_window_rope", {})
    if ratio not in cache:
        cache[ratio] = self.rope_at("compress", self.positions // ratio * ratio)
    return cache[ratio]


def attention_forward(self: attention.Attention, x, ctx, cache):
    rope = ctx.rope[self.rope_kind]
    cos_h, sin_h = rope.cos.unsqueeze(2), rope.sin.unsqueeze(2)    # broadcast over heads
    q8, p2 = ctx.qat_sim, ctx.pow2

    qr = self.q_norm(ops.linear(x, self.wq_a.w, q8, p2))
    q = ops.linear(qr, self.wq_b.w, q8, p2).unflatten(-1, (self.n_heads, self.head_dim))
    q = fused.rope_qnorm(q, cos_h, sin_h, self.eps)                                    # [B, S, H, hd]
    kv = fused.kv_prepare(ops.linear(x, self.wkv.w, q8, p2), self.kv_norm.weight, self.kv_norm.eps,
                          rope.cos, rope.sin, cache.ring)                               # [B, S, hd] as stored

    comp = dict(comp=None)
    if self.kind != "sliding":
        comp = self._compressed(x, qr, ctx, cache)
    o = ops.sparse_attention(q, kv, cache.ring, ctx.slots, ctx.start, self.window, self.attn_sink,
                             self.head_dim ** -0.5, **comp)                              # [B, S, H, hd]
    self._store_window(kv, ctx, cache)
    o = ops.apply_rope(o, cos_h, sin_h, inverse=True)
    o = ops.grouped_linear(o.flatten(2).unflatten(-1, (self.groups, -1)), self.wo_a.w, self.groups)
    return ops.linear(o.flatten(2), self.wo_b.w, q8, p2)


def store_window(self: attention.Attention, kv, ctx, cache) -> None:
    W, S = self.window, kv.shape[1]
    keep = min(S, W)
    rows = torch.remainder(ctx.positions[:, S - keep:], W)                      # [B, keep]
    fused.store_rows(cache.ring, ctx.slots.unsqueeze(1), rows, kv[:, S - keep:])


def compressor_forward(self: compressor.Compressor, x, ctx, state, finish) -> None:
    m, slots = self.ratio, ctx.slots
    B, S, _ = x.shape
    f32 = torch.float32
    kv = ops.linear(x, self.wkv.w, ctx.qat_sim, ctx.pow2, out_dtype=f32)                # [B, S, width]
    gate = ops.linear(x, self.wgate.w, ctx.qat_sim, ctx.pow2, out_dtype=f32)
    if S == 1:       # decode: the whole update (window row, closing entry, store) in one op
        cos, sin = ctx.window_rope(m)
        fused.compressor_step(kv, gate, self.ape, state, slots, ctx.positions, self.norm.weight, self.norm.eps,
                              cos, sin, self.rotate)
        return
    gate = gate + self.ape[ctx.positions % m]

    n_win = (m - 1 + S) // m + 1
    offset = ctx.start % m
    w0 = ctx.start // m
    rows = (offset.unsqueeze(1) + torch.arange(S, device=x.device)).unsqueeze(-1).expand(-1, -1, kv.shape[-1])
    buf_kv = self._aligned(state.win_kv[slots], n_win * m).scatter(1, rows, kv)
    buf_gate = self._aligned(state.win_gate[slots], n_win * m).scatter(1, rows, gate)
    win_kv = buf_kv.unflatten(1, (n_win, m))
    win_gate = buf_gate.unflatten(1, (n_win, m))

    prev_kv = prev_gate = None
    if self.overlap:
        d = self.dim
        prev_kv = torch.cat([state.prev_kv[slots].unsqueeze(1), win_kv[:, :-1, :, :d]], dim=1)
        prev_gate = torch.cat([state.prev_gate[slots].unsqueeze(1), win_gate[:, :-1, :, :d]], dim=1)
    entry = ops.compress_windows(win_kv, win_gate, prev_kv, prev_gate)
    entry = self.norm(entry)
    index = w0.unsqueeze(1) + torch.arange(n_win, device=x.device)
    entry = finish(entry, index * m)

    n_closed = (offset + S) // m
    closed = torch.arange(n_win, device=x.device).unsqueeze(0) < n_closed.unsqueeze(1)
    target = torch.where(closed, index, torch.full_like(index, state.max_entries))
    fused.store_rows(state.entries, slots.unsqueeze(1), target, entry)

    pick = n_closed.view(B, 1, 1, 1).expand(-1, 1, m, win_kv.shape[-1])
    state.win_kv[slots] = win_kv.gather(1, pick).squeeze(1)
    state.win_gate[slots] = win_gate.gather(1, pick).squeeze(1)
    if self.overlap:
        last = (n_closed - 1).clamp(min=0).view(B, 1, 1, 1).expand(-1, 1, m, self.dim)
        any_closed = (n_closed > 0).view(B, 1, 1)
        state.prev_kv[slots] = torch.where(any_closed, win_kv[..., :self.dim].gather(1, last).squeeze(1),
                                           state.prev_kv[slots])
        state.prev_gate[slots] = torch.where(any_closed, win_gate[..., :self.dim].gather(1, last).squeeze(1),
                                             state.prev_gate[slots])


def indexer_forward(self: indexer.Indexer, x, qr, ctx, state):
    rope = ctx.rope["compress"]

    def finish(entry, pos):
        cos, sin = ctx.rope_at("compress", pos)
        return ops.hadamard(ops.apply_rope(entry, cos, sin))

    self.compressor(x, ctx, state, finish)

    q = ops.linear(qr, self.wq_b.w, ctx.qat_sim, ctx.pow2).unflatten(-1, (self.n_heads, self.dim))
    q = fused.rope_hadamard(q, rope.cos.unsqueeze(2), rope.sin.unsqueeze(2), ctx.qat_sim)   # [B, S, nI, d]
    w = ops.linear(x, self.weights_proj.w, ctx.qat_sim, ctx.pow2, out_dtype=torch.float32)
    w = w * (self.dim ** -0.5 * self.n_heads ** -0.5)
    bound = ctx.entry_bound(self.ratio, state.max_entries)
    scores = ops.indexer_scores(q, state.entries, ctx.slots, w, bound)
    visible = ((ctx.positions + 1) // self.ratio).unsqueeze(-1)
    entry_ids = torch.arange(bound, device=x.device)
    scores = scores.masked_fill(entry_ids >= visible, float("-inf"))
    picks = ops.topk_indices(scores, min(self.topk, bound))
    return torch.where(picks < visible, picks, torch.full_like(picks, -1))


def _has(fn, name: str) -> bool:
    """Whether the model's ``fn`` already calls the fused op ``name`` (the edit is applied)."""
    return name in inspect.getsource(fn)


def apply(set_attr=setattr) -> None:
    """Install the edits the model lacks (``set_attr``: e.g. pytest's ``monkeypatch.setattr``)."""
    if not hasattr(common.ForwardContext, "window_rope"):
        set_attr(common.ForwardContext, "window_rope", window_rope)
    if not _has(compressor.Compressor.forward, "compressor_step"):
        set_attr(compressor.Compressor, "rotate", False)   # the edit: a constructor argument, True in the indexer
        set_attr(compressor.Compressor, "forward", compressor_forward)
    if not _has(attention.Attention.forward, "rope_qnorm"):
        set_attr(attention.Attention, "forward", attention_forward)
    if not _has(attention.Attention._store_window, "store_rows"):
        set_attr(attention.Attention, "_store_window", store_window)
    if not _has(indexer.Indexer.forward, "rope_hadamard"):
        set_attr(indexer.Indexer, "forward", indexer_forward)


def mark_indexer_compressors(model: torch.nn.Module) -> None:
    """Set ``rotate`` on the indexers' compressors of a built model (the edit makes it a
    constructor argument of ``Compressor``, ``True`` where the indexer builds its compressor)."""
    for mod in model.modules():
        if isinstance(mod, indexer.Indexer):
            mod.compressor.rotate = True
