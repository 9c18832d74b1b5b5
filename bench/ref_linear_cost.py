"""Cost of one linear on the reference path (dequantize to the activation dtype + cuBLAS), per
weight format, against the BF16 linear of the same shape: the ratio the reference must keep small.

    python bench/ref_linear_cost.py [--shapes 2048x4096 32768x1024] [--rows 1 8 512]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4 import ops  # noqa: E402
from dsv4.weights.formats import Fp8BlockWeight, Mxfp4Weight, Nvfp4Weight  # noqa: E402


def main() -> None:
    import triton.testing as tt
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["2048x4096", "32768x1024", "4096x8192"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512])
    args = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: reference linear, bf16 activations (median of do_bench)")
    for shape in args.shapes:
        n, k = (int(v) for v in shape.split("x"))
        weights = {"bf16": torch.randn(n, k, device=dev, generator=g, dtype=torch.bfloat16) * k ** -0.5,
                   "fp8": Fp8BlockWeight.random((n, k), k ** -0.5, dev, g),
                   "mxfp4": Mxfp4Weight.random((n, k), k ** -0.5, dev, g),
                   "nvfp4": Nvfp4Weight.random((n, k), k ** -0.5, dev, g)}
        for m in args.rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            times = {}
            for name, w in weights.items():
                for aq in (False, True):
                    if name == "bf16" and aq:
                        continue
                    with ops.reference_only():
                        t = tt.do_bench(lambda: ops.linear(x, w, act_quant=aq), warmup=10, rep=50,
                                        return_mode="median")
                    times[name + ("+aq" if aq else "")] = t * 1e3
            base = times["bf16"]
            cells = "  ".join(f"{k_}: {v:8.1f} us (x{v / base:5.1f})" for k_, v in times.items())
            print(f"[{n} x {k}] M={m:<4} {cells}", flush=True)


if __name__ == "__main__":
    main()
