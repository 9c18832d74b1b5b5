"""The indexer's top-k (``ops.topk_indices``) at decode and prompt shapes: the Triton kernel
against the reference's torch ops, CUDA-graph replay, one run.

    python bench/topk_bench.py                       # Flash (k 512) and Pro (k 1024) shapes
    python bench/topk_bench.py --rows 1 32 --entries 2048 16384

A CSA layer at context C scores C / 4 compressed entries per query and keeps the top 512 (Flash)
or 1024 (Pro): one row per decode query, one per prompt token in a prefill.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import time_replay  # noqa: E402
from dsv4.ops import reference as ref  # noqa: E402
from dsv4.ops.triton.indexer import topk_indices_triton  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 4096])
    ap.add_argument("--entries", type=int, nargs="+", default=[2048, 16384, 65536])
    ap.add_argument("--k", type=int, nargs="+", default=[512, 1024])
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(f"topk_indices, CUDA graph replay, {torch.cuda.get_device_name()}")
    print(f"{'rows':>6} {'entries':>8} {'k':>5} {'reference':>12} {'kernel':>12} {'ratio':>7}")
    for n in args.entries:
        for rows in args.rows:
            if rows * n > 1 << 27:
                continue
            scores = torch.randn(rows, n, device=dev)
            scores[:, n // 2:] = float("-inf")         # half the entries not visible yet, as in a decode row
            limit = torch.full((rows,), n // 2, device=dev, dtype=torch.int64)
            for k in args.k:
                if k > n:
                    continue
                got = topk_indices_triton(scores, k, limit)
                assert torch.equal(got, ref.topk_indices(scores, k, limit)), "kernel != reference"
                t_ref = time_replay(lambda: ref.topk_indices(scores, k, limit))
                t_ker = time_replay(lambda: topk_indices_triton(scores, k, limit))
                print(f"{rows:6d} {n:8d} {k:5d} {t_ref * 1e6:10.1f}us {t_ker * 1e6:10.1f}us {t_ref / t_ker:6.1f}x",
                      flush=True)


if __name__ == "__main__":
    main()
