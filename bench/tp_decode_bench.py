"""Decode and prefill vs. the HBM bytes floor, on random weights with a real geometry, 1..N GPUs.

    python bench/tp_decode_bench.py --preset flash --layers 2 --batch 1 8 --steps 20 [--device cuda]
    torchrun --nproc-per-node 8 bench/tp_decode_bench.py --preset pro --layers 0 --weights release \\
        --batch 1 8 32 --context 8192 65536 --prefill-tokens 32768 --comm-share --json $OUT/pro.jsonl

Per (context, batch) it prints ms per step and tokens/s (decode steps replayed from a CUDA graph
captured on every rank, ``--no-graphs`` for eager), the bytes floor and the share of it reached,
the memory per GPU and the longest context that would still fit, and with ``--comm-share`` the
share of the step spent in collectives. ``--prefill-tokens N`` adds one N-token prefill on one slot.

- **Bytes floor**: the time to read, once per step, what a decode step must touch on the busiest
  GPU: its dense weights, the routed experts the batch is expected to select among the ones it holds
  (``E_local * (1 - (1 - 1/E)^(B*k))``), the embedding rows of the batch, and the state a step reads
  at that context (every sliding-window row, every indexer key and HCA entry, top-k CSA entries).
  The bandwidth is a device-to-device copy measured in this run on each GPU (``--peak-gbs`` gives a
  nominal figure instead).
- **Collective share** (``--comm-share``): the same step measured again with the device
  collectives replaced by local no-ops of the same shapes (on every rank, graphs re-captured):
  ``1 - t_without / t_with``. It counts the wait for the slowest rank too, which is part of what the
  collectives cost.
- **Longest context**: ``(GPU memory - peak use other than the state) / state bytes per position``
  at that batch.

Tensor parallel (``--tensor-parallel-size N``, launched by ``torchrun --nproc-per-node N``): each
rank builds its shard directly on its GPU (:func:`dsv4.random_weights.random_sharded`: no checkpoint on
disk); rank 0 drives the steps and prints, the other ranks follow its step plan. ``--weights
release`` is DeepSeek's layout (FP8-block attention and shared expert, MXFP4 routed experts, QAT
simulation on); ``bf16`` keeps every weight BF16. The context is set without running the prompt
(the state stays zero: decode reads the same bytes), so 64k at batch 32 costs no prefill time.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from dsv4.config import preset
from dsv4.engine.distributed import ParallelRunner, follow
from dsv4.engine.limits import state_bytes
from dsv4.engine.runner import Runner
from dsv4.engine.sampling import SampleFlags
from dsv4.random_weights import random_sharded
from dsv4.model.transformer import Transformer
from dsv4.parallel import ParallelGroup, init_parallel
from dsv4.testing import prefill

GREEDY = (SampleFlags(),)


def weight_read_bytes(model: Transformer, batch: int) -> float:
    """Weight bytes one decode step of ``batch`` rows reads on this rank."""
    c = model.config
    n_local = model.layers[0].ffn.experts.w1.experts
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
    return total


def state_read_bytes(runner: Runner, context: int, batch: int) -> float:
    """State bytes a decode step at ``context`` reads for ``batch`` slots: every ring row, every
    indexer key and HCA entry, the top-k CSA entries (plus the small open-window buffers)."""
    c = runner.model.config
    total = 0.0
    for i, layer in enumerate(runner.state.layers):
        total += layer.ring.nbytes_per_row() * layer.ring.rows
        for comp, is_kv in ((layer.compressor, True), (layer.indexer, False)):
            if comp is None:
                continue
            entries = context // comp.ratio
            if is_kv and layer.indexer is not None:     # CSA: attention reads only the selected entries
                entries = min(entries, c.index_topk)
            total += comp.entries.nbytes_per_row() * entries
            total += sum(t[0].numel() * t.element_size() for t in comp.tensors()[len(comp.entries.tensors()):])
    return total * batch


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
    del x, y
    return 2 * 10 * (1 << 30) / (time.perf_counter() - t0) / 1e9


class CollectivesOff:
    """Replace this rank's device collectives by local no-ops of the same shapes (every rank must
    do the same, between the same plans): the step without communication, for the collective share."""

    def __init__(self, tp: ParallelGroup):
        self.tp = tp

    def __enter__(self):
        n = self.tp.world_size
        self.tp.all_reduce_sum = lambda x: x
        self.tp.broadcast = lambda x, src=0: x
        self.tp.all_gather = lambda x, dim=-1: torch.cat([x] * n, dim=dim)
        return self

    def __exit__(self, *exc):
        for name in ("all_reduce_sum", "broadcast", "all_gather"):
            self.tp.__dict__.pop(name, None)


def timed_decode(tp: ParallelGroup, runner: Runner, batch: int, context: int, steps: int, graphs: bool) -> float | None:
    """Seconds per decode step of ``batch`` slots at ``context`` (rank 0; None on the others)."""
    runner.lengths[:] = [context] * batch
    runner.state.positions.fill_(context)
    if tp.rank != 0:
        follow(runner, tp)
        return None
    cuda = tp.device.type == "cuda"
    slots = list(range(batch))
    with ParallelRunner(runner, tp) as r:
        if graphs:
            r.capture(GREEDY, buckets=[batch], progress=False)
        r.decode_step(slots)                       # warm-up (and the first replay)
        if cuda:
            torch.cuda.synchronize(tp.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            r.decode_step(slots)
        if cuda:
            torch.cuda.synchronize(tp.device)
        return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=2, help="layers (0: the preset's full depth)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, nargs="+", default=[1024], help="context lengths to decode at")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prefill-tokens", type=int, default=0, help="also time one prefill of this many tokens")
    ap.add_argument("--prefill-chunk", type=int, default=4096)
    ap.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                    help="replay decode steps from CUDA graphs (default: on CUDA)")
    ap.add_argument("--comm-share", action="store_true", help="measure the share of the step in collectives")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "release"],
                    help="bf16 everywhere, or the release layout (FP8-block + MXFP4 experts, QAT simulation on)")
    ap.add_argument("--tensor-parallel-size", type=int, default=int(os.environ.get("WORLD_SIZE", 1)),
                    help="ranks (launch with torchrun --nproc-per-node N)")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="bandwidth per GPU for the floor, GB/s (default: a copy measured in this run)")
    ap.add_argument("--json", default=None, help="append one JSON object per measurement to this file")
    args = ap.parse_args()

    tp = init_parallel(args.tensor_parallel_size, device=args.device if args.device == "cpu" else None)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    config = preset(args.preset, num_layers=args.layers or None)
    release = args.weights == "release"
    cuda = tp.device.type == "cuda"
    graphs = cuda if args.graphs is None else args.graphs
    sync = (lambda: torch.cuda.synchronize(tp.device)) if cuda else (lambda: None)
    say = print if tp.rank == 0 else (lambda *a, **k: None)

    def record(**row) -> None:
        if tp.rank == 0 and args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(dict(preset=args.preset, layers=config.num_hidden_layers, weights=args.weights,
                                        tp=tp.world_size, graphs=graphs, **row)) + "\n")

    t0 = time.perf_counter()
    model = random_sharded(config, dtype, tp.device, tp, experts="mxfp4" if release else "bf16",
                           dense="fp8" if release else "bf16")
    sync()
    build_s = time.perf_counter() - t0
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    gbs = args.peak_gbs or copy_gbs(tp.device)
    total_mem = torch.cuda.get_device_properties(tp.device).total_memory if cuda else float("nan")
    say(f"{args.preset} x{config.num_hidden_layers} layers, {args.weights} weights, {args.dtype}, "
        f"TP={tp.world_size}, {tp.device}" + (f" ({torch.cuda.get_device_name(tp.device)})" if cuda else "")
        + f", graphs {'on' if graphs else 'off'}; built in {build_s:.1f} s; weights {weights / 2**30:.1f} GiB/GPU; "
        f"copy bandwidth {gbs:.0f} GB/s per GPU", flush=True)

    for context in args.context:
        for batch in args.batch:
            max_context = context + args.steps + 8
            need = state_bytes(config, batch + 1, max_context, dtype, release)
            free = torch.cuda.mem_get_info(tp.device)[0] if cuda else 1 << 62
            fits = all(tp.all_gather_object(need + (4 << 30) < free))
            if not fits:
                say(f"batch {batch:>3}, context {context}: state {need / 2**30:.1f} GiB does not fit "
                    f"({free / 2**30:.1f} GiB free on rank 0); skipped", flush=True)
                record(kind="decode", batch=batch, context=context, skipped="state does not fit")
                continue
            if cuda:
                torch.cuda.reset_peak_memory_stats(tp.device)
            runner = Runner(model, max_num_seqs=batch, max_model_len=max_context, qat_sim=release)
            step = timed_decode(tp, runner, batch, context, args.steps, graphs)
            peak = torch.cuda.max_memory_allocated(tp.device) if cuda else 0
            per_pos = (state_bytes(config, batch + 1, 2 * max_context, dtype, release) - need) / max_context
            longest = int((total_mem - (peak - need)) / per_pos) if cuda else 0
            floor_bytes = weight_read_bytes(model, batch) + state_read_bytes(runner, context, batch)
            bare = None
            if args.comm_share and tp.world_size > 1:
                runner.graphs.clear()
                runner.graph_pool = None
                with CollectivesOff(tp):
                    bare = timed_decode(tp, runner, batch, context, args.steps, graphs)
            notes = tp.all_gather_object((floor_bytes, peak, longest))
            del runner
            if cuda:
                torch.cuda.empty_cache()
            if tp.rank == 0:
                busiest = max(b for b, _, _ in notes)
                floor = busiest / (gbs * 1e9)
                mems = [p / 2**30 for _, p, _ in notes]
                fit = min(x for _, _, x in notes)
                share = None if bare is None else max(0.0, 1 - bare / step)
                say(f"batch {batch:>3}, context {context:>6}: {step * 1e3:8.2f} ms/step, {batch / step:8.1f} tok/s; "
                    f"bytes floor {floor * 1e3:6.3f} ms ({busiest / 2**30:.2f} GiB/GPU), floor/step {floor / step:.3f}; "
                    f"peak memory/GPU {min(mems):.1f}-{max(mems):.1f} GiB; longest context at this batch ~{fit:,}"
                    + ("" if share is None else f"; collectives {share:.0%} of the step ({bare * 1e3:.2f} ms without)"),
                    flush=True)
                record(kind="decode", batch=batch, context=context, ms_per_step=step * 1e3, tok_s=batch / step,
                       floor_ms=floor * 1e3, floor_over_step=floor / step, floor_gib_per_gpu=busiest / 2**30,
                       peak_gib_per_gpu=mems, longest_context=fit, ms_without_collectives=None if bare is None
                       else bare * 1e3, collective_share=share, copy_gbs=gbs)

    if args.prefill_tokens:
        n = args.prefill_tokens
        runner = Runner(model, max_num_seqs=1, max_model_len=n + 8, qat_sim=release, max_num_batched_tokens=args.prefill_chunk)
        if tp.rank != 0:
            follow(runner, tp)
        else:
            ids = torch.randint(2, config.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
            with ParallelRunner(runner, tp) as r:
                prefill(r, 0, ids[: args.prefill_chunk])     # warm-up: compile every prefill kernel once
                sync()
                t0 = time.perf_counter()
                prefill(r, 0, ids, new=True)                 # the slot emptied on every rank first
                sync()
                took = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(tp.device) / 2**30 if cuda else float("nan")
            say(f"prefill {n} tokens (chunks of {args.prefill_chunk}): {took:.2f} s, {n / took:,.0f} tok/s; "
                f"peak memory rank 0 {peak:.1f} GiB", flush=True)
            record(kind="prefill", tokens=n, chunk=args.prefill_chunk, seconds=took, tok_s=n / took)
        del runner
    tp.close()


if __name__ == "__main__":
    main()
