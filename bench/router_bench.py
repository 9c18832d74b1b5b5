"""The decode router (``ops.router``: the gate's projection, scores, top-k, weights in one launch) at
Flash / Pro shapes, CUDA-graph replay, by the number of K splits of the projection.

    python bench/router_bench.py                          # Flash and Pro, 1 / 4 / 8 tokens
    python bench/router_bench.py --splits 8 16 32

Each split is a program of one expert tile; its K loop is not pipelined, so fewer splits wait for
more loads one after another, more splits sum more partials. The first column is main's count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import time_replay  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton import small_router as k  # noqa: E402

GEOS = {"flash": (4096, 256), "pro": (7168, 384)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--splits", type=int, nargs="*", default=[8, 16])
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    main_splits = k._GATE_SPLITS
    counts = [main_splits] + [s for s in args.splits if s != main_splits]
    print(f"{torch.cuda.get_device_name()}: router (sqrtsoftplus, top-6, selection bias), us a call, by K splits")
    print(f"{'geo':>6} {'tokens':>6} " + " ".join(f"{str(s) + ' splits':>10}" for s in counts) + f" {'reference':>10}")
    for geo, (D, E) in GEOS.items():
        w = (torch.randn(E, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
        bias = torch.randn(E, device=dev, generator=g) * 0.1
        for T in args.tokens:
            x = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
            cells = []
            for s in counts:
                k._GATE_SPLITS = s
                try:
                    got = k.router_triton(x, w, "sqrtsoftplus", 6, bias=bias, scale=1.5)
                    want = ref.router(x, w, "sqrtsoftplus", 6, bias=bias, scale=1.5)
                    assert torch.equal(got[1], want[1]), "picks differ from the reference"
                    cells.append(time_replay(lambda: k.router_triton(x, w, "sqrtsoftplus", 6, bias=bias, scale=1.5)))
                finally:
                    k._GATE_SPLITS = main_splits
            t_ref = time_replay(lambda: ref.router(x, w, "sqrtsoftplus", 6, bias=bias, scale=1.5))
            print(f"{geo:>6} {T:6d} " + " ".join(f"{c * 1e6:10.1f}" for c in cells) + f" {t_ref * 1e6:10.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
