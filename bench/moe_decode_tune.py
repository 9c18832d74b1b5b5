"""The decode MoE (few tokens) at a real layer's shape: the per-pair CUDA-core GEMV (BM = 1) against
16-pair ``tl.dot`` tiles (BM = 16), per token count, in one run (one GPU).

    python bench/moe_decode_tune.py [--geo flash|pro] [--tokens 1 2 4 8 16 32] [--iters 20]

Random MXFP4 experts (all ``E`` of them), random top-k routing, bf16 activations, act-quant with
power-of-two scales (the checkpoint's ``ue8m0``): one MoE call of a decode (or verify) step. For
each token count and path: the device time of the call's kernels (torch.profiler, mean of
``--iters`` calls), the bytes of the distinct experts it must read (data + scales of w1, w3, w2)
over that time, and the output's largest relative difference from the reference op. The faster
path up to a token count sets ``moe.GEMV_MAX_TOKENS``.
"""

from __future__ import annotations

import argparse

import torch

from dsv4.ops import reference
from dsv4.ops.triton import moe as M
from dsv4.weights.formats import Mxfp4Weight

GEOS = {"flash": dict(E=256, D=4096, I=2048, k=6), "pro": dict(E=384, D=7168, I=3072, k=6)}


def _weights(E: int, N: int, K: int, seed: int) -> Mxfp4Weight:
    g = torch.Generator("cuda").manual_seed(seed)
    u8 = dict(generator=g, dtype=torch.uint8, device="cuda")
    return Mxfp4Weight(torch.randint(0, 256, (E, N, K // 2), **u8),
                       torch.randint(117, 123, (E, N, K // 32), **u8))


def _device_ms(fn, iters: int) -> float:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(ev.device_time_total for ev in prof.key_averages()) / iters / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geo", choices=GEOS, default="flash")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    g = GEOS[a.geo]
    E, D, I, k = g["E"], g["D"], g["I"], g["k"]
    w1, w3, w2 = _weights(E, I, D, 1), _weights(E, I, D, 3), _weights(E, D, I, 2)
    per_expert = sum(w.packed[0].numel() + w.scale[0].numel() for w in (w1, w3, w2))
    print(f"{a.geo}: E={E} D={D} I={I} k={k}, MXFP4 experts ({per_expert / 2**20:.1f} MiB each), act-quant pow2; "
          f"{torch.cuda.get_device_name()}")
    print(f"{'tokens':>6s} {'experts':>7s} {'path':>10s} {'ms':>8s} {'GB/s':>7s} {'max rel diff':>13s}")
    saved = M.GEMV_MAX_TOKENS
    for T in a.tokens:
        gen = torch.Generator("cuda").manual_seed(T)
        x = (torch.randn(T, D, device="cuda", generator=gen) * 2).bfloat16()
        ids = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=1).indices
        rw = torch.rand(T, k, device="cuda", generator=gen) + 0.1
        distinct = int(ids.unique().numel())
        want = reference.moe(x.float(), ids, rw, w1, w3, w2, 10.0, act_quant=True, pow2=True)
        for path, limit in (("gemv BM1", 1 << 30), ("dot BM16", 0)):
            M.GEMV_MAX_TOKENS = limit
            fn = lambda: M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)   # noqa: E731
            out = fn()                                                            # compile
            torch.cuda.synchronize()
            ms = _device_ms(fn, a.iters)
            diff = float(((out.float() - want).abs().max() / want.abs().max()))
            print(f"{T:>6d} {distinct:>7d} {path:>10s} {ms:8.3f} {distinct * per_expert / ms / 1e6:7.0f} "
                  f"{diff:13.2e}", flush=True)
    M.GEMV_MAX_TOKENS = saved


if __name__ == "__main__":
    main()
