"""Peer check: vLLM's ``humming-kernels`` (JIT quantized GEMMs) against our fused Triton MoE.

    python bench/humming_peer.py [--tokens 1 8 32]

Flash geometry (256 experts, D 4096, I 2048, top-6), random MXFP4 experts (the same packed codes and
e8m0 scales for both: humming's ``mxfp4`` weight schema takes our ``[E, N, K/2]`` uint8 codes, low
nibble first, and ``[E, N, K/32]`` e8m0 bytes as they are), BF16 activations on both sides (W4A16;
ours with ``act_quant`` off). Humming runs the routed experts as two indexed grouped GEMMs over a
``moe_align_block_size`` layout (``sorted_ids`` / ``expert_ids`` / ``num_tokens_padded``, built on
the device with torch ops at the block size its heuristic picks): ``w13`` (w1 and w3 stacked as one
``[E, 2I, D]`` layer), then SwiGLU with the routing weight in torch, ``w2``, and the top-k sum in
torch. "humming GEMMs" times the two GEMMs alone on a prebuilt layout. Times: ``bench.kernels.Env``
(CUDA graph of 10 calls, each after an L2 flush whose time is subtracted; ``eager`` where capture
fails). Floor: distinct experts x per-expert packed bytes / the 1 GiB device-copy bandwidth.
A context line per T adds ours with ``act_quant`` on (the production path, W4A8) and the time of
humming's layout build alone (part of "humming total").
The script installs nothing: humming must be importable (``bench/gpu_quick.sh humming``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

E, D, I, TOP_K = 256, 4096, 2048, 6
LIMIT = 10.0
_T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - _T0:6.1f}s] {msg}", flush=True)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``moe_align_block_size`` on the device, no host read (capturable).

    ``sorted_ids [L]`` int32: flat pair indices ``t * k + j`` grouped by expert, each expert's run
    padded to a multiple of ``block`` with ``P = T * k`` (out of range: the kernel skips it);
    ``expert_ids [L / block]`` int32: the expert of each block (blocks past the end: the last
    expert, never read); ``num_tokens_padded`` 0-d int32: the used length. ``L`` is the host-known
    bound ``P + min(E, P) * (block - 1)`` rounded up to ``block``.
    """
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    max_len = -(-(P + min(num_experts, P) * (block - 1)) // block) * block
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    end = padded.cumsum(0)
    start = end - padded
    first = counts.cumsum(0) - counts                       # first sorted position of each expert
    order = torch.argsort(flat, stable=True)
    se = flat[order]
    pos = start[se] + torch.arange(P, device=dev) - first[se]
    sorted_ids = torch.full((max_len,), P, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, pos, order.to(torch.int32))
    block_start = torch.arange(max_len // block, device=dev) * block
    expert_ids = torch.searchsorted(end, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, end[-1].to(torch.int32)


def _random_mxfp4(N: int, K: int, g: torch.Generator, dev: str):
    """A random stacked ``[E, N, K]`` MXFP4 weight (codes uniform, one scale keeping outputs O(1))."""
    from dsv4.weights.formats import Mxfp4Weight
    packed = torch.randint(0, 256, (E, N, K // 2), generator=g, dtype=torch.uint8, device=dev)
    exp = 127 - round(torch.log2(torch.tensor(2.93 * K ** 0.5)).item())
    scale = torch.full((E, N, K // 32), exp, dtype=torch.uint8, device=dev)
    return Mxfp4Weight(packed, scale, name="experts.mxfp4")


def _swap_nibbles(p: torch.Tensor) -> torch.Tensor:
    return ((p & 0x0F) << 4) | (p >> 4)


def humming_layer(packed: torch.Tensor, scale: torch.Tensor, swap: bool):
    """A humming MoE layer ``[E, N, K]`` from our packed MXFP4 codes and e8m0 scales."""
    from humming.layer import HummingLayer
    _, N, kh = packed.shape
    with torch.device(packed.device):
        layer = HummingLayer(shape_n=N, shape_k=2 * kh, weight_config={"quant_method": "mxfp4"},
                             num_experts=E, torch_dtype=torch.bfloat16)
    layer.load_from_tensors({"weight": _swap_nibbles(packed) if swap else packed, "weight_scale": scale})
    layer.transform()
    return layer


class Humming:
    """The routed experts through humming: w13 GEMM, SwiGLU (torch), w2 GEMM, top-k sum (torch)."""

    CC = {"gemm_type": "indexed"}

    def __init__(self, w1, w3, w2, swap: bool = False):
        self.l13 = humming_layer(torch.cat([w1.packed, w3.packed], 1), torch.cat([w1.scale, w3.scale], 1), swap)
        self.l2 = humming_layer(w2.packed, w2.scale, swap)

    def setup(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        from humming.tune import get_heuristics_config
        T, k = ids.shape
        P = T * k
        self.x, self.ids, self.w = x, ids, weights.reshape(-1, 1).float()
        self.cfg13 = get_heuristics_config(self.l13.humming_config, shape_m=P, gemm_type="indexed",
                                           device=x.device)
        self.cfg2 = get_heuristics_config(self.l2.humming_config, shape_m=P, gemm_type="indexed",
                                          device=x.device)
        self.b13, self.b2 = self.cfg13["block_shape"][0], self.cfg2["block_shape"][0]
        self.o13 = torch.empty(P, 2 * I, dtype=torch.bfloat16, device=x.device)
        self.o2 = torch.empty(P, D, dtype=torch.bfloat16, device=x.device)
        self.h = torch.zeros(P, I, dtype=torch.bfloat16, device=x.device)
        self.lay13 = moe_align(ids, E, self.b13)               # fixed layouts for the GEMMs-only timing
        self.lay2 = self.lay13 if self.b2 == self.b13 else moe_align(ids, E, self.b2)

    def gemm13(self, lay) -> torch.Tensor:
        s, e, n = lay
        return self.l13(self.x, outputs=self.o13, sorted_ids=s, expert_ids=e, num_tokens_padded=n,
                        top_k=TOP_K, compute_config=self.CC, tuning_config=self.cfg13)

    def gemm2(self, h: torch.Tensor, lay) -> torch.Tensor:
        s, e, n = lay
        return self.l2(h, outputs=self.o2, sorted_ids=s, expert_ids=e, num_tokens_padded=n,
                       top_k=1, compute_config=self.CC, tuning_config=self.cfg2)

    def gemms(self) -> None:
        self.gemm13(self.lay13)
        self.gemm2(self.h, self.lay2)

    def __call__(self) -> torch.Tensor:
        lay13 = moe_align(self.ids, E, self.b13)
        lay2 = lay13 if self.b2 == self.b13 else moe_align(self.ids, E, self.b2)
        gu = self.gemm13(lay13).float()
        g, u = gu[:, :I], gu[:, I:]
        h = (F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT) * self.w).to(torch.bfloat16)
        y = self.gemm2(h, lay2)
        return y.view(-1, TOP_K, D).float().sum(1).to(torch.bfloat16)


def _rel(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a.float() - b.float())
    return d.abs().max().item(), (d.norm() / b.float().norm().clamp_min(1e-30)).item()


def w13_check(hm: Humming, w1, w3) -> float:
    """Relative error of humming's w13 GEMM vs a dequantized reference on the selected experts."""
    from dsv4.weights.formats import Mxfp4Weight
    out = hm.gemm13(moe_align(hm.ids, E, hm.b13)).float()
    flat = hm.ids.reshape(-1)
    ref = torch.empty_like(out)
    for p in range(flat.numel()):
        e = int(flat[p])
        w = torch.cat([Mxfp4Weight(w1.packed[e], w1.scale[e]).dequantize(torch.float32),
                       Mxfp4Weight(w3.packed[e], w3.scale[e]).dequantize(torch.float32)], 0)
        ref[p] = w @ hm.x[p // TOP_K].float()
    return _rel(out, ref)[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    import humming

    from bench.kernels import Env
    from dsv4 import ops

    dev = "cuda"
    torch.manual_seed(0)
    log(f"humming {humming.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    env = Env(dev)
    log(f"copy bandwidth {env.copy_gbs:.0f} GB/s (1 GiB device copy, read + write)")
    g = torch.Generator(dev).manual_seed(1)
    w1, w3, w2 = _random_mxfp4(I, D, g, dev), _random_mxfp4(I, D, g, dev), _random_mxfp4(D, I, g, dev)
    per_expert = (w1.nbytes + w3.nbytes + w2.nbytes) / E
    log(f"experts built: {per_expert / 1e6:.2f} MB packed per expert (w1 + w3 + w2 codes and scales)")
    hm = Humming(w1, w3, w2)
    log("humming layers transformed")

    gc = torch.Generator().manual_seed(2)
    swapped = False
    for T in args.tokens:
        x = torch.randn(T, D, generator=gc).to(dev, torch.bfloat16)
        ids = torch.rand(T, E, generator=gc).argsort(-1)[:, :TOP_K].to(dev)
        weights = torch.rand(T, TOP_K, generator=gc).to(dev)
        distinct = ids.unique().numel()
        hm.setup(x, ids, weights)
        log(f"T={T}: block_m w13 {hm.b13} / w2 {hm.b2}; cfg13 {hm.cfg13}; cfg2 {hm.cfg2}")
        if T == args.tokens[0]:
            rel13 = w13_check(hm, w1, w3)
            log(f"w13 GEMM vs dequantized reference: rel err {rel13:.2e}")
            if rel13 > 0.05:
                log("large error: retrying with the two nibbles of each byte swapped")
                del hm
                torch.cuda.empty_cache()
                hm, swapped = Humming(w1, w3, w2, swap=True), True
                hm.setup(x, ids, weights)
                log(f"swapped nibbles: w13 rel err {w13_check(hm, w1, w3):.2e}")
        args_ours = (x, ids, weights, w1, w3, w2, LIMIT, False, True)
        ours_out = ops.moe(*args_ours)
        hum_out = hm()
        torch.cuda.synchronize()
        mad, rel = _rel(hum_out, ours_out)
        t_ours, m_ours = env.time(lambda: ops.moe(*args_ours))
        t_hum, m_hum = env.time(hm)
        t_gem, m_gem = env.time(hm.gemms)
        floor = distinct * per_expert / (env.copy_gbs * 1e9)
        mode = "" if {m_ours, m_hum, m_gem} == {"graph"} else f" [modes ours {m_ours}, humming {m_hum}, gemms {m_gem}]"
        print(f"T={T:3d} ({distinct:3d} distinct): ours {t_ours * 1e6:8.1f} us | humming total "
              f"{t_hum * 1e6:8.1f} us | humming GEMMs {t_gem * 1e6:8.1f} us | humming/ours "
              f"{t_hum / t_ours:5.2f}x (GEMMs {t_gem / t_ours:5.2f}x) | floor {floor * 1e6:7.1f} us: ours "
              f"{100 * floor / t_ours:5.1f}%, humming {100 * floor / t_hum:5.1f}% (GEMMs "
              f"{100 * floor / t_gem:5.1f}%) | humming vs ours max|d| {mad:.3e} rel {rel:.2e}"
              f"{' (nibble-swapped)' if swapped else ''}{mode}", flush=True)
        args_q = args_ours[:7] + (True, True)                  # production: e4m3 activations per 1x128
        t_q, m_q = env.time(lambda: ops.moe(*args_q))
        t_lay, m_lay = env.time(lambda: (moe_align(ids, E, hm.b13), hm.b2 == hm.b13 or moe_align(ids, E, hm.b2)))
        print(f"       context: ours with act_quant on {t_q * 1e6:8.1f} us ({100 * floor / t_q:5.1f}% of floor, "
              f"{m_q}); humming's layout build (torch ops) {t_lay * 1e6:6.1f} us ({m_lay})", flush=True)


if __name__ == "__main__":
    main()
