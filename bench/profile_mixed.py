"""Where a mixed step's time goes: running decodes plus one prompt chunk, host vs device.

    python bench/profile_mixed.py [--layers 4] [--format fp8-mxfp4] [--decode 15] [--lengths 64 512 2048]

The step continuous batching runs whenever a request is admitted while others decode: ``--decode``
slots each feed their last token (at ``--context`` tokens of history) and one new slot feeds a
prompt chunk of L tokens, all in one :meth:`Runner.run`. Per L: the wall time (synchronized), the
host time of the call (Python launching; close to the wall time means the step is launch-bound,
not GPU-bound), the kernel time and count from the profiler, next to a decode-only step of the
same slots through the captured graph (what the step would cost without the chunk). Then a
cProfile of the host time of one mixed step (``--cprofile``), by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--decode", type=int, default=15, help="decode rows in the step")
    ap.add_argument("--context", type=int, default=1024, help="each decode row's history")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--cprofile", type=int, nargs="*", default=[512],
                    help="chunk lengths whose mixed step's host time is broken down by cProfile")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, args.device)
    n_dec = args.decode
    runner = Runner(model, max_num_seqs=n_dec + 1, max_model_len=args.context + max(args.lengths) + 64,
                    qat_sim=args.format != "bf16", max_num_batched_tokens=n_dec + max(args.lengths))
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20)
    dec_slots = list(range(n_dec))
    new_slot = n_dec

    def rand(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(2, config.vocab_size, (n,), generator=g).tolist())

    # the decoding slots: a prompt of ``context`` tokens each, in one step
    rows = tuple(Row(s, 0, rand(args.context), new=NewSequence(params, ())) for s in dec_slots)
    for lo in range(0, n_dec, 4):
        runner.run(ScheduledBatch(rows[lo:lo + 4]))
    if cuda:
        runner.capture(progress=False)          # every bucket up to max_num_seqs: the decode rows' is there

    def decode_rows() -> list[Row]:
        return [Row(s, runner.lengths[s]) for s in dec_slots]

    def mixed(n: int) -> ScheduledBatch:
        chunk = Row(new_slot, 0, rand(n), new=NewSequence(params, ()))
        return ScheduledBatch(tuple(decode_rows()) + (chunk,))

    def timed(batch_fn, around=None) -> tuple[float, float]:
        batch = batch_fn()
        if max(runner.lengths[s] for s in dec_slots) + 2 >= runner.max_model_len - max(args.lengths):
            runner.reset(dec_slots)        # never runs in the default sizes; keeps long runs in bounds
        sync()
        t0 = time.perf_counter()
        if around is not None:
            around.enable()
        runner.run(batch)
        if around is not None:
            around.disable()
        t1 = time.perf_counter()
        sync()
        return t1 - t0, time.perf_counter() - t0

    def kernels(batch_fn) -> tuple[float, int, list]:
        if not cuda:
            return 0.0, 0, []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            timed(batch_fn)
        ks = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return sum(e.device_time for e in ks) / 1e6, len(ks), ks

    dec_batch = lambda: ScheduledBatch(tuple(decode_rows()))  # noqa: E731
    for _ in range(3):
        timed(dec_batch)
    dt = [timed(dec_batch) for _ in range(args.reps)]
    dk, dn, _ = kernels(dec_batch)
    print(f"{args.preset} x{args.layers} {args.format}: {n_dec} decode rows at ~{args.context} tokens "
          f"+ one prompt chunk, one Runner.run")
    print(f"decode only (graph):   wall {statistics.median(t[1] for t in dt) * 1e3:7.2f} ms | host "
          f"{statistics.median(t[0] for t in dt) * 1e3:7.2f} ms | kernels {dk * 1e3:7.2f} ms ({dn} launches)")
    for n in args.lengths:
        for _ in range(2):
            timed(lambda: mixed(n))                  # compile, allocator warm
        ts = [timed(lambda: mixed(n)) for _ in range(args.reps)]
        host, wall = statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)
        kt, kn, ks = kernels(lambda: mixed(n))
        print(f"mixed, chunk {n:5d}:     wall {wall * 1e3:7.2f} ms | host {host * 1e3:7.2f} ms "
              f"({100 * host / wall:3.0f}% of wall) | kernels {kt * 1e3:7.2f} ms ({kn} launches, "
              f"{kn / args.layers:.0f} per layer) | GPU idle {max(0.0, wall - kt) * 1e3:6.2f} ms", flush=True)
        by_name: dict[str, list[float]] = {}
        for e in ks:
            by_name.setdefault(e.name[:70], []).append(e.device_time)
        for name, t in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
            print(f"    {sum(t) / 1e3:8.3f} ms  x{len(t):<4} {name}")
    for n in args.cprofile:
        prof = cProfile.Profile()
        timed(lambda: mixed(n), around=prof)
        print(f"host profile of one mixed step with a {n}-token chunk (cProfile; its overhead inflates totals):")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
