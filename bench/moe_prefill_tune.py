"""The prefill MoE's grouped GEMMs at a Flash layer's real shape: tile configs against each other
and against the QDOT path, per kernel, in one run (one GPU).

    python bench/moe_prefill_tune.py [--tokens 8192] [--geo flash|pro]

Random MXFP4 experts (all ``E`` of them), random top-k routing, bf16 activations, act-quant with
power-of-two scales (the checkpoint's ``ue8m0``): what one prefill step of ``--tokens`` tokens
runs in each MoE layer. For each config: the device time of ``_w13_grouped`` and ``_w2_grouped``
(torch.profiler, mean of ``--iters`` calls), their TFLOP/s (``2 * pairs * D * I`` per GEMM, the
gate and up halves counted apart) and the output's relative difference from the first row (the
QDOT path, which multiplies the e4m3 values on fp16 tensor cores per 32-group).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from dsv4.ops.triton import moe as M
from dsv4.weights.formats import Mxfp4Weight

GEOS = {"flash": dict(E=256, D=4096, I=2048, k=6), "pro": dict(E=384, D=7168, I=3072, k=6)}

#: (label, MXFP4 on dequantized operands?, configs of that path: M.CONFIGS["grouped"] (the QDOT
#: path, BM 64) or M.CONFIGS["grouped_mxfp4"] and ["grouped_mxfp4_few"] (BM by moe.tiles))
#: as (BN, BK, num_warps, num_stages, K-loop pipelining)
CASES = [
    ("qdot (before)", False, (64, 128, 8, 3, 1), (128, 128, 8, 3, 1)),
    ("dequantized, PIPE 1", True, (64, 128, 8, 3, 1), (128, 128, 8, 3, 1)),
    ("dequantized (default)", True, (64, 128, 8, 3, 3), (128, 128, 8, 3, 3)),
    ("dequantized, BK 64", True, (64, 64, 8, 4, 4), (128, 64, 8, 4, 4)),
    ("dequantized, w13 BN 32", True, (32, 128, 4, 3, 3), (128, 128, 8, 3, 3)),
    ("dequantized, w2 BN 64", True, (64, 128, 8, 3, 3), (64, 128, 4, 3, 3)),
    # few pairs an expert (short prompts, mixed steps): smaller tiles (--bm) and wider N
    ("deq, BN 128 w4", True, (128, 128, 4, 3, 3), (128, 128, 4, 3, 3)),
    # (index 7: the grouped_mxfp4_few config)
    ("deq, BN 64 w4 s4", True, (64, 128, 4, 4, 3), (128, 128, 4, 4, 3)),
    ("deq, BN 32 w2", True, (32, 128, 2, 3, 3), (64, 128, 2, 3, 3)),
    ("deq, BN 128 w4 s4", True, (128, 128, 4, 4, 3), (128, 128, 4, 4, 3)),
    ("deq, BN 64 w4 s5", True, (64, 128, 4, 5, 3), (128, 128, 4, 5, 3)),
]


def _weights(E: int, N: int, K: int, seed: int) -> Mxfp4Weight:
    g = torch.Generator("cuda").manual_seed(seed)
    u8 = dict(generator=g, dtype=torch.uint8, device="cuda")
    return Mxfp4Weight(torch.randint(0, 256, (E, N, K // 2), **u8),
                       torch.randint(117, 123, (E, N, K // 32), **u8))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--geo", choices=GEOS, default="flash")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", type=int, nargs="*", help="indices into CASES (default all)")
    ap.add_argument("--bm", type=int, nargs="*", default=[0],
                    help="pairs a tile (0: moe.tiles' choice); each case runs with each")
    a = ap.parse_args()
    g = GEOS[a.geo]
    E, D, I, k, T = g["E"], g["D"], g["I"], g["k"], a.tokens
    w1, w3, w2 = _weights(E, I, D, 1), _weights(E, I, D, 3), _weights(E, D, I, 2)
    x = (torch.randn(T, D, device="cuda") * 2).bfloat16()
    ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices
    rw = torch.rand(T, k, device="cuda") + 0.1
    P = T * k
    flops = {"_w13_grouped_kernel": 4 * P * D * I, "_w2_grouped_kernel": 2 * P * D * I}
    print(f"{a.geo}: T={T} pairs={P} E={E} D={D} I={I}; {torch.cuda.get_device_name()}")
    print(f"{'case':32s} {'w13 ms':>8s} {'TF/s':>6s} {'w2 ms':>8s} {'TF/s':>6s} {'MoE ms':>8s} {'vs first':>9s}")
    exact, tiles = M._exact_dequantized, M.tiles
    first = None
    runs = [(i, c, bm) for i, c in enumerate(CASES) if not a.cases or i in a.cases for bm in a.bm]
    for i, (label, plain, c13, c2), bm in runs:
        label = label if not bm else f"{label}, BM {bm}"
        M.tiles = (lambda P, E, dec, mx, _bm=bm: (_bm, tiles(P, E, dec, mx)[1]) if _bm and not dec
                   else tiles(P, E, dec, mx))
        M._exact_dequantized = (lambda *args, _p=plain: _p and exact(*args))
        for key in (("grouped_mxfp4", "grouped_mxfp4_few") if plain else ("grouped",)):
            M.CONFIGS[key] = dict(w13=c13, w2=c2)
        try:
            out = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)   # compile
            torch.cuda.synchronize()
        except Exception as e:                                              # noqa: BLE001
            print(f"{label:32s} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            continue
        times: dict[str, float] = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(a.iters):
                M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)
            torch.cuda.synchronize()
        total = 0.0
        for ev in prof.key_averages():
            us = ev.device_time_total / a.iters
            total += us
            for name in flops:
                if name in ev.key:
                    times[name] += us
        diff = 0.0 if first is None else float((out.float() - first).norm() / first.norm())
        first = out.float() if first is None else first
        r = [(times[n] / 1e3, flops[n] / max(times[n], 1e-9) / 1e6) for n in flops]
        print(f"{label:32s} {r[0][0]:8.2f} {r[0][1]:6.0f} {r[1][0]:8.2f} {r[1][1]:6.0f} "
              f"{total / 1e3:8.2f} {diff:9.2e}", flush=True)
    M._exact_dequantized, M.tiles = exact, tiles


if __name__ == "__main__":
    main()
