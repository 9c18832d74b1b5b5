"""Benchmark cases of the quantized linears (``dsv4/ops/triton/linear.py``), family ``linear``.

Decode: Flash and Pro shapes at batch 1, 8, 32: the FP8-block (ue8m0) attention projections and
shared expert (``wq_a``, ``wq_b``, ``wkv``, ``wo_a`` grouped, ``wo_b``, ``w1``/``w3``, ``w2``) with
the QAT activation quantization on (``wo_a``: off, as in DeepSeek's code), and ``wq_b`` plus an
expert-shaped ``w1`` in MXFP4 and NVFP4. Prefill: 4096 tokens through ``wo_b`` (FP8) and an
MXFP4 expert-shaped ``w1``.

Decode cases time a CUDA graph of ``n`` calls (launch gaps out of the way), each call on its own
copy of the weight so that no call finds its weight in L2 (50 MB on an H100); ``bytes`` counts all
``n`` calls (weights + scales, activations, outputs, read/written once), so percent of roofline is
per call; the time column is for the ``n`` calls (shown as ``xn`` in the name). Peer: cuBLAS BF16
``F.linear`` on the dequantized weight of the same shape (2 bytes a weight, so its own
bytes floor is ``extra['peer_bytes']``), timed the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from bench.kernel_cases import Case, graph_replay

FLASH = dict(hidden=4096, heads=64, hd=512, q_lora=1024, groups=8, o_lora=1024, inter=2048)
PRO = dict(hidden=7168, heads=128, hd=512, q_lora=1536, groups=16, o_lora=1024, inter=3072)
GEOS = {"flash": FLASH, "pro": PRO}
BATCHES = (1, 8, 32)
#: weight bytes the rotated copies of one case must exceed (several times the H100's 50 MB L2)
ROTATE_BYTES = 192 << 20
MAX_CALLS = 32


def _shapes(g: dict) -> dict[str, tuple[int, int]]:
    return dict(wq_a=(g["q_lora"], g["hidden"]), wq_b=(g["heads"] * g["hd"], g["q_lora"]),
                wkv=(g["hd"], g["hidden"]), wo_a=(g["groups"] * g["o_lora"], g["heads"] * g["hd"] // g["groups"]),
                wo_b=(g["hidden"], g["groups"] * g["o_lora"]), w13=(g["inter"], g["hidden"]),
                w2=(g["hidden"], g["inter"]))


def _quantize(fmt: str, w: torch.Tensor) -> object:
    from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight
    if fmt == "fp8":
        return Fp8BlockWeight.quantize(w, ue8m0=True)
    return (Mxfp4Weight if fmt == "mxfp4" else Nvfp4Weight).quantize(w)


def _nbytes(w: object) -> int:
    return w.nbytes if hasattr(w, "nbytes") and not isinstance(w, torch.Tensor) else w.numel() * w.element_size()


def rotated_copies(fmt: str, n: int, k: int, device) -> tuple[list[object], int]:
    """A random ``[n, k]`` weight in ``fmt`` and enough clones of it that a graph of one call per
    copy never finds its weight in L2 (``ROTATE_BYTES``, at most ``MAX_CALLS``); and its bytes."""
    torch.manual_seed(0)
    base = _quantize(fmt, torch.randn(n, k, device=device) * 0.02)
    wbytes = _nbytes(base)
    copies = max(1, min(MAX_CALLS, math.ceil(ROTATE_BYTES / wbytes)))
    return [base] + [base._map(torch.clone) for _ in range(copies - 1)], wbytes


def _case(env, geo: str, name: str, fmt: str, m: int, cache: dict) -> Case:
    from dsv4.ops.triton.linear import grouped_linear_triton, linear_triton
    g = GEOS[geo]
    n, k = _shapes(g)[name]
    key = (geo, name, fmt)
    if key not in cache:
        ws, wbytes = rotated_copies(fmt, n, k, env.device)
        dense = ws[0].dequantize(torch.bfloat16)
        peer_copies = max(1, min(len(ws), math.ceil(ROTATE_BYTES / (2 * n * k))))
        ds = [dense] + [dense.clone() for _ in range(peer_copies - 1)]
        cache[key] = (ws, ds, wbytes)
    ws, ds, wbytes = cache[key]
    calls = len(ws)
    grouped = name == "wo_a"
    if grouped:
        G = g["groups"]
        x = torch.randn(m, G, k, device=env.device, dtype=torch.bfloat16)
        ours = [lambda w=w: grouped_linear_triton(x, w, G) for w in ws]
        # the peer: BF16 batched matmul over the groups (what DeepSeek's einsum runs)
        peer = [lambda d=d: torch.einsum("mgk,grk->mgr", x, d.view(G, n // G, k))
                for d in (ds * math.ceil(calls / len(ds)))[:calls]]
    else:
        x = torch.randn(m, k, device=env.device, dtype=torch.bfloat16)
        ours = [lambda w=w: linear_triton(x, w, True, True) for w in ws]
        peer = [lambda d=d: F.linear(x, d) for d in (ds * math.ceil(calls / len(ds)))[:calls]]
    io = (m * k + m * n) * 2
    return Case(family="linear", name=f"{geo} {name} {fmt} b={m} x{calls}", fn=graph_replay(ours),
                bytes=calls * (wbytes + io), flops=calls * 2.0 * m * n * k,
                peer="cuBLAS bf16" + (" einsum" if grouped else ""), peer_fn=graph_replay(peer), captured=True,
                notes=f"{calls} calls in one graph, rotated weights",
                extra=dict(calls=calls, peer_bytes=calls * (2 * n * k + io)))


def _prefill(env, geo: str, name: str, fmt: str, m: int) -> Case:
    from dsv4.ops.triton.linear import linear_triton
    n, k = _shapes(GEOS[geo])[name]
    torch.manual_seed(0)
    w = _quantize(fmt, torch.randn(n, k, device=env.device) * 0.02)
    dense = w.dequantize(torch.bfloat16)
    x = torch.randn(m, k, device=env.device, dtype=torch.bfloat16)
    linear_triton(x, w, True, True)
    return Case(family="linear", name=f"{geo} {name} {fmt} prefill {m}", fn=lambda: linear_triton(x, w, True, True),
                bytes=_nbytes(w) + (m * k + m * n) * 2, flops=2.0 * m * n * k, peer="cuBLAS bf16",
                peer_fn=lambda: F.linear(x, dense), notes="act quant + GEMM (two launches)")


def cases(env) -> list[Case]:
    out: list[Case] = []
    for geo in GEOS:
        cache: dict = {}
        for m in BATCHES:
            for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w13", "w2"):
                out.append(_case(env, geo, name, "fp8", m, cache))
            for fmt in ("mxfp4", "nvfp4"):
                for name in ("wq_b", "w13"):
                    out.append(_case(env, geo, name, fmt, m, cache))
        del cache
    out.append(_prefill(env, "flash", "wo_b", "fp8", 4096))
    out.append(_prefill(env, "flash", "w13", "mxfp4", 4096))
    out.append(_prefill(env, "flash", "w13", "nvfp4", 4096))
    return out
