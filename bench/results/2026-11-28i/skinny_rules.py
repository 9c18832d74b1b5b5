"""Call 9: the FP8 decode GEMV's tiling rule (linear._skinny_config) against candidates, every Flash and Pro
FP8 decode linear at 1 / 8 / 32 rows, act-quant (wo_a: the grouped weight-only projection), timed as
bench/tune_skinny.py times (a CUDA graph of calls on rotated weight copies, median of do_bench).
Candidates: A = 128-row tiles for every shape, splits for ~2 programs an SM, the split caps as main;
B = A with splits up to 16 at 128-row tiles; C = main's tiles, splits for ~4 programs an SM."""
import math
import sys
from pathlib import Path

import torch
import triton.testing as tt

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from bench.kernel_cases import graph_replay  # noqa: E402
from bench.kernel_cases.linear import GEOS, _shapes, rotated_copies  # noqa: E402
from dsv4.ops.triton.linear import _skinny_config, grouped_linear_triton, linear_triton  # noqa: E402
from dsv4.ops.triton.runtime import sm_count  # noqa: E402


def rule(M, rows, K, n_sm, BN=None, programs=2, cap16=False):
    MP = 16 if M <= 16 else 32
    KB = math.ceil(K / 128)
    cap = max(1, int(K * 1.0 / (16 * M)))
    BN = BN or (128 if rows >= 64 * n_sm else 64)
    tiles = math.ceil(rows / BN)
    want = max(1, round(programs * n_sm / tiles))
    split = max(1, min(KB, want, cap, 16 if (cap16 or BN * MP <= 1024) else 8))
    ksteps = math.ceil(KB / split)
    return dict(BN=BN, MP=MP, KSTEPS=ksteps, SPLIT=math.ceil(KB / ksteps), num_warps=4, num_stages=4)


def main():
    n_sm = sm_count(torch.device("cuda"))
    bench = lambda fn: tt.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3  # noqa: E731
    rules = {"main": None, "A": dict(BN=128), "B": dict(BN=128, cap16=True), "C": dict(programs=4)}
    total = {r: 0.0 for r in rules}
    print(f"{torch.cuda.get_device_name()}: FP8 decode GEMVs, us a call (rotated copies, graph)")
    for geo in ("flash", "pro"):
        g = GEOS[geo]
        for name in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w13", "w2"):
            n, k = _shapes(g)[name]
            ws, wbytes = rotated_copies("fp8", n, k, "cuda")
            grouped = name == "wo_a"
            G = g["groups"] if grouped else 1
            for M in (1, 8, 32):
                x = torch.randn(M, *((G,) if grouped else ()), k, device="cuda", dtype=torch.bfloat16)
                cells = []
                for r, kw in rules.items():
                    cfg = dict(_skinny_config(M, n, k, 1.0, n_sm)) if kw is None else rule(M, n, k, n_sm, **kw)
                    cfg.setdefault("num_warps", 4)
                    cfg.setdefault("num_stages", 4)
                    if grouped:
                        calls = [lambda w=w, c=cfg: grouped_linear_triton(x, w, G, _path="skinny", _config=c) for w in ws]
                    else:
                        calls = [lambda w=w, c=cfg: linear_triton(x, w, True, True, _path="skinny", _config=c) for w in ws]
                    t = bench(graph_replay(calls)) / len(ws) * 1e6
                    total[r] += t
                    cells.append(f"{r} {t:6.2f} ({cfg['BN']},{cfg['SPLIT']})")
                print(f"{geo:5s} {name:5s} {n:6d}x{k:<5d} M={M:2d}: " + "  ".join(cells), flush=True)
    print("sum of all cells, us: " + "  ".join(f"{r} {t:.1f}" for r, t in total.items()))


if __name__ == "__main__":
    main()
