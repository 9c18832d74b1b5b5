"""Attention-family cases: sparse attention (CSA / HCA layers) and the indexer's scores.

Decode at Flash and Pro geometry (64 / 128 heads, head dim 512 stored as FP8 448 + BF16 rope 64,
window 128, CSA top-k 512 / 1024, HCA ratio 128), batch 1, 8, 32 with 8k and 64k contexts (the
slots sit at different positions, ``ctx - 1 - 37 b``), and one 4096-token prefill chunk. Peers:
the reference op (``dsv4.ops.reference``) on the same data, and for the Flash CSA decode rows,
``torch.nn.functional.scaled_dot_product_attention`` over keys gathered densely beforehand (its
time excludes the gather and it has no sink: a lower bound for a dense library kernel).

Bytes are the fewest the op must move: the query rows and the output once, each visible key row
once per query that needs a distinct row (decode: per slot; prefill: the chunk's rows and the
slot's entries once), the CSA indices. Flops: ``4 H hd`` per (query, key) for the two products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.kernel_cases import Case
from dsv4.model.cache import RowStore
from dsv4.ops import reference as ref

W, HD, ROPE = 128, 512, 64
MODELS = {"flash": dict(H=64, topk=512), "pro": dict(H=128, topk=1024)}
CSA_RATIO, HCA_RATIO = 4, 128
INDEX_HEADS, INDEX_DIM = 64, 128


def _store(layout: str, n_slots: int, rows: int, dim: int, device: str, rope: int = 0) -> RowStore:
    """A store of random rows (values like a normed K=V head: unit RMS), written through the encoder."""
    st = RowStore.allocate(layout, n_slots, rows, dim, torch.bfloat16, device, rope_dim=rope)
    for s in range(n_slots):
        st.write(torch.tensor([s], device=device).view(1, 1), torch.arange(rows, device=device).view(1, -1),
                 torch.randn(1, rows, dim, device=device, dtype=torch.bfloat16))
    return st


def row_bytes(st: RowStore) -> int:
    return st.nbytes_per_row()


class _Context:
    """Stores for one context length, shared by every batch size and model (slots 0 .. B-1)."""

    def __init__(self, ctx: int, max_b: int, device: str, layout: str = "fp8"):
        self.ctx = ctx
        self.ring = _store(layout, max_b, W, HD, device, ROPE)
        self.csa = _store(layout, max_b, ctx // CSA_RATIO + 1, HD, device, ROPE)
        self.hca = _store(layout, max_b, ctx // HCA_RATIO + 1, HD, device, ROPE)
        self.keys = _store("fp4", max_b, ctx // CSA_RATIO + 1, INDEX_DIM, device)


def _positions(ctx: int, B: int, S: int, device: str) -> torch.Tensor:
    return torch.tensor([max(0, ctx - S - 37 * b) for b in range(B)], device=device)


def attention_args(c: _Context, kind: str, H: int, topk: int, B: int, S: int, device: str):
    """``(args, comp, n_keys)`` of one sparse_attention call: q, kv_new, ring, slots, start, window,
    sink, scale and the compressed-entry arguments; ``n_keys`` visible keys per query (mean)."""
    g = torch.Generator(device=device).manual_seed(B * 1000 + S)
    start = _positions(c.ctx, B, S, device)
    slots = torch.arange(B, device=device)
    q = torch.randn(B, S, H, HD, device=device, dtype=torch.bfloat16, generator=g)
    kv_new = torch.randn(B, S, HD, device=device, dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device=device, generator=g)
    t = start.view(-1, 1) + torch.arange(S, device=device)                       # [B, S]
    if kind == "csa":
        n_ent = c.csa.rows - 1
        visible = (t + 1) // CSA_RATIO
        k = min(topk, n_ent)
        scores = torch.rand(B, S, n_ent, device=device, generator=g)
        scores = scores.masked_fill(torch.arange(n_ent, device=device) >= visible.unsqueeze(-1), -1.0)
        idx = scores.topk(k, dim=-1).indices
        idx = torch.where(idx < visible.unsqueeze(-1), idx, -1)
        comp = dict(comp=c.csa, comp_idx=idx)
        comp_keys = (idx >= 0).sum(-1).float().mean().item()
    else:
        n_ent = c.hca.rows - 1
        visible = ((t + 1) // HCA_RATIO).clamp(max=n_ent)
        comp = dict(comp=c.hca, comp_len=visible, comp_bound=n_ent)
        comp_keys = visible.float().mean().item()
    args = (q, kv_new, c.ring, slots, start, W, sink, HD ** -0.5)
    return args, comp, min(W, c.ctx) + comp_keys


def _attention_bytes(c: _Context, kind: str, H: int, B: int, S: int, comp_keys: float, comp: dict) -> float:
    act = 2 * B * S * H * HD * 2                                             # q in, out
    rb = row_bytes(c.ring)
    ring_rows = B * min(W, c.ctx) * rb if S < W else B * W * rb
    new_rows = B * S * HD * 2
    if kind == "csa":
        ent = comp["comp_idx"]
        distinct = torch.unique(ent[ent >= 0]).numel() if S > 1 else (ent >= 0).sum().item()
        comp_b = distinct * row_bytes(c.csa) + ent.numel() * 8
    else:
        comp_b = B * comp_keys * row_bytes(c.hca) if S == 1 else B * comp["comp_bound"] * row_bytes(c.hca)
    return act + ring_rows + new_rows + comp_b


def _sdpa_peer(args: tuple, comp: dict):
    """SDPA over densely gathered keys (gathered once, outside the timing), MQA via enable_gqa."""
    q, kv_new, ring, slots, start, window, sink, scale = args
    B, S, H, hd = q.shape
    ring_rows = ring.read(slots.view(-1, 1), torch.arange(window, device=q.device).view(1, -1))
    ent = comp["comp"].read(slots.view(B, 1), comp["comp_idx"][:, 0].clamp(min=0))
    keys = torch.cat([ring_rows, ent], dim=1).unsqueeze(1).contiguous()        # [B, 1, W + k, hd]
    qq = q.transpose(1, 2).contiguous()                                          # [B, H, 1, hd]
    return lambda: F.scaled_dot_product_attention(qq, keys, keys, scale=scale, enable_gqa=True)


def _attention_cases(env, contexts: dict) -> list[Case]:
    from dsv4.ops.triton.attention import sparse_attention_triton
    out = []
    for model, geo in MODELS.items():
        H, topk = geo["H"], geo["topk"]
        for ctx, c in contexts.items():
            for kind in ("csa", "hca"):
                for B in (1, 8, 32):
                    args, comp, n_keys = attention_args(c, kind, H, topk, B, 1, env.device)
                    name = f"{model} {kind} decode ctx={ctx // 1024}k b={B}"
                    fn = (lambda a=args, k=comp: sparse_attention_triton(*a, **k))
                    nbytes = _attention_bytes(c, kind, H, B, 1, n_keys - min(W, ctx), comp)
                    flops = 4 * H * HD * n_keys * B
                    out.append(Case("attention", name, fn, nbytes, flops, peer="reference",
                                    peer_fn=(lambda a=args, k=comp: ref.sparse_attention(*a, **k)),
                                    notes=f"{n_keys:.0f} keys/query"))
                    if model == "flash" and kind == "csa" and ctx == min(contexts):
                        out.append(Case("attention", name + " [vs sdpa]", fn, nbytes, flops,
                                        peer="sdpa dense (pre-gathered, no sink)",
                                        peer_fn=_sdpa_peer(args, comp)))
    return out


def _prefill_cases(env, c: _Context, S: int) -> list[Case]:
    from dsv4.ops.triton.attention import sparse_attention_triton
    out = []
    H, topk = MODELS["flash"]["H"], MODELS["flash"]["topk"]
    for kind in ("csa", "hca"):
        args, comp, n_keys = attention_args(c, kind, H, topk, 1, S, env.device)
        nbytes = _attention_bytes(c, kind, H, 1, S, n_keys - W, comp)
        out.append(Case("attention", f"flash {kind} prefill S={S} (after {c.ctx - S})",
                        lambda a=args, k=comp: sparse_attention_triton(*a, **k), nbytes,
                        4 * H * HD * n_keys * S, peer="reference",
                        peer_fn=lambda a=args, k=comp: ref.sparse_attention(*a, **k),
                        notes=f"{n_keys:.0f} keys/query"))
    return out


def _indexer_cases(env, contexts: dict, prefill: _Context, S: int) -> list[Case]:
    from dsv4.ops.triton.indexer import indexer_scores_triton, topk_indices_triton
    out = []
    dev = env.device

    def one(c: _Context, B: int, S: int, label: str) -> None:
        g = torch.Generator(device=dev).manual_seed(7 + B)
        q = ref.fp4_sim(torch.randn(B, S, INDEX_HEADS, INDEX_DIM, device=dev, generator=g)).bfloat16()
        w = torch.randn(B, S, INDEX_HEADS, device=dev, generator=g) * (INDEX_DIM * INDEX_HEADS) ** -0.5
        slots = torch.arange(B, device=dev)
        bound = c.keys.rows - 1
        nbytes = B * bound * row_bytes(c.keys) + q.numel() * 2 + w.numel() * 4 + B * S * bound * 4
        flops = 2 * B * S * bound * INDEX_HEADS * INDEX_DIM
        args = (q, c.keys, slots, w, bound)
        out.append(Case("attention", f"indexer scores fp4 {label}", lambda: indexer_scores_triton(*args),
                        nbytes, flops, peer="reference", peer_fn=lambda: ref.indexer_scores(*args)))
        scores = ref.indexer_scores(*args)
        for model in ("flash", "pro") if S == 1 else ("flash",):
            k = min(MODELS[model]["topk"], bound)
            out.append(Case("attention", f"indexer topk {k} {label}", lambda k=k: topk_indices_triton(scores, k),
                            scores.numel() * 4 + B * S * k * 8, peer="reference",
                            peer_fn=lambda k=k: ref.topk_indices(scores, k)))

    for ctx, c in contexts.items():
        for B in (1, 8, 32):
            one(c, B, 1, f"decode ctx={ctx // 1024}k b={B}")
    one(prefill, 1, S, f"prefill S={S} (ctx {prefill.ctx})")
    return out


def cases(env) -> list[Case]:
    dev = env.device
    contexts = {ctx: _Context(ctx, 32, dev) for ctx in (8192, 65536)}
    prefill = _Context(8192, 1, dev)           # a 4096-token chunk after 4096 tokens of context
    return (_attention_cases(env, contexts) + _prefill_cases(env, prefill, 4096)
            + _indexer_cases(env, contexts, prefill, 4096))
