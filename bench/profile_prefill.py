"""Where a prompt's prefill time goes: host time, device time and kernels per prompt length.

    python bench/profile_prefill.py [--layers 4] [--format fp8-mxfp4] [--lengths 16 64 128 256 512]

One eager B=1 prefill (the step the scheduler runs for a whole prompt: a new sequence, its first
token sampled) on an empty slot, per length:
the wall time (synchronized), the host time of the call (the time Python spends launching; when
it is close to the wall time the prefill is launch-bound, not GPU-bound), the GPU kernel time
and kernel count from the profiler, and the host-device synchronizations counted by
``torch.cuda.set_sync_debug_mode``. Kernels are compiled first (untimed).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


@contextlib.contextmanager
def _sync_debug():
    """Every implicit host-device synchronization inside warns (``torch.cuda`` sync debug mode)."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _gaps(kernels: list, wall: float, top: int = 5) -> None:
    """Where the GPU idles inside one prefill: the kernels' span against the wall time, the idle time
    between kernels inside the span and its largest gaps (with the kernels on either side): what a
    launch-bound stretch, a host sync or a slow host step between kernels costs."""
    ks = sorted(kernels, key=lambda e: e.time_range.start)
    if not ks:
        return
    span = (ks[-1].time_range.end - ks[0].time_range.start) / 1e6
    busy = sum(e.device_time for e in ks) / 1e6
    gaps = sorted(((b.time_range.start - a.time_range.end) / 1e3, a.name[:40], b.name[:40])
                  for a, b in zip(ks, ks[1:]))[::-1]
    print(f"    GPU: kernels span {span * 1e3:.2f} ms of the {wall * 1e3:.2f} ms wall, idle {(span - busy) * 1e3:.2f} ms "
          f"inside it; largest gaps: " + "; ".join(f"{g:.2f} ms {a} -> {b}" for g, a, b in gaps[:top]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 128, 256, 512])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--ops", action="store_true",
                    help="also the torch ops of the last length by their kernels' time, with input shapes "
                         "(which op launched an unnamed elementwise kernel)")
    ap.add_argument("--cprofile", type=int, nargs="*", default=[16, 128],
                    help="prompt lengths whose prefill's host time is broken down by cProfile")
    args = ap.parse_args()
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, "cuda")
    runner = Runner(model, max_num_seqs=1, max_model_len=max(args.lengths) + 64, qat_sim=args.format != "bf16")
    params = SamplingParams(max_tokens=1)
    g = torch.Generator().manual_seed(0)

    def once(n: int, around=contextlib.nullcontext) -> tuple[float, float]:
        """One prefill of ``n`` random tokens, the call alone inside ``around()``: (host, wall) s."""
        ids = tuple(torch.randint(2, config.vocab_size, (n,), generator=g).tolist())
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with around():
            # the row a step runs for a whole prompt: the slot emptied, the first token sampled
            runner.run(ScheduledBatch((Row(0, 0, ids, new=NewSequence(params, ids)),)))
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return t1 - t0, time.perf_counter() - t0

    print(f"{args.preset} x{args.layers} {args.format}: one eager B=1 prefill on an empty slot")
    for n in args.lengths:
        for _ in range(2):
            once(n)                                     # compile, allocator warm
        times = [once(n) for _ in range(args.reps)]
        host = statistics.median(t[0] for t in times)
        wall = statistics.median(t[1] for t in times)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            once(n, around=_sync_debug)
        synced = [w for w in caught if "synchronizing" in str(w.message)]
        sync_at = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in synced})
        syncs = len(synced)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     record_shapes=args.ops and n == args.lengths[-1]) as prof:
            once(n)
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        ktime = sum(e.device_time for e in kernels) / 1e6
        print(f"prefill {n:5d} tokens: wall {wall * 1e3:7.2f} ms | host {host * 1e3:7.2f} ms "
              f"({100 * host / wall:3.0f}% of wall) | kernels {ktime * 1e3:7.2f} ms ({len(kernels)} launches, "
              f"{len(kernels) / args.layers:.0f} per layer) | {syncs} host syncs | {n / wall:8.0f} tok/s", flush=True)
        if sync_at:
            print(f"    syncs at {', '.join(sync_at)}")
        _gaps(kernels, wall)
        if args.ops and n == args.lengths[-1]:
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_device_time_total",
                                                                      row_limit=args.top * 2, max_name_column_width=40,
                                                                      max_shapes_column_width=70))
        if n == args.lengths[-1] or n == 128:
            by_name: dict[str, list[float]] = {}
            for e in kernels:
                by_name.setdefault(e.name[:80], []).append(e.device_time)
            for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
                print(f"    {sum(ts) / 1e3:8.3f} ms  x{len(ts):<4} {name}")

    import cProfile
    import pstats
    for n in args.cprofile:
        once(n)
        prof = cProfile.Profile()
        once(n, around=lambda: prof)
        print(f"host profile of one {n}-token prefill (cProfile; its own overhead inflates the totals):")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
