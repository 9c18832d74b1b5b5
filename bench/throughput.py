"""Continuous batching against static waves on a mixed workload, one run, same engine and model.

    python bench/throughput.py [--model tiny | --preset flash --layers 4 --format fp8-mxfp4]
                               [--requests 64] [--max-num-seqs 8] [--out DIR]

N requests with mixed prompt lengths and max_tokens (a fixed seed draws them) all arrive at once
(latencies count from then).
``continuous``: the scheduler admits a waiting request as soon as a slot frees (``continuous-1``: the
same with one decode step of the running requests in a step that runs a prompt chunk, as before
``prefill_decode_steps``). ``waves``: the
previous engine's behaviour, the next ``max_num_seqs`` requests start only when the whole wave is
done. Prints output tok/s, requests/s, p50/p99 time to first token and inter-token latency per mode,
the wall time of the steps that ran a prompt chunk against the decode-only steps (prefill is paid
once per prompt in both modes, so its share caps the ratio), and writes ``throughput.png``:
per-request latency over time and the batch occupancy per step.
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
from dsv4.engine.warmup import compiled_variants  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402


def workload(n: int, vocab: int, max_prompt: int, max_out: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        plen = int(torch.randint(4, max_prompt + 1, (1,), generator=g))
        # a long tail of output lengths, as in chat traffic
        olen = max(1, min(max_out, int(torch.empty(1).exponential_(1.0, generator=g) * max_out / 4)))
        out.append((torch.randint(2, vocab, (plen,), generator=g).tolist(),
                    SamplingParams(max_tokens=olen, temperature=0.8, seed=i, ignore_eos=True)))
    return out


def run(engine: Engine, reqs, mode: str, slots: int) -> dict:
    t0 = time.perf_counter()
    arrival = {}
    first, last, gaps, done = {}, {}, [], {}
    occupancy, timeline = [], []
    pending = list(reqs)

    def admit(batch):
        for prompt, params in batch:
            rid = engine.add_request(prompt, params, detokenize=False)
            arrival[rid] = t0     # every request arrives at the start; a wave waits for its turn

    def _record(outs, now):
        occupancy.append((now - t0, len(engine.scheduler.running)))
        for o in outs:
            if not o.new_token_ids:
                continue
            if o.request_id not in first:
                first[o.request_id] = now - arrival[o.request_id]
            else:      # a step that gave a request k tokens (several decode steps): k gaps of a k-th each
                k = len(o.new_token_ids)
                gaps.extend([(now - last[o.request_id]) / k] * k)
            last[o.request_id] = now
            if o.finished:
                done[o.request_id] = len(o.output.token_ids)
                timeline.append((now - t0, now - arrival[o.request_id]))

    if mode == "continuous":
        admit(pending)
        pending = []
    # which steps ran a prompt chunk: their wall time is the prefill share of the run
    runner, chunks, substeps = engine.runner, [0], []

    def counted_run(batch):
        chunk = any(not row.is_decode for row in batch.rows)
        chunks[0] += chunk
        if chunk and any(row.is_decode for row in batch.rows):
            substeps.append(batch.decode_steps)
        return type(runner).run(runner, batch)
    runner.run = counted_run
    phase = {"prefill": [0, 0.0], "decode": [0, 0.0]}
    try:
        while pending or engine.has_unfinished:
            if mode == "waves" and not engine.has_unfinished:
                admit(pending[:slots])
                pending = pending[slots:]
            before, t_step = chunks[0], time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            kind = phase["prefill" if chunks[0] > before else "decode"]
            kind[0] += 1
            kind[1] += now - t_step
            _record(outs, now)
    finally:
        del runner.run
    total = time.perf_counter() - t0
    ttft = sorted(first.values())
    gaps.sort()

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")
    return dict(mode=mode, seconds=total, tok_s=sum(done.values()) / total, req_s=len(done) / total,
                ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99), itl_p50=pct(gaps, 0.5), itl_p99=pct(gaps, 0.99),
                occupancy=occupancy, timeline=timeline, mean_batch=statistics.fmean(b for _, b in occupancy),
                prefill_steps=phase["prefill"][0], prefill_s=phase["prefill"][1],
                decode_steps=phase["decode"][0], decode_s=phase["decode"][1],
                substeps=statistics.fmean(substeps) if substeps else 0.0)


def plot(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (a, b) = plt.subplots(2, 1, figsize=(9, 7))
    for r in results:
        t, lat = zip(*r["timeline"])
        a.plot(t, lat, ".", label=f"{r['mode']}: request latency at completion")
        t, occ = zip(*r["occupancy"])
        b.step(t, occ, where="post", label=f"{r['mode']} (mean {r['mean_batch']:.1f})")
    a.set_ylabel("end-to-end latency (s)")
    a.legend()
    b.set_xlabel("time (s)")
    b.set_ylabel("running requests")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint or tiny[:variant] (default: random weights of --preset)")
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-out", type=int, default=256)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--prefill-decode-steps", type=int, default=None,
                    help="decode steps of the running requests in a step with a prompt chunk (default: auto)")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    if args.model:
        from dsv4.engine.llm import LLM
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_prompt + args.max_out + 8, enforce_eager=args.enforce_eager)
        runner, vocab = llm.runner, llm.config.vocab_size
    else:
        from dsv4.random_weights import build_random_model
        config = preset(args.preset, num_layers=args.layers)
        model = build_random_model(config, args.format, args.device)
        runner = Runner(model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_prompt + args.max_out + 8,
                        qat_sim=args.format != "bf16")
        if args.device.startswith("cuda") and not args.enforce_eager:
            runner.capture()
        vocab = config.vocab_size
    reqs = workload(args.requests, vocab, args.max_prompt, args.max_out)
    # Untimed: compile every kernel variant prompts can reach (LLM does this at start-up), so no
    # timed run pays for a compile; the count after the runs shows none happened.
    if not args.model and args.device.startswith("cuda"):
        runner.warm_up()
    compiled = compiled_variants()
    results = []
    # continuous-1: the running requests take one decode step in a step with a prompt chunk (the
    # decode rows join the chunk's forward); continuous: as many as hide the chunk's launch time
    for mode, steps in (("waves", None), ("continuous-1", 1), ("continuous", args.prefill_decode_steps)):
        engine = Engine(runner, None, eos_id=1, prefill_decode_steps=steps)
        r = run(engine, reqs, mode.split("-")[0], args.max_num_seqs)
        r["mode"] = mode
        results.append(r)
        print(f"{mode:<12} {r['tok_s']:9.1f} output tok/s {r['req_s']:7.2f} req/s | TTFT p50 {r['ttft_p50'] * 1e3:8.1f} "
              f"p99 {r['ttft_p99'] * 1e3:8.1f} ms | ITL p50 {r['itl_p50'] * 1e3:7.2f} p99 {r['itl_p99'] * 1e3:7.2f} ms | "
              f"mean batch {r['mean_batch']:.2f} | {r['seconds']:.1f} s | steps with a prompt chunk "
              f"{r['prefill_steps']} ({r['prefill_s']:.1f} s; decode steps in them {r['substeps']:.1f}), "
              f"decode-only {r['decode_steps']} ({r['decode_s']:.1f} s)", flush=True)
    late = compiled_variants() - compiled
    print(f"kernel variants compiled during the timed runs: {late}" + (" (compile stalls inflate the latencies)"
                                                                       if late else ""))
    waves, one, cont = results
    print(f"continuous / waves output throughput: {cont['tok_s'] / waves['tok_s']:.2f}x "
          f"(with one decode step a prompt step: {one['tok_s'] / waves['tok_s']:.2f}x; {args.requests} requests, "
          f"max_num_seqs {args.max_num_seqs}); decode-only steps alone: "
          f"{waves['decode_s'] / max(cont['decode_s'], 1e-9):.2f}x less time")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(results, out / "throughput.png")


if __name__ == "__main__":
    main()
