"""Benchmark cases of the fused MoE (``dsv4/ops/triton/moe.py``), family ``moe``.

The routed experts of one layer at Flash (256 experts, D 4096, I 2048) and Pro (384, 7168, 3072)
geometry, MXFP4 and NVFP4, the QAT activation quantization on: decode at 1, 8 and 32 tokens (top-6
each, ids drawn at random: distinct experts ~6, ~45, ~140 of 256) and a 2048-token prefill (Flash).
``bytes``: the distinct selected experts' packed weights and scales, read once, plus ``x`` and the
output. Peer: the reference op (grouped eager PyTorch) on the same inputs; and for Flash MXFP4 a
second row, ``[vs grouped_mm bf16]``: the experts dequantized to BF16 and run the way transformers'
``grouped_mm`` experts run them (pairs sorted by expert, ``torch._grouped_mm`` for ``w1|w3`` and
``w2`` with per-expert offsets, the clamped SwiGLU and the routing weights in PyTorch, the sum back
per token), with its own bytes floor in ``extra['peer_bytes']`` (2 bytes a weight).
"""

from __future__ import annotations

import torch

from bench.kernel_cases import Case

GEOS = {"flash": dict(E=256, D=4096, I=2048), "pro": dict(E=384, D=7168, I=3072)}
TOP_K = 6


def _experts(fmt: str, E: int, N: int, K: int, g: torch.Generator, dev) -> object:
    """A random stacked ``[E, N, K]`` FP4 weight (codes uniform, scales keeping outputs O(1))."""
    from dsv4.weights.formats import Mxfp4Weight, Nvfp4Weight
    packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8).to(dev)
    if fmt == "mxfp4":
        scale = torch.full((E, N, K // 32), 127 - round(torch.log2(torch.tensor(2.93 * K ** 0.5)).item()),
                           dtype=torch.uint8, device=dev)
        return Mxfp4Weight(packed, scale, name=f"experts.{fmt}")
    scale = torch.ones(E, N, K // 16, device=dev).to(torch.float8_e4m3fn)
    return Nvfp4Weight(packed, scale, torch.tensor(1 / (2.93 * K ** 0.5), device=dev), name=f"experts.{fmt}")


def fp8_weight(N: int, K: int, g: torch.Generator, dev) -> object:
    """A random ``[N, K]`` FP8-block weight with e8m0 scales (the shared expert's format as released)."""
    from dsv4.weights.formats import Fp8BlockWeight
    w = (torch.randn(N, K, generator=g) * 0.5).to(torch.float8_e4m3fn).to(dev)
    s = torch.full((-(-N // 128), -(-K // 128)), 127 - 8, dtype=torch.uint8, device=dev)
    return Fp8BlockWeight(w, s, name="shared")


def _grouped_mm_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, limit: float) -> torch.Tensor:
    """BF16 experts through ``torch._grouped_mm`` (``w13 [E, 2I, D]``, ``w2 [E, D, I]``); no host sync."""
    T, k = ids.shape
    E, I2, _ = w13.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    tok = order // k
    counts = torch.histc(flat.int(), bins=E, min=0, max=E - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)          # [P, 2I]
    g, u = h.float().split(I2 // 2, dim=-1)
    a = (torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)).to(x.dtype)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs).float()        # [P, D]
    y = y * weights.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, tok, y).to(x.dtype)


def cases(env) -> list[Case]:
    from dsv4 import ops
    from dsv4.ops import reference

    dev = env.device
    out: list[Case] = []
    for geo, (fmts, sizes) in {"flash": (("mxfp4", "nvfp4"), (1, 8, 32, 2048)), "pro": (("mxfp4",), (1, 8, 32))}.items():
        E, D, I = GEOS[geo]["E"], GEOS[geo]["D"], GEOS[geo]["I"]
        for fmt in fmts:
            g = torch.Generator().manual_seed(1)
            w1, w3, w2 = (_experts(fmt, E, I, D, g, dev), _experts(fmt, E, I, D, g, dev),
                          _experts(fmt, E, D, I, g, dev))
            per_expert = (w1.nbytes + w3.nbytes + w2.nbytes) / E
            dense = None
            if geo == "flash" and fmt == "mxfp4" and hasattr(torch, "_grouped_mm"):   # 12.9 GB of BF16
                dense = (torch.cat([w1.dequantize(torch.bfloat16), w3.dequantize(torch.bfloat16)], dim=1),
                         w2.dequantize(torch.bfloat16))
            for T in sizes:
                x = torch.randn(T, D, generator=g).to(dev, torch.bfloat16)
                ids = torch.rand(T, E, generator=g).argsort(-1)[:, :TOP_K].to(dev)
                weights = torch.rand(T, TOP_K, generator=g).to(dev)
                distinct = ids.unique().numel()
                args = (x, ids, weights, w1, w3, w2, 10.0, True, True)
                flops = 2 * T * TOP_K * 3 * D * I
                out.append(Case("moe", f"{geo} {fmt} experts T={T} ({distinct} distinct)",
                                (lambda a=args: ops.moe(*a)), distinct * per_expert + 2 * x.numel() * 2,
                                flops=flops if T > 256 else 0.0, peer="reference",
                                peer_fn=(lambda a=args: reference.moe(*a)) if T <= 32 else None))
                if dense is not None:
                    bf16 = (x, ids, weights, dense[0], dense[1], 10.0)
                    out.append(Case("moe", f"{geo} {fmt} experts T={T} [vs grouped_mm bf16]",
                                    (lambda a=args: ops.moe(*a)), distinct * per_expert + 2 * x.numel() * 2,
                                    flops=flops if T > 256 else 0.0, peer="grouped_mm bf16 experts",
                                    peer_fn=lambda a=bf16: _grouped_mm_moe(*a),
                                    extra=dict(peer_bytes=distinct * 2 * 3 * D * I + 2 * x.numel() * 2)))
            dense = None
            del w1, w3, w2
    return out
