"""The mHC ops of a decode step (``mhc_pre_norm``, ``mhc_post_pre_norm``, ``hc_head_norm``) at Flash /
Pro decode shapes, CUDA-graph replay, with the parts that set their time taken apart.

    python bench/mhc_bench.py                    # Flash, 1 / 2 / 8 / 32 tokens
    python bench/mhc_bench.py --geo pro --tokens 1 8

A decode step runs one of these per mixer and one at the head: 2 x layers + 1 calls (87 at Flash's
43 layers), each reading the fp32 projection ``fn`` (1.5 MB at Flash) once. Columns:

- ``pre_norm``: ``mhc_pre_norm`` as the step calls it (20 Sinkhorn iterations);
- ``iters 1``: the same with one Sinkhorn iteration (the difference is the Sinkhorn's cost);
- ``post_pre``: ``mhc_post_pre_norm`` (the previous block's post made in the same launches);
- ``head``: ``hc_head_norm`` (no post, no comb, no Sinkhorn);
- ``fn floor``: ``fn``'s bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import time_replay  # noqa: E402
from dsv4.ops import reference_fused as ref  # noqa: E402
from dsv4.ops.triton import small_mhc as k  # noqa: E402

GEOS = {"flash": 4096, "pro": 7168}
NC = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geo", default="flash", choices=sorted(GEOS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 32])
    ap.add_argument("--splits", type=int, nargs="*", default=[16, 32, 64],
                    help="also time mhc_pre_norm with the projection split this many ways (main: ~2 programs an SM)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    D = GEOS[args.geo]
    g = torch.Generator(device=dev).manual_seed(0)
    n_mix = (2 + NC) * NC
    fn = torch.randn(n_mix, NC * D, device=dev, generator=g) * 0.02
    fn_head = torch.randn(NC, NC * D, device=dev, generator=g) * 0.02
    base = torch.randn(n_mix, device=dev, generator=g) * 0.1
    scale = torch.rand(3, device=dev, generator=g) + 0.5
    nw = torch.rand(D, device=dev, generator=g).to(torch.bfloat16) + 0.5
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy = time_replay(lambda: dst.copy_(src))
    gbs = 2 * src.numel() / copy / 1e9
    floor_us = fn.numel() * 4 / (gbs * 1e9) * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {gbs:.0f} GB/s; {args.geo} mHC (nc {NC}, D {D}), CUDA graph replay, "
          f"us a call")
    print(f"{'tokens':>6} {'pre_norm':>9} {'iters 1':>8} {'post_pre':>9} {'head':>7} {'reference':>10} {'fn floor':>9}")
    for T in args.tokens:
        h = torch.randn(T, NC, D, device=dev, generator=g).to(torch.bfloat16)
        out = torch.randn(T, D, device=dev, generator=g).to(torch.bfloat16)
        _, post, comb = ref.mhc_pre_norm(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)
        got = k.mhc_pre_norm_triton(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)
        want = ref.mhc_pre_norm(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)
        for a, b in zip(got, want):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
        t = [time_replay(lambda: k.mhc_pre_norm_triton(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)),
             time_replay(lambda: k.mhc_pre_norm_triton(h, fn, base, scale, 1, 1e-6, 1e-6, nw, 1e-6)),
             time_replay(lambda: k.mhc_post_pre_norm_triton(out, h, post, comb, fn, base, scale, 20, 1e-6, 1e-6,
                                                            nw, 1e-6)),
             time_replay(lambda: k.hc_head_norm_triton(h, fn_head, base[:NC], scale[:1], 1e-6, 1e-6, nw, 1e-6)),
             time_replay(lambda: ref.mhc_pre_norm(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6))]
        print(f"{T:6d} " + " ".join(f"{x * 1e6:{w}.1f}" for x, w in zip(t, (9, 8, 9, 7, 10)))
              + f" {floor_us:9.2f}", flush=True)
    main_splits = k._splits
    for T in args.tokens:
        h = torch.randn(T, NC, D, device=dev, generator=g).to(torch.bfloat16)
        cells = []
        for n in args.splits:
            def fixed(T_, K, tb, device, n=n):
                kchunk = -(-K // n // k._BK) * k._BK
                return -(-K // kchunk), kchunk
            k._splits = fixed
            try:
                cells.append(f"{n} splits {time_replay(lambda: k.mhc_pre_norm_triton(h, fn, base, scale, 20, 1e-6, 1e-6, nw, 1e-6)) * 1e6:.1f}")
            finally:
                k._splits = main_splits
        print(f"pre_norm, {T} tokens: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
