"""Decode throughput vs. the HBM roofline, on random weights with a real geometry.

    python bench/decode_bench.py --preset flash --layers 2 --batch 1 8 --steps 20 [--device cuda]

Per batch size it prints tokens/s and the ratio of achieved to roofline step time, where the
roofline is the time to read, once per step, the bytes a decode step must touch: every dense
weight, the routed experts the batch selects (at most ``min(E, B*k)`` per layer, counted as
``min(E, B*k)/E`` of the expert bytes) and the generation state it reads. Measured in one run on
one device; the peak bandwidth is the device's nominal one (``--peak-gbs``, H100 SXM 3350).
"""

from __future__ import annotations

import argparse
import time

import torch

from dsv4.config import preset
from dsv4.engine.runner import Runner
from dsv4.model.transformer import Transformer


@torch.no_grad()
def random_init_(model: torch.nn.Module, seed: int = 0) -> None:
    """Fast on-device random weights (scale 1/sqrt(in) for matrices, ~1 for norms)."""
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            p.normal_(0, p.shape[1] ** -0.5, generator=g)
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0, 0.1, generator=g)
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):
            b.random_(0, model.config.n_routed_experts, generator=g)


def step_bytes(model: Transformer, batch: int, runner: Runner) -> float:
    c = model.config
    expert_frac = min(c.n_routed_experts, batch * c.num_experts_per_tok) / c.n_routed_experts
    total = 0.0
    for name, p in model.named_parameters():
        if name == "embed.weight":
            total += batch * p.shape[1] * p.element_size()
        elif ".experts." in name:
            total += expert_frac * p.numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total + runner.state.nbytes() * batch / runner.max_slots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024, help="prompt length before decoding")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--peak-gbs", type=float, default=3350.0, help="nominal HBM bandwidth, GB/s")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = preset(args.preset, num_layers=args.layers)
    with torch.device(args.device):
        model = Transformer(config, dtype, with_mtp=False)
    random_init_(model)
    model.init_rope(args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    print(f"{args.preset} x{args.layers} layers, {args.dtype}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else ""))
    for batch in args.batch:
        runner = Runner(model, max_slots=batch, max_context=args.context + args.steps + 8)
        for s in range(batch):
            runner.prefill(s, torch.randint(2, config.vocab_size, (args.context,)).tolist())
        ids = torch.randint(2, config.vocab_size, (batch,), device=args.device)
        runner.decode(list(range(batch)), ids)  # warm-up
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            runner.decode(list(range(batch)), ids)
        sync()
        step = (time.perf_counter() - t0) / args.steps
        roofline = step_bytes(model, batch, runner) / (args.peak_gbs * 1e9)
        print(f"batch {batch:>3}: {step * 1e3:8.2f} ms/step, {batch / step:8.1f} tok/s, "
              f"roofline {roofline * 1e3:7.3f} ms/step, achieved/roofline = {roofline / step:.3f}")


if __name__ == "__main__":
    main()
