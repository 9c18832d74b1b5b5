"""Decode step time against the bytes floor, with transformers' eager model as the peer, one run.

    python bench/decode_bench.py [--preset flash] [--layers 4] [--format bf16 fp8-mxfp4 fp8-nvfp4]
                                 [--batch 1 8 32] [--context 1024] [--ops reference kernels] [--no-hf]
                                 [--temperature 0.7 [--top-p 0.95] [--top-k 50]]   (default: greedy rows)

The default slice (the first 4 layers of V4-Flash) has every layer kind: sliding, CSA and HCA
attention, hash-routed and top-k MoE. Weights are random, made directly on the device in each
layout (``dsv4.random_weights``). The generation state is filled with random rows at
``--context`` positions (no prefill needed: a decode step's cost does not depend on the values).

Per batch size it prints ms per decode step (embedding, layers, head and sampler) for transformers'
eager ``DeepseekV4ForCausalLM`` on the same BF16 slice (prefilled with real tokens), for dsv4 with
the reference ops and with the registered kernels, eager or replayed as one CUDA graph, and the
bytes floor: every dense weight once, the routed experts a batch
selects (expected distinct experts of uniform routing), the embedding rows, and the state a step
reads (window ring, the CSA top-k entries and all indexer keys, the HCA entries), over the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4 import ops  # noqa: E402
from dsv4.config import ModelConfig, preset  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.model.cache import RowStore  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


DEVICE = "cuda"


def sync() -> None:
    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    n = 1 << (30 if DEVICE.startswith("cuda") else 26)
    a = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * n * 10 / (time.perf_counter() - t0)


def expected_distinct(n_experts: int, picks: int) -> float:
    """Expected number of distinct experts among ``picks`` uniform draws without replacement per
    token (approximated as independent): ``E (1 - (1 - 1/E)^picks)``."""
    return n_experts * (1 - (1 - 1 / n_experts) ** picks)


def weight_bytes(model: torch.nn.Module, batch: int) -> float:
    """Bytes of weights one decode step reads: every tensor once, the embedding's ``batch`` rows,
    and the expected share of routed experts (buffers of packed weights included)."""
    c = model.config
    share = expected_distinct(c.n_routed_experts, batch * c.num_experts_per_tok) / c.n_routed_experts
    total = 0.0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "inv_freq" in name or "tid2eid" in name:
            continue
        nbytes = t.numel() * t.element_size()
        if name == "embed.weight":
            nbytes = batch * t.shape[1] * t.element_size()
        elif ".experts." in name:
            nbytes *= share
        total += nbytes
    return total


def state_bytes(config: ModelConfig, qat_sim: bool, dtype: torch.dtype, context: int) -> float:
    """Bytes of generation state one decode step reads for one sequence at ``context`` positions."""
    kv = RowStore.allocate("fp8" if qat_sim else "plain", 1, 1, config.head_dim, dtype, "meta", config.rope_dim)
    keys = RowStore.allocate("fp4" if qat_sim else "plain", 1, 1, config.index_head_dim, dtype, "meta")
    total = 0.0
    for i in range(config.num_hidden_layers):
        kind, ratio = config.layer_kind(i), config.layer_ratio(i)
        total += config.sliding_window * kv.nbytes_per_row()
        if kind == "csa":
            n = context // ratio
            total += min(config.index_topk, n) * kv.nbytes_per_row() + n * keys.nbytes_per_row()
        elif kind == "hca":
            total += context // ratio * kv.nbytes_per_row()
    return total


@torch.no_grad()
def fill_state(runner: Runner, context: int, seed: int = 0) -> None:
    """Put every slot at position ``context`` with random cache rows (finite FP8/FP4 codes)."""
    g = torch.Generator(device=runner.device).manual_seed(seed)
    for layer in runner.state.layers:
        for t in layer.tensors():
            if t.dtype == torch.float8_e4m3fn:
                t.copy_(torch.randn(t.shape, device=t.device, generator=g))
            elif t.dtype == torch.uint8:   # e8m0 scales around 2^-4, or packed e2m1 codes
                t.copy_(torch.randint(118, 126, t.shape, device=t.device, generator=g).to(torch.uint8))
            elif t.is_floating_point():
                t.copy_(torch.randn(t.shape, device=t.device, generator=g, dtype=torch.float32).clamp(-4, 4))
    for s in range(runner.max_num_seqs):
        runner.lengths[s] = context
    runner.state.positions.fill_(context)


def time_steps(step, steps: int) -> float:
    step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return (time.perf_counter() - t0) / steps


def bench_ours(config: ModelConfig, layout: str, batches: list[int], context: int, steps: int,
               modes: list[str], qat_sim: bool, sampling: SamplingParams | None = None) -> dict:
    model = build_random_model(config, layout, DEVICE)
    results = {}
    for batch in batches:
        runner = Runner(model, max_num_seqs=batch, max_model_len=context + steps + 16, qat_sim=qat_sim)
        fill_state(runner, context)
        runner.tokens.random_(2, config.vocab_size)
        slots = list(range(batch))
        if sampling is not None:       # every slot samples with these knobs (default: greedy)
            for s in slots:
                runner.sampling.assign(s, dataclasses.replace(sampling, seed=s), [1])
        for mode in modes:
            ops_kind, _, how = mode.partition("-")
            scope = ops.reference_only() if ops_kind == "reference" else contextlib.nullcontext()
            with scope:
                runner.graphs.clear()
                if how == "graph":
                    runner.capture(max_batch=batch, progress=False)
                t = time_steps(lambda: runner.decode_step(slots), steps)
                runner.graphs.clear()
            results[(batch, mode)] = t
            for s in slots:     # keep every slot at the same context for the next mode
                runner.lengths[s] = context
            runner.state.positions[:batch] = context
        results[(batch, "bytes")] = weight_bytes(model, batch) + batch * state_bytes(config, qat_sim, model.dtype,
                                                                                        context)
        del runner
        _free()
    del model
    _free()
    return results


def _free() -> None:
    gc.collect()
    if DEVICE.startswith("cuda"):
        torch.cuda.empty_cache()


def hf_bf16_model(config: ModelConfig, device: str = DEVICE) -> torch.nn.Module:
    """transformers' eager ``DeepseekV4ForCausalLM`` of ``config``'s geometry, random BF16 weights,
    built in BF16 directly on ``device`` (no fp32 copy of the experts)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import transformers
    from hf_oracle import hf_config
    from transformers import DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            return DeepseekV4ForCausalLM(hf_config(config)).eval()
    finally:
        torch.set_default_dtype(default)


@torch.no_grad()
def bench_hf(config: ModelConfig, batches: list[int], context: int, steps: int) -> dict:
    """transformers' eager DeepseekV4ForCausalLM, BF16, same geometry: prefill ``context`` real
    tokens per row with its cache, then time single-token steps."""
    from transformers import DynamicCache

    model = hf_bf16_model(config)
    results = {}
    for batch in batches:
        cache = DynamicCache(config=model.config)
        ids = torch.randint(2, config.vocab_size, (batch, context), device=DEVICE)
        for lo in range(0, context, 256):   # chunked prefill keeps its activations small
            chunk = ids[:, lo:lo + 256]
            pos = torch.arange(lo, lo + chunk.shape[1], device=DEVICE).expand(batch, -1)
            model(input_ids=chunk, position_ids=pos, past_key_values=cache, use_cache=True)
        pos = [context]
        tok = ids[:, -1:]

        def step():
            p = torch.full((batch, 1), pos[0], device=DEVICE)
            model(input_ids=tok, position_ids=p, past_key_values=cache, use_cache=True)
            pos[0] += 1
        results[batch] = time_steps(step, steps)
        del cache
        _free()
    del model
    _free()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", nargs="+", default=["bf16", "fp8-mxfp4"], choices=["bf16", "fp8-mxfp4", "fp8-nvfp4"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ops", nargs="+", default=["reference-eager", "kernels-eager", "kernels-graph"],
                    choices=["reference-eager", "kernels-eager", "reference-graph", "kernels-graph"],
                    help="which ops (reference or registered kernels) and eager steps or CUDA-graph replay")
    ap.add_argument("--qat-sim", default="auto", choices=["auto", "on", "off"],
                    help="auto: on for the quantized layouts, off for bf16")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' eager model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--temperature", type=float, default=0.0, help="every row samples (default greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    args = ap.parse_args()
    knobs = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    global DEVICE
    DEVICE = args.device
    config = preset(args.preset, num_layers=args.layers)
    bw = copy_bandwidth()
    kinds = ", ".join(f"{k} x{config.layer_kinds.count(k)}" for k in ("sliding", "csa", "hca"))
    if not knobs.greedy:
        print(f"every row samples: temperature {knobs.temperature}, top-p {knobs.top_p}, top-k {knobs.top_k}")
    print(f"{args.preset} x{args.layers} layers ({kinds}; hash MoE x{sum(config.hash_layers)}), "
          f"{torch.cuda.get_device_name() if DEVICE.startswith('cuda') else DEVICE}, copy bandwidth {bw / 1e9:.0f} GB/s, context {args.context}")
    hf = {} if args.no_hf else bench_hf(config, args.batch, args.context, args.steps)
    rows = []
    for layout in args.format:
        qat = args.qat_sim == "on" or (args.qat_sim == "auto" and layout != "bf16")
        res = bench_ours(config, layout, args.batch, args.context, args.steps, args.ops, qat, knobs)
        for batch in args.batch:
            floor = res[(batch, "bytes")] / bw
            line = f"{layout:<10} qat={'on ' if qat else 'off'} batch {batch:>3}: floor {floor * 1e3:7.3f} ms"
            if batch in hf:
                line += f" | transformers eager (bf16) {hf[batch] * 1e3:8.2f} ms ({floor / hf[batch]:.3f} of floor)"
            for mode in args.ops:
                t = res[(batch, mode)]
                line += f" | dsv4 {mode} {t * 1e3:8.2f} ms ({floor / t:.3f} of floor, {batch / t:7.1f} tok/s)"
            print(line, flush=True)
            rows.append(line)


if __name__ == "__main__":
    main()
