"""Decode throughput vs. the HBM bytes floor, on random weights with a real geometry.

    python bench/tp_decode_bench.py --preset flash --layers 2 --batch 1 8 --steps 20 [--device cuda]
    torchrun --nproc-per-node 2 bench/tp_decode_bench.py --preset flash --weights release \\
        --tensor-parallel-size 2 --batch 1 8 32 --context 8192 --skip-prefill

Per batch size it prints tokens/s, ms per step and the ratio of the bytes floor to the step time,
where the floor is the time to read, once per step, the bytes a decode step must touch on the
busiest GPU: its dense weights, the routed experts the batch is expected to select among the ones
it holds, and the generation state it reads. The bandwidth is a device-to-device copy measured in
the same run on each GPU (``--peak-gbs`` overrides it with a nominal figure).

Tensor parallel (``--tensor-parallel-size N``, launched by ``torchrun --nproc-per-node N``): each
rank builds its shard of the network directly on its GPU (:func:`dsv4.model.init.random_sharded`:
no checkpoint on disk); rank 0 drives the steps and prints, the other ranks follow its step plan.
``--weights release`` is DeepSeek's layout (FP8-block attention and shared expert, MXFP4 routed
experts, QAT simulation on); ``bf16`` keeps every weight BF16. ``--skip-prefill`` sets each slot's
context length without running the prompt (the state stays zero: decode reads the same bytes), so an
8k context at batch 32 costs no prefill time.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dsv4.config import preset
from dsv4.engine.distributed import ParallelRunner, follow
from dsv4.engine.runner import Runner
from dsv4.model.init import random_sharded
from dsv4.model.transformer import Transformer
from dsv4.parallel import init_parallel


def step_bytes(model: Transformer, batch: int, runner: Runner) -> float:
    """Bytes one decode step of ``batch`` rows reads on this rank."""
    c = model.config
    n_local = model.layers[0].ffn.experts.w1.experts
    # expected distinct experts of this rank among B*k picks spread over all E experts
    picked = n_local * (1 - (1 - 1 / c.n_routed_experts) ** (batch * c.num_experts_per_tok))
    total = 0.0
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "inv_freq" not in n]
    for name, p in tensors:
        size = p.numel() * p.element_size()
        if name == "embed.weight" or name.endswith("tid2eid"):
            total += min(batch, p.shape[0]) * size / p.shape[0]
        elif ".experts." in name:
            total += size * picked / n_local
        else:
            total += size
    return total + runner.state.nbytes() * batch / runner.max_slots


def copy_gbs(device: torch.device) -> float:
    """Device-to-device copy bandwidth, GB/s, counting bytes read and written."""
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize(device)
    return 2 * 10 * x.numel() / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=2, help="layers (0: the preset's full depth)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024, help="prompt length before decoding")
    ap.add_argument("--skip-prefill", action="store_true", help="set the context length without running it")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "release"],
                    help="bf16 everywhere, or the release layout (FP8-block + MXFP4 experts, QAT simulation on)")
    ap.add_argument("--tensor-parallel-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                    help="ranks (launch with torchrun --nproc-per-node N)")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="bandwidth per GPU for the floor, GB/s (default: a copy measured in this run)")
    args = ap.parse_args()

    tp = init_parallel(args.tensor_parallel_size, device=args.device if args.device == "cpu" else None)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = preset(args.preset, num_layers=args.layers or None)
    release = args.weights == "release"
    cuda = tp.device.type == "cuda"
    t0 = time.perf_counter()
    model = random_sharded(config, dtype, tp.device, tp, experts="mxfp4" if release else "bf16",
                           dense="fp8" if release else "bf16")
    if cuda:
        torch.cuda.synchronize(tp.device)
    build_s = time.perf_counter() - t0
    gbs = args.peak_gbs or copy_gbs(tp.device)
    say = print if tp.rank == 0 else (lambda *a, **k: None)
    say(f"{args.preset} x{config.num_hidden_layers} layers, {args.weights} weights, {args.dtype}, "
        f"TP={tp.world_size}, device {tp.device}" + (f" ({torch.cuda.get_device_name(tp.device)})" if cuda else "")
        + f"; built in {build_s:.1f} s; copy bandwidth {gbs:.0f} GB/s per GPU")
    sync = (lambda: torch.cuda.synchronize(tp.device)) if cuda else (lambda: None)
    for batch in args.batch:
        runner = Runner(model, max_slots=batch, max_context=args.context + args.steps + 8, qat_sim=release)
        if args.skip_prefill:   # every rank the same, before any step
            runner.lengths[:] = [args.context] * batch
            runner.state.positions.fill_(args.context)
        if tp.rank != 0:
            follow(runner, tp)
        else:
            with ParallelRunner(runner, tp) as r:
                if not args.skip_prefill:
                    for s in range(batch):
                        r.prefill(s, torch.randint(2, config.vocab_size, (args.context,)).tolist())
                ids = torch.randint(2, config.vocab_size, (batch,), device=tp.device)
                r.decode(list(range(batch)), ids)  # warm-up
                sync()
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    r.decode(list(range(batch)), ids)
                sync()
                step = (time.perf_counter() - t0) / args.steps
        mem = torch.cuda.max_memory_allocated(tp.device) / 2**30 if cuda else float("nan")
        floor_bytes = step_bytes(model, batch, runner)
        notes = tp.all_gather_object((floor_bytes, mem))
        if tp.rank == 0:
            floor = max(b for b, _ in notes) / (gbs * 1e9)
            mems = ", ".join(f"{m:.1f}" for _, m in notes)
            say(f"batch {batch:>3}, context {args.context}: {step * 1e3:8.2f} ms/step, {batch / step:8.1f} tok/s, "
                f"bytes floor {floor * 1e3:7.3f} ms/step ({max(b for b, _ in notes) / 2**30:.2f} GiB/GPU), "
                f"floor/step = {floor / step:.3f}; peak memory per GPU {mems} GiB")
        del runner
    tp.close()


if __name__ == "__main__":
    main()
