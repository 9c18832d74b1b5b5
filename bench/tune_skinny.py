"""Search the decode GEMV's tiling (``_skinny_kernel`` in ``dsv4/ops/triton/linear.py``) by measurement.

    python bench/tune_skinny.py [--geo flash] [--batch 1] [--formats fp8 mxfp4 nvfp4]

For each decode linear of the geometry (FP8 block, plus ``wq_b`` and an expert-shaped ``w1`` in
MXFP4 and NVFP4) it times the default config of ``_skinny_config`` and a search: first the row
tile ``BN`` x the K split with the default warps and stages, then warps x stages around the best
of those. Timing as in ``bench/kernels.py``'s linear cases: a CUDA graph of calls on rotated
weight copies (no call finds its weight in L2), median of ``do_bench``. Prints per shape the default,
the best config and the speed-up, and a summary line to paste into ``_skinny_config``'s rules.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import graph_replay  # noqa: E402
from bench.kernel_cases.linear import GEOS, _shapes, rotated_copies  # noqa: E402


def configs_stage1(K: int) -> list[dict]:
    KB = math.ceil(K / 128)
    out = []
    for BN in (32, 64, 128):
        for split in (1, 2, 4, 8, 16):
            if split > KB:
                continue
            ksteps = math.ceil(KB / split)
            out.append(dict(BN=BN, MP=16, KSTEPS=ksteps, SPLIT=math.ceil(KB / ksteps)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geo", default="flash", choices=sorted(GEOS))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--formats", nargs="+", default=["fp8", "mxfp4", "nvfp4"])
    args = ap.parse_args()
    import triton.testing as tt
    from dsv4.ops.triton.linear import _skinny_config, grouped_linear_triton, linear_triton
    from dsv4.ops.triton.runtime import sm_count

    def bench(fn) -> float:
        return tt.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e-3

    g = GEOS[args.geo]
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    gbs = 2 * src.numel() / bench(lambda: dst.copy_(src)) / 1e9
    src = dst = None
    print(f"{torch.cuda.get_device_name()}: copy {gbs:.0f} GB/s; {args.geo} decode linears at batch {args.batch}")
    n_sm = sm_count(torch.device("cuda"))
    for fmt in args.formats:
        names = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w13", "w2") if fmt == "fp8" else ("wq_b", "w13")
        for name in names:
            n, k = _shapes(g)[name]
            ws, wbytes = rotated_copies(fmt, n, k, "cuda")
            copies = len(ws)
            grouped = name == "wo_a"
            G = g["groups"] if grouped else 1
            x = torch.randn(args.batch, *((G,) if grouped else ()), k, device="cuda", dtype=torch.bfloat16)
            floor = copies * wbytes / (gbs * 1e9)

            def timed(cfg):
                if grouped:
                    calls = [lambda w=w: grouped_linear_triton(x, w, G, _path="skinny", _config=cfg) for w in ws]
                else:
                    calls = [lambda w=w: linear_triton(x, w, True, True, _path="skinny", _config=cfg) for w in ws]
                try:
                    return bench(graph_replay(calls))
                except Exception as e:  # noqa: BLE001 - a config the kernel cannot run (resources)
                    print(f"    {cfg}: {type(e).__name__}: {str(e)[:80]}")
                    return math.inf

            t0 = time.perf_counter()
            default = dict(_skinny_config(args.batch, n, k, wbytes / (n * k), n_sm, fp4=fmt != "fp8"))
            default.setdefault("num_warps", 4 if fmt == "fp8" else 8)
            default.setdefault("num_stages", 4)
            t_def = timed(default)
            results = [(t_def, default)]
            for cfg in configs_stage1(k):
                cfg.update(num_warps=default["num_warps"], num_stages=default["num_stages"])
                if cfg != default:
                    results.append((timed(cfg), cfg))
            best = min(results, key=lambda r: r[0])[1]
            for warps in (2, 4, 8):
                for stages in (2, 3, 4, 5):
                    cfg = dict(best, num_warps=warps, num_stages=stages)
                    if all(cfg != c for _, c in results):
                        results.append((timed(cfg), cfg))
            t_best, best = min(results, key=lambda r: r[0])
            print(f"{fmt:<6} {name:<5} N={n:<6} K={k:<5} default {t_def / copies * 1e6:7.2f} us "
                  f"({100 * floor / t_def:5.1f}% roof) {default} | best {t_best / copies * 1e6:7.2f} us "
                  f"({100 * floor / t_best:5.1f}% roof) {best} x{t_def / t_best:.2f} "
                  f"[{len(results)} configs, {time.perf_counter() - t0:.0f} s]", flush=True)


if __name__ == "__main__":
    main()
