"""Benchmark cases of the small-op kernels (family ``small``): V4-Flash and V4-Pro decode shapes at
batch 1, 8, 32 and one prefill shape; the peer is the same op's reference (torch eager) on the
same tensors.

Bytes are the minimum each op must move: every input read once, every output written once, in
the dtypes the model uses (bf16 activations and cache rows, fp32 mHC parameters and mixes, fp32
compressor state). At these sizes a kernel is bound by launch and memory latency rather than by
bandwidth (a batch-1 ``rms_norm`` moves 16 KB), so the percent of roofline is low for every
implementation; the comparison that matters is with the peer, which launches dozens of kernels.
"""

from __future__ import annotations

import torch

from bench.kernel_cases import Case

#: (hidden, heads, q_lora_rank) of V4-Flash and V4-Pro
GEOMETRIES = {"flash": (4096, 64, 1024), "pro": (7168, 128, 1536)}
BATCHES = (1, 8, 32)
PREFILL = 4096
NC, HD, RD, INDEX_HEADS, INDEX_DIM = 4, 512, 64, 64, 128
PEER = "torch eager (reference op)"


def cases(env) -> list[Case]:
    from dsv4.ops import reference as ref
    from dsv4.ops.triton import small
    kernels = {op: fn for op, _, fn in small.REGISTRATIONS}
    dev = env.device
    out: list[Case] = []
    for geo, (D, H, ql) in GEOMETRIES.items():
        for T in (*BATCHES, PREFILL):
            tag = f"{geo} b={T}" if T != PREFILL else f"{geo} prefill {T}"
            out += _mhc_cases(kernels, ref, dev, tag, T, D)
            out += _norm_rope_cases(kernels, ref, dev, tag, T, D, H, ql)
            if T != PREFILL:
                out += _cache_cases(kernels, ref, dev, tag, T) if geo == "flash" else []
    return out


def _rand(*shape, dtype=torch.bfloat16, dev="cuda", scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev, dtype=torch.float32) * scale).to(dtype)


def _mhc_cases(k, ref, dev, tag, T, D) -> list[Case]:
    f32 = torch.float32
    h = _rand(T, 1, NC, D, dev=dev)
    fn, base, scale = _rand(24, NC * D, dtype=f32, dev=dev, scale=0.02), _rand(24, dtype=f32, dev=dev), \
        _rand(3, dtype=f32, dev=dev) + 1
    hf, hb, hs = _rand(NC, NC * D, dtype=f32, dev=dev, scale=0.02), _rand(NC, dtype=f32, dev=dev), \
        _rand(1, dtype=f32, dev=dev)
    nw = _rand(D, dtype=f32, dev=dev)
    y, post, comb = ref.mhc_pre_norm(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)
    out = _rand(T, 1, D, dev=dev)
    h_bytes, mix_bytes = T * NC * D * 2, T * (NC + NC * NC) * 4
    return [
        Case("small", f"mhc_pre_norm {tag}", lambda: k["mhc_pre_norm"](h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6),
             bytes=h_bytes + fn.numel() * 4 + D * 4 + T * D * 2 + mix_bytes, peer=PEER,
             peer_fn=lambda: ref.mhc_pre_norm(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)),
        Case("small", f"mhc_post {tag}", lambda: k["mhc_post"](out, h, post, comb),
             bytes=T * D * 2 + 2 * h_bytes + mix_bytes, peer=PEER, peer_fn=lambda: ref.mhc_post(out, h, post, comb)),
        # the post and the next pre in one op: the streams written once and read back once more
        Case("small", f"mhc_post_pre_norm {tag}",
             lambda: k["mhc_post_pre_norm"](out, h, post, comb, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6),
             bytes=T * D * 2 + 3 * h_bytes + fn.numel() * 4 + D * 4 + T * D * 2 + 2 * mix_bytes, peer=PEER,
             peer_fn=lambda: ref.mhc_post_pre_norm(out, h, post, comb, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)),
        Case("small", f"hc_head_norm {tag}", lambda: k["hc_head_norm"](h, hf, hb, hs, 1e-6, 1e-6, nw, 1e-6),
             bytes=h_bytes + hf.numel() * 4 + D * 4 + T * D * 2, peer=PEER,
             peer_fn=lambda: ref.hc_head_norm(h, hf, hb, hs, 1e-6, 1e-6, nw, 1e-6)),
    ]


def _norm_rope_cases(k, ref, dev, tag, T, D, H, ql) -> list[Case]:
    f32 = torch.float32
    x, w = _rand(T, 1, D, dev=dev), _rand(D, dtype=f32, dev=dev)
    xq, wq = _rand(T, 1, ql, dev=dev), _rand(ql, dtype=f32, dev=dev)
    q = _rand(T, 1, H, HD, dev=dev)
    ang = torch.rand(T, 1, RD // 2, device=dev) * 1000
    cos, sin = ang.cos().unsqueeze(2), ang.sin().unsqueeze(2)
    return [
        Case("small", f"rms_norm D={D} {tag}", lambda: k["rms_norm"](x, w, 1e-6), bytes=2 * x.numel() * 2 + D * 4,
             peer=PEER, peer_fn=lambda: ref.rms_norm(x, w, 1e-6)),
        Case("small", f"rms_norm q_lora={ql} {tag}", lambda: k["rms_norm"](xq, wq, 1e-6),
             bytes=2 * xq.numel() * 2 + ql * 4, peer=PEER, peer_fn=lambda: ref.rms_norm(xq, wq, 1e-6)),
        Case("small", f"rope_qnorm H={H} {tag}", lambda: k["rope_qnorm"](q, cos, sin, 1e-6),
             bytes=2 * q.numel() * 2 + 2 * cos.numel() * 4, peer=PEER,
             peer_fn=lambda: ref.rope_qnorm(q, cos, sin, 1e-6)),
    ]


def _cache_cases(k, ref, dev, tag, T) -> list[Case]:
    """The K=V path and the compressor step (same at Flash and Pro: head dim 512, index dim 128)."""
    from dsv4.engine.state import _compressor
    from dsv4.model.cache import RowStore
    f32 = torch.float32
    kv, w = _rand(T, 1, HD, dev=dev), _rand(HD, dtype=f32, dev=dev)
    ang = torch.rand(T, 1, RD // 2, device=dev) * 1000
    cos, sin = ang.cos(), ang.sin()
    ring = RowStore.allocate("fp8", max(T, 2), 128, HD, torch.bfloat16, dev, rope_dim=RD)
    slots = torch.arange(T, device=dev)
    rows = torch.randint(0, 128, (T, 1), device=dev)
    qa, qw = _rand(T, 1, 1024, dev=dev), _rand(1024, dtype=f32, dev=dev)          # Flash q_lora_rank
    kvr = ref.q_kv_prepare(qa, qw, 1e-6, kv, w, 1e-6, cos, sin, ring)[1]
    at = (slots.unsqueeze(1), rows)
    qi = _rand(T, 1, INDEX_HEADS, INDEX_DIM, dev=dev)
    qh = _rand(T, 1, 64, HD, dev=dev)                                     # Flash's 64 attention heads
    ch, sh = cos.unsqueeze(2), sin.unsqueeze(2)
    row_bytes = HD - RD + (HD - RD) // 64 + RD * 2            # 448 fp8 + 7 e8m0 + 64 bf16
    out = [
        Case("small", f"q_kv_prepare fp8 + ring store {tag}",
             lambda: k["q_kv_prepare"](qa, qw, 1e-6, kv, w, 1e-6, cos, sin, ring, *at),
             bytes=2 * (qa.numel() + kv.numel()) * 2 + (1024 + HD) * 4 + 2 * cos.numel() * 4 + T * row_bytes,
             peer=PEER, peer_fn=lambda: ref.q_kv_prepare(qa, qw, 1e-6, kv, w, 1e-6, cos, sin, ring, *at)),
        Case("small", f"store_rows fp8 ring {tag}", lambda: k["store_rows"](ring, slots.unsqueeze(1), rows, kvr),
             bytes=kvr.numel() * 2 + T * row_bytes + 2 * T * 8, peer=PEER,
             peer_fn=lambda: ref.store_rows(ring, slots.unsqueeze(1), rows, kvr)),
        Case("small", f"queries_prepare (attention + indexer, fp4) {tag}",
             lambda: k["queries_prepare"](qh, ch, sh, 1e-6, qi, True),
             bytes=2 * (qi.numel() + qh.numel()) * 2 + 2 * cos.numel() * 4, peer=PEER,
             peer_fn=lambda: ref.queries_prepare(qh, ch, sh, 1e-6, qi, True)),
    ]
    for name, dim, ratio, overlap, layout, rotate in (("csa", HD, 4, True, "fp8", False),
                                                       ("indexer", INDEX_DIM, 4, True, "fp4", True),
                                                       ("hca", HD, 128, False, "fp8", False)):
        entries = RowStore.allocate(layout, max(T, 2), 65, dim, torch.bfloat16, dev,
                                    rope_dim=RD if layout == "fp8" else 0)
        st = _compressor(entries, max(T, 2), ratio, dim, overlap, dev)
        width = 2 * dim if overlap else dim
        ckv, cg = _rand(T, 1, width, dtype=f32, dev=dev), _rand(T, 1, width, dtype=f32, dev=dev)
        ape, nw = _rand(ratio, width, dtype=f32, dev=dev), _rand(dim, dtype=f32, dev=dev)
        for closing in (False, True):
            pos = torch.full((T, 1), ratio - 1 if closing else ratio - 2, device=dev, dtype=torch.long)
            row_io = 2 * T * width * 4 * 2                                     # C, Z rows in; window rows out
            window = (ratio * width + (ratio * dim if overlap else 0)) * 4 * 2 * T if closing else 0
            entry = T * (row_bytes if layout == "fp8" else dim // 2 + dim // 32) if closing else 0

            def run(st=st, ckv=ckv, cg=cg, ape=ape, pos=pos, nw=nw, rotate=rotate):
                k["compressor_step"](ckv, cg, ape, st, slots, pos, nw, 1e-6, cos, sin, rotate)

            def peer(st=st, ckv=ckv, cg=cg, ape=ape, pos=pos, nw=nw, rotate=rotate):
                ref.compressor_step(ckv, cg, ape, st, slots, pos, nw, 1e-6, cos, sin, rotate)
            out.append(Case("small", f"compressor_step {name} {'close' if closing else 'open'} {tag}", run,
                            bytes=row_io + window + entry, peer=PEER, peer_fn=peer))
    return out
