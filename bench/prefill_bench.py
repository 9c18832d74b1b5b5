"""Prompt processing against the FLOP floor and transformers' eager model, one run, one GPU.

    python bench/prefill_bench.py [--layers 4] [--format fp8-mxfp4] [--lengths 512 2048 8192 32768 131072]
                                  [--batch-lengths 512 8192 --batch 16] [--budget 8192] [--no-hf]

Through the engine (scheduler + one forward per step, ``--budget`` tokens a step), on a random-weight
slice of the preset:

- one prompt of each ``--lengths`` on an empty slot: time to its first token, tok/s, and the share of
  the BF16 and FP8 dense tensor-core peaks measured in the same run (``torch.matmul`` on 8192^3 BF16,
  ``torch._scaled_mm`` on 8192^3 FP8); time per token at each length shows whether it grows linearly;
- ``--batch`` prompts of lengths spread over ``--batch-lengths`` arriving together: time until every
  one has its first token, TTFT p50/max, tok/s;
- transformers' eager ``DeepseekV4ForCausalLM`` (BF16, same geometry) on one prompt of each length
  it fits (``--hf-max`` tokens, one forward), tok/s;
- the per-kernel profile of one prefill step (``--profile-len`` tokens).

The FLOPs of a prompt are the model's matmul work as written (2 x multiply-adds): every linear at its
logical shape, the routed experts for ``num_experts_per_tok`` picks, attention over window + top-k
(CSA) or every visible entry (HCA) per query and head, and the indexer's scoring of every visible
compressed key per query; the head for the last token only.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4.config import ModelConfig, preset  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402


def sync() -> None:
    torch.cuda.synchronize()


def dense_peaks() -> tuple[float, float]:
    """Measured BF16 and FP8 dense matmul TFLOP/s (8192^3, best of 10 after warm-up)."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)

    def best(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return 2 * n ** 3 / min(times) / 1e12

    bf16 = best(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device="cuda")
    fp8 = best(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    return bf16, fp8


def prompt_flops(c: ModelConfig, n: int) -> float:
    """Matmul FLOPs of prefilling ``n`` tokens from an empty state (see the module docstring)."""
    D, H, hd, W = c.hidden_size, c.num_attention_heads, c.head_dim, c.sliding_window
    per_token = 0.0
    for layer in range(c.num_hidden_layers):
        attn = D * c.q_lora_rank + c.q_lora_rank * H * hd + D * hd + H * hd * c.o_lora_rank + \
            c.o_groups * c.o_lora_rank * D          # wq_a, wq_b, wkv, wo_a (grouped), wo_b
        kind, m = c.layer_kind(layer), c.layer_ratio(layer)
        if kind != "sliding":
            width = 2 * hd if kind == "csa" else hd
            attn += 2 * D * width                   # compressor wkv, wgate
        if kind == "csa":
            attn += c.q_lora_rank * c.index_n_heads * c.index_head_dim + D * c.index_n_heads + \
                2 * D * 2 * c.index_head_dim       # indexer wq_b, weights_proj, its compressor
        experts = 3 * D * c.moe_intermediate_size * (c.num_experts_per_tok + c.n_shared_experts)
        router = D * c.n_routed_experts
        per_token += 2 * (attn + experts + router)
    total = per_token * n
    for layer in range(c.num_hidden_layers):      # attention and indexer scoring, summed over positions
        kind, m = c.layer_kind(layer), c.layer_ratio(layer)
        pos = torch.arange(n, dtype=torch.float64)
        visible = torch.div(pos + 1, m, rounding_mode="floor") if m else torch.zeros_like(pos)
        keys = torch.clamp(pos + 1, max=W)
        if kind == "csa":
            keys = keys + torch.clamp(visible, max=c.index_topk)
            total += float(visible.sum()) * 2 * c.index_n_heads * c.index_head_dim
        elif kind == "hca":
            keys = keys + visible
        total += float(keys.sum()) * 2 * 2 * H * hd   # QK and PV
    return total + 2 * D * c.vocab_size


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def prefill_times(engine: Engine, prompts: list[list[int]]) -> tuple[float, list[float]]:
    """Add every prompt at once (max_tokens 1) and step until all are done: (wall s, TTFTs)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                first[out.request_id] = time.perf_counter() - t0
    sync()
    return time.perf_counter() - t0, [first[i] for i in ids]


def bench_hf(config: ModelConfig, lengths: list[int]) -> dict[int, float]:
    """transformers' eager model, BF16: one forward per prompt (no cache), tok/s per length."""
    from decode_bench import hf_bf16_model

    model = hf_bf16_model(config, "cuda")
    out = {}
    for n in lengths:
        ids = torch.randint(2, config.vocab_size, (1, n), device="cuda")
        try:
            with torch.no_grad():
                model(input_ids=ids, logits_to_keep=1)
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1)
                sync()
            out[n] = n / (time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            out[n] = float("nan")
            print(f"transformers eager: {n} tokens: out of memory", flush=True)
        free()
    del model
    free()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 32768, 131072])
    ap.add_argument("--batch", type=int, default=16, help="prompts arriving together (0: skip that run)")
    ap.add_argument("--batch-lengths", type=int, nargs=2, default=[512, 8192])
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens: tokens of one step")
    ap.add_argument("--hf-max", type=int, default=8192)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each prompt length (the median is shown)")
    ap.add_argument("--profile-len", type=int, default=8192)
    args = ap.parse_args()
    config = preset(args.preset, num_layers=args.layers)
    qat = args.format != "bf16"
    bf16_peak, fp8_peak = dense_peaks()
    print(f"{torch.cuda.get_device_name()}: dense peaks measured now: BF16 {bf16_peak:.0f} TFLOP/s, "
          f"FP8 {fp8_peak:.0f} TFLOP/s", flush=True)
    print(f"{args.preset} x{args.layers} {args.format} (QAT simulation {'on' if qat else 'off'}), "
          f"{args.budget} tokens a step", flush=True)
    model = build_random_model(config, args.format, "cuda")
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(2, config.vocab_size, (n,), generator=g).tolist()

    longest = max(args.lengths)
    runner = Runner(model, max_num_seqs=1, max_model_len=longest + 8, qat_sim=qat, max_num_batched_tokens=args.budget)
    engine = Engine(runner, None, eos_id=-1)
    runner.warm_up()                   # as LLM does at start-up: every kernel variant compiles now, untimed
    prefill_times(engine, [prompt(min(args.budget, longest))])          # allocator warm-up
    ours = {}
    for n in args.lengths:
        prefill_times(engine, [prompt(min(n, args.budget))])
        wall = statistics.median(prefill_times(engine, [prompt(n)])[0] for _ in range(args.repeats))
        flops = prompt_flops(config, n)
        ours[n] = n / wall
        print(f"one prompt {n:7d} tokens: {wall * 1e3:9.1f} ms  {n / wall:9.0f} tok/s  {wall / n * 1e6:6.2f} us/token  "
              f"{flops / wall / 1e12:7.1f} TFLOP/s = {100 * flops / wall / 1e12 / bf16_peak:5.1f}% of BF16, "
              f"{100 * flops / wall / 1e12 / fp8_peak:5.1f}% of FP8 peak", flush=True)
    del engine, runner
    free()

    lo, hi = args.batch_lengths
    lens = [round(lo + (hi - lo) * i / max(1, args.batch - 1)) for i in range(args.batch)]
    runner = Runner(model, max_num_seqs=max(1, args.batch), max_model_len=max(hi, args.profile_len) + 8, qat_sim=qat,
                    max_num_batched_tokens=args.budget)
    engine = Engine(runner, None, eos_id=-1)
    runner.warm_up()
    if args.batch:               # (--batch 0: the profile only)
        prefill_times(engine, [prompt(n) for n in lens])
        wall, ttft = prefill_times(engine, [prompt(n) for n in lens])
        flops = sum(prompt_flops(config, n) for n in lens)
        print(f"{args.batch} prompts of {lo}-{hi} tokens together ({sum(lens)} tokens): all first tokens in "
              f"{wall * 1e3:.0f} ms, TTFT p50 {statistics.median(ttft) * 1e3:.0f} ms, max {max(ttft) * 1e3:.0f} ms, "
              f"{sum(lens) / wall:.0f} tok/s, {100 * flops / wall / 1e12 / bf16_peak:.1f}% of BF16 peak", flush=True)

    # per-kernel profile of one step of --profile-len tokens
    from torch.profiler import ProfilerActivity, profile
    n = min(args.profile_len, args.budget)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        prefill_times(engine, [prompt(n)])
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:70]] = by_name.get(e.name[:70], 0.0) + e.device_time
    print(f"profile of one {n}-token prompt: {total / 1e3:.1f} ms of kernels, {len(kernels)} launches")
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {100 * t / total:5.1f}%  {t / 1e3:8.2f} ms  {name}")
    del engine, runner, model
    free()

    if not args.no_hf:
        hf = bench_hf(config, [n for n in args.lengths if n <= args.hf_max])
        for n, tok_s in hf.items():
            print(f"transformers eager (bf16) one prompt {n:6d} tokens: {tok_s:9.0f} tok/s; ours {ours[n] / tok_s:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
