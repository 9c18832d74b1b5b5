"""The prefill MoE's grouped GEMMs at a Flash layer's real shape: tile configs against each other
and against the QDOT path, per kernel, in one run (one GPU).

    python bench/moe_prefill_tune.py [--tokens 8192] [--geo flash|pro]

Random MXFP4 experts (all ``E`` of them), random top-k routing, bf16 activations, act-quant with
power-of-two scales (the checkpoint's ``ue8m0``): what one prefill step of ``--tokens`` tokens
runs in each MoE layer. For each config: the device time of the gate/up and down GEMMs
(``_w13_grouped`` / ``_w13_wt`` and ``_w2_grouped``; torch.profiler, mean of ``--iters``
calls), their TFLOP/s (``2 * pairs * D * I`` per GEMM, the gate and up halves counted apart), the
whole MoE's time and the output's relative difference from the first row run (with no ``--cases``,
the QDOT path, which multiplies the e4m3 values on fp16 tensor cores per 32-group).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from dsv4.ops.triton import moe as M
from dsv4.weights.formats import Mxfp4Weight

GEOS = {"flash": dict(E=256, D=4096, I=2048, k=6), "pro": dict(E=384, D=7168, I=3072, k=6)}

#: (label, CONFIGS key, config) with the key "grouped" (the QDOT path: e4m3 values on fp16 tensor
#: cores per 32-group, BM 64), or an MXFP4 one on dequantized operands ("grouped_mxfp4_few" and
#: "grouped_mxfp4": the gate/up GEMM transposed or not as the config's ``wt`` says, the down one never
#: (moe_grouped); BM from --bm or moe.tiles); configs as moe.CONFIGS: (BN, BK, num_warps, num_stages,
#: K-loop pipelining) per GEMM, ``wt`` (the gate/up GEMM transposed: moe_grouped._gemm_wt)
def _c(w13: tuple, w2: tuple, wt: bool = False) -> dict:
    return dict(w13=w13, w2=w2, wt=wt)


CASES = [
    ("qdot (before)", "grouped", _c((64, 128, 8, 3, 1), (128, 128, 8, 3, 1))),
    ("dequantized, PIPE 1", "grouped_mxfp4_few", _c((64, 128, 8, 3, 1), (128, 128, 8, 3, 1))),
    ("dequantized, w8", "grouped_mxfp4_few", _c((64, 128, 8, 3, 3), (128, 128, 8, 3, 3))),
    ("dequantized, BK 64", "grouped_mxfp4_few", _c((64, 64, 8, 4, 4), (128, 64, 8, 4, 4))),
    ("dequantized, w13 BN 32", "grouped_mxfp4_few", _c((32, 128, 4, 3, 3), (128, 128, 8, 3, 3))),
    ("dequantized, w2 BN 64", "grouped_mxfp4_few", _c((64, 128, 8, 3, 3), (64, 128, 4, 3, 3))),
    ("deq, BN 128 w4", "grouped_mxfp4_few", _c((128, 128, 4, 3, 3), (128, 128, 4, 3, 3))),
    # (index 7: the grouped_mxfp4_few config)
    ("deq, BN 64 w4 s4", "grouped_mxfp4_few", _c((64, 128, 4, 4, 3), (128, 128, 4, 4, 3))),
    ("deq, BN 32 w2", "grouped_mxfp4_few", _c((32, 128, 2, 3, 3), (64, 128, 2, 3, 3))),
    ("deq, BN 128 w4 s4", "grouped_mxfp4_few", _c((128, 128, 4, 4, 3), (128, 128, 4, 4, 3))),
    ("deq, BN 64 w4 s5", "grouped_mxfp4_few", _c((64, 128, 4, 5, 3), (128, 128, 4, 5, 3))),
    # (index 11 on) weight rows on the MMA's M side in the gate/up GEMM (11: the grouped_mxfp4 config)
    ("wt, w13 BN 128 w8, w2 BN 128 (untransposed)", "grouped_mxfp4", _c((128, 128, 8, 3, 3), (128, 128, 8, 3, 3), True)),
    ("wt, BN 128 w8 s3", "grouped_mxfp4", _c((128, 128, 8, 3, 3), (128, 128, 8, 3, 3), True)),
    ("wt, BN 64 w4 s4", "grouped_mxfp4", _c((64, 128, 4, 4, 4), (64, 128, 4, 4, 4), True)),
    ("wt, BN 128 BK 64 w4 s4", "grouped_mxfp4", _c((128, 64, 4, 4, 4), (128, 64, 4, 4, 4), True)),
    ("wt, BN 256 BK 64 w8 s3", "grouped_mxfp4", _c((256, 64, 8, 3, 3), (256, 64, 8, 3, 3), True)),
    # (index 16 on) fewer weight rows a tile, for 256-pair tiles (--bm 256): each decoded weight
    # value serves twice the pairs
    ("wt, w13 BN 64 w8 s3, w2 BN 128", "grouped_mxfp4", _c((64, 128, 8, 3, 3), (128, 128, 8, 3, 3), True)),
    ("wt, BN 64 BK 64 w8 s3, w2 BN 128", "grouped_mxfp4", _c((64, 64, 8, 3, 3), (128, 64, 8, 3, 3), True)),
    ("wt, BN 64 w8 s2, w2 BN 64 s3", "grouped_mxfp4", _c((64, 128, 8, 2, 2), (64, 128, 8, 3, 3), True)),
    ("wt, BN 64 BK 64 w8 s4, w2 BK 64 s4", "grouped_mxfp4", _c((64, 64, 8, 4, 4), (128, 64, 8, 4, 4), True)),
    # (20) the grouped_mxfp4_wide config (256-pair tiles from moe.MXFP4_WIDE_TILE_PAIRS an expert on)
    ("wide: w13 BN 64 w8 s3, w2 BN 128 BK 64 s3", "grouped_mxfp4_wide", _c((64, 128, 8, 3, 3), (128, 64, 8, 3, 3), True)),
    # (21 on, 2026-11-28 fifth session) gate and up rows stacked into one MMA of 2 BN rows
    # (moe_grouped._gemm_wt), each product retired before the next K step's decode
    ("stacked, w13 BN 64 BK 128 s2", "grouped_mxfp4_wide", _c((64, 128, 8, 2, 2), (128, 64, 8, 3, 3), True)),
    ("stacked, w13 BN 64 BK 64 s3", "grouped_mxfp4_wide", _c((64, 64, 8, 3, 3), (128, 64, 8, 3, 3), True)),
    ("stacked, w13 BN 64 BK 64 s4", "grouped_mxfp4_wide", _c((64, 64, 8, 4, 4), (128, 64, 8, 3, 3), True)),
    ("stacked, w13 BN 32 BK 128 s3", "grouped_mxfp4_wide", _c((32, 128, 8, 3, 3), (128, 64, 8, 3, 3), True)),
    ("stacked, w13 BN 64 BK 128 s3 (128-pair tiles)", "grouped_mxfp4", _c((64, 128, 8, 3, 3), (128, 128, 8, 3, 3), True)),
    ("stacked, w13 BN 64 BK 64 s4 (128-pair tiles)", "grouped_mxfp4", _c((64, 64, 8, 4, 4), (128, 128, 8, 3, 3), True)),
    # (27 on) 16 warps: 128 registers a thread, no spills, no race (CPU compile; not yet timed)
    ("stacked w16, w2 w8", "grouped_mxfp4_wide", _c((64, 64, 16, 4, 4), (128, 64, 8, 3, 3), True)),
    ("stacked w16, w2 w16", "grouped_mxfp4_wide", _c((64, 64, 16, 4, 4), (128, 64, 16, 3, 3), True)),
    # (29 on, 2026-11-28 sixth session. Commit ec7c0cf also had seven cases of the down GEMM transposed,
    # moe_grouped._w2_wt_kernel, no faster and removed: 29-34 and 40. Its numbers 35-39 are 29-33
    # here, 41-44 are 34-37: results/2026-11-28g/moe*.sh ran those.)
    # (29 on) one warpgroup a program, two or three programs a multiprocessor: programs do not wait
    # at each other's barriers, so one decodes while another multiplies
    ("w13 BN 32 w4 s3, w2 BN 64 w4 s3", "grouped_mxfp4_wide", _c((32, 64, 4, 3, 3), (64, 64, 4, 3, 3), True)),
    ("w13 BN 32 w4 s2, w2 BN 64 w4 s2", "grouped_mxfp4_wide", _c((32, 64, 4, 2, 2), (64, 64, 4, 2, 2), True)),
    ("w13 BN 32 BK 32 w4 s4, w2 BN 128 w8 s3", "grouped_mxfp4_wide", _c((32, 32, 4, 4, 4), (128, 64, 8, 3, 3), True)),
    ("w13 BN 32 w4 s4, w2 BN 64 w4 s4 (128-pair tiles)", "grouped_mxfp4", _c((32, 64, 4, 4, 4), (64, 64, 4, 4, 4), True)),
    ("w13 BN 32 w4 s3, w2 BN 64 BK 64 w4 s3 (128-pair tiles)", "grouped_mxfp4", _c((32, 64, 4, 3, 3), (64, 64, 4, 3, 3), True)),
    # (34 on) around case 29's gate/up tiles (8192 tokens: 6.11 -> 5.68 ms; 36, the engine's since: 9.78 -> 9.16 ms for the MoE)
    ("w13 BN 32 w4 s3, w2 BN 128 w8 s3", "grouped_mxfp4_wide", _c((32, 64, 4, 3, 3), (128, 64, 8, 3, 3), True)),
    ("w13 BN 32 w4 s4, w2 BN 128 w8 s3", "grouped_mxfp4_wide", _c((32, 64, 4, 4, 4), (128, 64, 8, 3, 3), True)),
    ("w13 BN 32 w4 s3, w2 BN 128 w8 s4", "grouped_mxfp4_wide", _c((32, 64, 4, 3, 3), (128, 64, 8, 4, 4), True)),
    ("w13 BN 32 w4 s3, w2 BN 256 w8 s2", "grouped_mxfp4_wide", _c((32, 64, 4, 3, 3), (256, 64, 8, 2, 2), True)),
    # (38 on) the 128-pair tiles' down GEMM at BK 64, 4 and 5 stages; the wide one at 5 stages
    ("w2 BN 128 BK 64 w8 s4 (128-pair tiles)", "grouped_mxfp4", _c((64, 64, 8, 4, 4), (128, 64, 8, 4, 4), True)),
    ("w2 BN 128 BK 64 w8 s5 (128-pair tiles)", "grouped_mxfp4", _c((64, 64, 8, 4, 4), (128, 64, 8, 5, 5), True)),
    ("w13 BN 32 w4 s3, w2 BN 128 w8 s5", "grouped_mxfp4_wide", _c((32, 64, 4, 3, 3), (128, 64, 8, 5, 5), True)),
    # (41, 2026-11-28 seventh session) case 14's gate/up GEMM with case 7's down GEMM at 64-pair tiles (faster,
    # but its gate/up kernel keeps 32 bytes of stack); 42: the grouped_mxfp4_mid config (case 33's gate/up GEMM)
    ("mid: w13 wt BN 128 BK 64 w4 s4, w2 BN 128 w4 s4", "grouped_mxfp4_mid", _c((128, 64, 4, 4, 4), (128, 128, 4, 4, 3), True)),
    ("mid: w13 wt BN 32 BK 64 w4 s3, w2 BN 128 w4 s4", "grouped_mxfp4_mid", _c((32, 64, 4, 3, 3), (128, 128, 4, 4, 3), True)),
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
    ap.add_argument("--decode", choices=["bf16", "fp32", "both"], default="bf16",
                    help="MXFP4 tiles dequantized in bf16 (moe.Launch.mx_bf16, the engine's choice for "
                         "these scales) or through fp16 and fp32 (the general decode); both: each case twice")
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
    print(f"{'case':44s} {'w13 ms':>8s} {'TF/s':>6s} {'w2 ms':>8s} {'TF/s':>6s} {'MoE ms':>8s} {'vs first':>9s}")
    exact, tiles, fit = M._exact_dequantized, M.tiles, M._scales_fit_bf16
    first = None
    modes = ["bf16", "fp32"] if a.decode == "both" else [a.decode]
    runs = [(i, c, bm, m) for i, c in enumerate(CASES) if not a.cases or i in a.cases for bm in a.bm for m in modes]
    for i, (label, key, cfg), bm, mode in runs:
        label = label if not bm else f"{label}, BM {bm}"
        label = label if a.decode != "both" else f"{label}, {mode}"
        M._scales_fit_bf16 = fit if mode == "bf16" else (lambda weights: False)

        def pick(P, E, dec, mx, _bm=bm, _key=key):
            got = tiles(P, E, dec, mx)
            if dec or not (mx or _key == "grouped"):
                return got
            # a key's own tile unless --bm names one (the few-pairs kernels: the engine's, at most 128)
            return (_bm or {"grouped_mxfp4": 128, "grouped_mxfp4_wide": 256}.get(_key, min(got[0], 128))), _key
        M.tiles = pick
        M._exact_dequantized = (lambda *args, _k=key: _k != "grouped" and exact(*args))
        saved = M.CONFIGS[key]
        M.CONFIGS[key] = cfg
        try:
            out = M.moe_triton(x, ids, rw, w1, w3, w2, 10.0, True, True)   # compile
            torch.cuda.synchronize()
        except Exception as e:                                              # noqa: BLE001
            print(f"{label:44s} failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            M.CONFIGS[key] = saved
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
            for name, alias in ((n, n.replace("_grouped_kernel", "_wt_kernel")) for n in flops):
                if name in ev.key or alias in ev.key:
                    times[name] += us
        diff = 0.0 if first is None else float((out.float() - first).norm() / first.norm())
        first = out.float() if first is None else first
        r = [(times[n] / 1e3, flops[n] / max(times[n], 1e-9) / 1e6) for n in flops]
        print(f"{label:44s} {r[0][0]:8.2f} {r[0][1]:6.0f} {r[1][0]:8.2f} {r[1][1]:6.0f} "
              f"{total / 1e3:8.2f} {diff:9.2e}", flush=True)
        M.CONFIGS[key] = saved
    M._exact_dequantized, M.tiles, M._scales_fit_bf16 = exact, tiles, fit


if __name__ == "__main__":
    main()
