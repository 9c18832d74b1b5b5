"""The sampler's cost per decode step: :meth:`SlotSampling.sample` over ``[B, V]`` logits, replayed
as a CUDA graph (as the runner's captured step runs it), the reference's torch ops against the
kernel behind ``ops.draw_tokens``, in one run.

    python bench/sampler_bench.py                       # V = 129280, B = 1 8 32 64, every knob set
    python bench/sampler_bench.py --batch 1 32 --vocab 129280 --iters 200
    python bench/sampler_bench.py --tune                 # the draw kernel alone: tile / warps / split search

Each row: microseconds per call (graph replay, warm) with the reference, with the kernel, and
their ratio. The greedy row is the argmax alone; the others draw with seeded Gumbel noise.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernel_cases import time_replay  # noqa: E402
from dsv4 import ops  # noqa: E402
from dsv4.engine.sampling import SamplingParams, SlotSampling  # noqa: E402

KNOBS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.7": dict(temperature=0.7),
    "top-k 50": dict(temperature=0.7, top_k=50),
    "top-p 0.95": dict(temperature=0.7, top_p=0.95),
    "min-p 0.05": dict(temperature=0.7, min_p=0.05),
}


def tune(batches: list[int], V: int, iters: int) -> None:
    """The draw kernel alone (fp32 logits) for each (BLOCK, warps, programs per SM), greedy and drawing,
    against ``torch.argmax`` and the reference draw; the rule in use first."""
    from dsv4.ops.reference import draw_tokens as ref_draw
    from dsv4.ops.triton import sampling as K
    dev = torch.device("cuda")
    rule = K._config
    variants = [None] + [(b, w, p) for b in (1024, 2048, 4096) for w in (4, 8) for p in (1, 2, 4, 8)]
    print(f"draw kernel alone, V = {V}, CUDA graph replay (us); variant = BLOCK/warps/programs per SM")
    for B in batches:
        logits = torch.randn(B, V, device=dev)
        rows = (torch.full((B,), 0.7, device=dev), torch.zeros(B, dtype=torch.bool, device=dev),
                torch.arange(B, device=dev), torch.zeros(B, dtype=torch.int64, device=dev),
                torch.zeros(B, dtype=torch.int64, device=dev))
        base = {"argmax": time_replay(lambda: logits.argmax(-1), iters),
                "reference draw": time_replay(lambda: ref_draw(logits, None, *rows), iters)}
        print(f"batch {B}: " + ", ".join(f"{k} {v * 1e6:.1f}" for k, v in base.items()))
        for var in variants:
            if var is not None:
                b, w, p = var
                K._config = lambda B_, V_, sms, b=b, w=w, p=p: (b, w, max(1, min(-(-V_ // b), -(-p * sms // B_))))
            try:
                t = {how: time_replay(lambda: K.draw_tokens_triton(logits, None, *rows, sampling=how), iters)
                     for how in (False, True)}
            finally:
                K._config = rule
            name = "rule" if var is None else "/".join(map(str, var))
            print(f"  {name:>10}: greedy {t[False] * 1e6:7.1f}  draw {t[True] * 1e6:7.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--knobs", nargs="+", default=list(KNOBS), choices=list(KNOBS))
    ap.add_argument("--tune", action="store_true", help="the draw kernel alone, tile / warps / split variants")
    args = ap.parse_args()
    if args.tune:
        return tune(args.batch, args.vocab, args.iters)
    dev = torch.device("cuda")
    print(f"sampler per decode step, V = {args.vocab}, CUDA graph replay, {torch.cuda.get_device_name()}")
    print(f"{'knobs':>16} {'batch':>5} {'reference':>12} {'kernel':>12} {'ratio':>7}")
    for name in args.knobs:
        for B in args.batch:
            ss = SlotSampling(B + 1, args.vocab, dev)
            for slot in range(B):
                ss.assign(slot, SamplingParams(seed=slot, **KNOBS[name]), [1, 2, 3])
            idx = torch.arange(B, device=dev)
            flags = ss.flags(range(B))
            logits = torch.randn(B, args.vocab, device=dev).to(torch.bfloat16)
            times = {}
            for how in ("reference", "kernel"):
                scope = ops.reference_only() if how == "reference" else contextlib.nullcontext()
                with scope:
                    ops.has_kernel("draw_tokens", dev)     # registers the kernels before the capture
                    times[how] = time_replay(lambda: ss.sample(logits, idx, flags), args.iters)
            print(f"{name:>16} {B:5d} {times['reference'] * 1e6:10.1f}us {times['kernel'] * 1e6:10.1f}us "
                  f"{times['reference'] / times['kernel']:6.1f}x", flush=True)


if __name__ == "__main__":
    main()
