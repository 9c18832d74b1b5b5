"""Where a decode step's time goes: CUDA kernels per step and the top kernels by GPU time.

    python bench/profile_decode.py [--layers 4] [--format fp8-mxfp4] [--batch 1] [--ops reference|kernels]

The kernels of a layer (each layer kind) and of the rest of the step (embedding, context, head,
sampler) are counted apart, on one eager step whose launches :mod:`bench.count_launches` attributes
to the layer regions on the host; the profiled step's kernel count is the device's own.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_bench import fill_state  # noqa: E402
from dsv4 import ops  # noqa: E402
from dsv4.config import preset  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--ops", default="reference", choices=["reference", "kernels"])
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--graph", action="store_true", help="replay the step as one CUDA graph")
    args = ap.parse_args()
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, "cuda")
    runner = Runner(model, max_num_seqs=args.batch, max_model_len=args.context + 64, qat_sim=args.format != "bf16")
    fill_state(runner, args.context)
    runner.tokens.random_(2, config.vocab_size)
    slots = list(range(args.batch))
    ctx = ops.reference_only() if args.ops == "reference" else torch.no_grad()
    with ctx:
        if args.graph:
            runner.capture(max_batch=args.batch, progress=False)
        for _ in range(3):
            runner.decode_step(slots)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            runner.decode_step(slots)
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            runner.decode_step(slots)
        end.record()
        torch.cuda.synchronize()
        wall = start.elapsed_time(end) / reps * 1e3   # us per step
        per_layer, outside = launches_by_layer(runner, slots)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    mode = "graph replay" if args.graph else "eager"
    print(f"{args.preset} x{args.layers} {args.format} batch {args.batch} ({args.ops} ops, {mode}): {len(kernels)} CUDA "
          f"kernels, {total / 1e3:.2f} ms of kernel time per step; step {wall / 1e3:.2f} ms, "
          f"{100 * max(0.0, wall - total) / wall:.1f}% of it outside kernels ({(wall - total) / 1e3:.2f} ms)")
    print("kernel launches a layer (an eager step, counted on the host): "
          + ", ".join(f"{kind} {n:.0f}" for kind, n in per_layer.items()) + f"; outside the layers {outside:.0f}")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    rows = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]
    for name, times in rows:
        print(f"  {sum(times) / 1e3:8.3f} ms {100 * sum(times) / total:5.1f}%  x{len(times):<5} {name}")


def launches_by_layer(runner: Runner, slots: list[int]) -> tuple[dict[str, float], float]:
    """``({layer kind: launches a layer}, launches outside the layers)`` of one eager decode step
    (what the graph captures): :mod:`bench.count_launches`' regions and count, each Triton launch
    included. Wraps the model's methods for good: call it last."""
    from bench import count_launches
    from dsv4.engine.h2d import upload_ints
    count_launches._hooks()
    count_launches.hook_gpu_triton()
    idx = upload_ints(slots, runner.device)
    bound = runner.max_model_len
    flags = runner.sampling.flags(slots)
    runner._step(idx, flags, bound)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner._step(idx, flags, bound)
    layers, state, rest = count_launches.count(prof)
    return {k: sum(v.values()) for k, v in layers.items()}, sum(rest.values())


if __name__ == "__main__":
    main()
