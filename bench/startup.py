"""Start-up time of a random-weights slice, by phase, as ``LLM`` / ``dsv4 serve`` start it:

    python bench/startup.py [--preset flash --layers 4 --format fp8-mxfp4] [--no-precompile]
                            [--max-num-seqs 16 --max-model-len 8192]

Phases: building the model (random weights, in place of loading), the parallel compile pass
(:meth:`Runner.precompile`; left out with ``--no-precompile``, the serial start-up before it),
the CUDA-graph capture, the warm-up, and the first answer (a 512-token prompt, 8 tokens). Run it
with a fresh ``TRITON_CACHE_DIR`` for a cold start (every kernel compiled), again for a warm one.
"""

from __future__ import annotations

import argparse
import os
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
from dsv4.random_weights import build_random_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--no-precompile", action="store_true")
    args = ap.parse_args()
    times = {}
    t = time.perf_counter()
    model = build_random_model(preset(args.preset, num_layers=args.layers), args.format, "cuda")
    runner = Runner(model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    qat_sim=args.format != "bf16")
    torch.cuda.synchronize()
    times["model"] = time.perf_counter() - t
    phases = [("capture", lambda: runner.capture()), ("warm-up", lambda: runner.warm_up())]
    if not args.no_precompile:
        phases.insert(0, ("precompile", lambda: runner.precompile()))
    for name, fn in phases:
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times[name] = time.perf_counter() - t
    engine = Engine(runner, None, eos_id=1)
    prompt = torch.randint(2, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    t = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), detokenize=False)
    while engine.has_unfinished:
        engine.step()
    times["first answer"] = time.perf_counter() - t
    total = sum(times.values())
    print(f"{args.preset} x{args.layers} {args.format} on {torch.cuda.get_device_name()}, "
          f"{os.cpu_count()} CPUs, TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR', '(default)')}, "
          f"{compiled_variants()} kernel variants")
    print(" | ".join(f"{k} {v:.1f} s" for k, v in times.items()) + f" | total {total:.1f} s")


if __name__ == "__main__":
    main()
