"""Prefix caching's cost and gain in one process, one model, one runner (no server):

    python bench/prefix_cost.py [--preset flash --layers 4 --format fp8-mxfp4]
                                [--lengths 1000 3000 8000] [--burst 16 --burst-len 2000]
                                [--turns 10 --system-len 4096 --turn-len 2560 --output-len 128]

1. **No hits** (issue 27: "no cost with no hits"): unique random prompts, caching truly off (no
   prefix cache at all) against on (every prompt saves its last boundaries, nothing ever hits).
   Each length alone (time to first token, median of ``--repeats``, off and on interleaved), then ``--burst`` prompts at once
   (wall time until all are done: prefill throughput), then ``--decode`` requests of 64-token prompts
   decoding ``--decode-len`` tokens together (output tok/s: the saves where decoding crosses a block
   boundary are the cost there).
2. **One conversation alone** (issue 27's TTFT target, a turn's own time to first token): ``--turns``
   turns; turn k's prompt is turn k-1's prompt, its greedy answer and a new message of
   ``--turn-len`` tokens after a ``--system-len`` system prompt. Off and on each build the
   conversation from their own answers (the same lengths). Printed per turn: prompt tokens, cached
   tokens, TTFT off / on and the ratio.

Both passes use one runner (the same state, graphs and compiled kernels); "off" runs an engine made
while the runner's prefix store is detached, so it plans no save and no restore.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.engine.warmup import compiled_variants  # noqa: E402


def engine_for(runner: Runner, caching: bool) -> Engine:
    store = runner.prefix_store
    if caching:
        return Engine(runner, None, eos_id=1)
    runner.prefix_store = None           # the engine plans no save / restore; the runner keeps its pages
    try:
        return Engine(runner, None, eos_id=1)
    finally:
        runner.prefix_store = store


def ttft(engine: Engine, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int], int]:
    """Time to the first token of ``prompt`` alone, its output ids and cached tokens (run to the end)."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             detokenize=False)
    first, out = None, None
    while engine.has_unfinished:
        for o in engine.step():
            if o.request_id == rid and o.new_token_ids and first is None:
                first = time.perf_counter() - t0
            if o.request_id == rid and o.finished:
                out = o.output
    return first, list(out.token_ids), out.num_cached_tokens


def burst(engine: Engine, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), detokenize=False)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - t0


def decode_rate(engine: Engine, prompts: list[list[int]], n: int) -> float:
    """Output tokens a second of ``prompts`` decoding ``n`` tokens each, all at once."""
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), detokenize=False)
    t0 = time.perf_counter()
    while engine.has_unfinished:
        engine.step()
    return len(prompts) * n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1000, 3000, 8000])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--burst-len", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--decode-len", type=int, default=512)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=4096)
    ap.add_argument("--turn-len", type=int, default=2560)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--prefix-cache-gib", type=float, default=4.0)
    args = ap.parse_args()

    from dsv4.random_weights import build_random_model
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, args.device)
    longest = max([*args.lengths, args.burst_len,
                   args.system_len + args.turns * (args.turn_len + args.output_len)]) + 256
    runner = Runner(model, max_num_seqs=args.max_num_seqs, max_model_len=longest, qat_sim=args.format != "bf16",
                    prefix_cache_bytes=int(args.prefix_cache_gib * 2**30))
    cuda = args.device.startswith("cuda")
    if cuda:
        runner.capture(progress=False)
        runner.warm_up(progress=False)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(2, config.vocab_size, (n,), generator=g).tolist()   # noqa: E731
    compiled = compiled_variants()
    print(f"{args.preset} x{args.layers} {args.format}, {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if cuda else ""), flush=True)

    # untimed: one prompt per length through each engine (first-use costs: graphs of new buckets, allocations)
    for caching in (False, True):
        e = engine_for(runner, caching)
        for n in args.lengths:
            ttft(e, ids(n))

    print("\n1. no hits: unique prompts, caching off vs on (nothing ever hits)")
    print(f"{'prompt tok':>10} {'TTFT off (ms)':>14} {'TTFT on (ms)':>13} {'on/off':>7}")
    engines = {c: engine_for(runner, c) for c in (False, True)}
    for n in args.lengths:
        times = {False: [], True: []}
        for _ in range(args.repeats):                 # interleaved, so drifts hit both alike
            for caching in (False, True):
                times[caching].append(ttft(engines[caching], ids(n))[0])
        res = {c: statistics.median(t) for c, t in times.items()}
        print(f"{n:>10} {res[False] * 1e3:>14.1f} {res[True] * 1e3:>13.1f} {res[True] / res[False]:>7.3f}", flush=True)
    if args.burst:
        res = {c: burst(engine_for(runner, c), [ids(args.burst_len) for _ in range(args.burst)]) for c in (False, True)}
        tok = args.burst * args.burst_len
        print(f"burst of {args.burst} x {args.burst_len} tokens: off {res[False]:.3f} s ({tok / res[False]:.0f} tok/s), "
              f"on {res[True]:.3f} s ({tok / res[True]:.0f} tok/s), on/off time {res[True] / res[False]:.3f}",
              flush=True)

    if args.decode:
        prompts = [ids(64) for _ in range(args.decode)]
        res = {c: decode_rate(engine_for(runner, c), prompts, args.decode_len) for c in (False, True)}
        print(f"decode, {args.decode} requests x {args.decode_len} tokens: off {res[False]:.0f} tok/s, "
              f"on {res[True]:.0f} tok/s, on/off {res[True] / res[False]:.3f}", flush=True)

    if args.turns:
        print(f"\n2. one conversation alone: system {args.system_len}, +{args.turn_len} a turn, "
              f"{args.output_len}-token answers")
        system = ids(args.system_len)
        messages = [ids(args.turn_len) for _ in range(args.turns)]
        rows = {}
        for caching in (False, True):
            e = engine_for(runner, caching)
            convo, rows[caching] = list(system), []
            for k in range(args.turns):
                convo += messages[k]
                t, out, cached = ttft(e, convo, args.output_len)
                rows[caching].append((len(convo), cached, t))
                convo += out
        print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'TTFT off (ms)':>14} {'TTFT on (ms)':>13} {'on/off':>7}")
        ratios = []
        for k, ((n, _, off), (_, cached, on)) in enumerate(zip(rows[False], rows[True])):
            ratios.append((n, on / off))
            print(f"{k + 1:>4} {n:>10} {cached:>10} {off * 1e3:>14.1f} {on * 1e3:>13.1f} {on / off:>7.3f}")
        past = [r for n, r in ratios if n > 8192]
        if past:
            print(f"turns past 8K tokens: on/off TTFT mean {statistics.fmean(past):.3f}, max {max(past):.3f}")
    late = compiled_variants() - compiled
    print(f"kernel variants compiled during the timed runs: {late}")


if __name__ == "__main__":
    main()
