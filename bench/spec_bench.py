"""Speculative decoding against plain decoding, one run on one device (issue 25).

    python bench/spec_bench.py [--preset flash] [--layers 4] [--format fp8-mxfp4] [--k 3]
                               [--batch 1 8 32] [--accept 0.5 0.7 0.9] [--tokens 128] [--context 1024]
                               [--device cuda|cpu] [--eager] [--tables cost simulated real zero profile]

Random weights made on the device (``dsv4.random_weights``, the checkpoint's MTP block
included); on a GPU BF16 with the QAT simulation and every step a CUDA graph replay (decode and
verify graphs, unless ``--eager``), on the CPU fp32 eager (the tiny preset runs in seconds: the test
suite runs it). Four tables:

1. **verify cost**: ms of a verify step of 1 + k tokens per row against a 1-token decode step, per
   batch size, with drafts that are always rejected (so it is also speculation's worst case: the
   tokens/s ratio at zero acceptance).
2. **simulated acceptance**: greedy tokens/s of plain decoding against speculation whose acceptance
   is drawn (:class:`ForcedAcceptance`): each draft accepted with probability p until the first
   rejection, then the target's own token, so a step emits ``1 + p + ... + p^k`` tokens on average;
   every step does the real work (verify forward, acceptance, rollback). Drafts recorded from a
   plain run do not serve: with random weights nearly every logit is a near-tie, and the verify
   forward and the decode graph round differently enough to flip them (1.07-1.11 tokens a step at
   p = 0.5-0.9 on an H200, results/2026-11-29/call9_spec_simulated.txt).
3. **real drafts**: the MTP block and n-gram drafts through the engine (prompts that repeat a
   segment, so n-gram finds matches in the prompt) against the plain engine: acceptance and
   tokens/s. With random weights the MTP block's acceptance is near zero: reported as it is.
4. **zero acceptance**: the engine with n-gram drafts that are always wrong against the plain engine,
   tokens/s with the speculation policy (the default: it turns speculation off and probes) and
   without it (every step verifies), per batch size: issue 25's "at most 5% lost at zero
   acceptance" (``--tables zero --batch 1 32 --tokens 512``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.config import preset  # noqa: E402
from dsv4.engine.batch import NewSequence, Row, ScheduledBatch  # noqa: E402
from dsv4.engine.core import Engine  # noqa: E402
from dsv4.engine.runner import Runner  # noqa: E402
from dsv4.engine.sampling import SamplingParams  # noqa: E402
from dsv4.engine.speculative import SpecPolicy  # noqa: E402
from dsv4.random_weights import build_random_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def runner_for(model, batch: int, context: int, spec: dict | None, graphs: bool, qat: bool,
               max_num_batched_tokens: int = 8192) -> Runner:
    r = Runner(model, max_num_seqs=batch, max_model_len=context, qat_sim=qat, speculative=spec,
               max_num_batched_tokens=max_num_batched_tokens)
    if graphs:
        r.capture(buckets=[batch], progress=False)
        if spec is not None:
            r.capture_verify(buckets=[batch], progress=False)
    return r


def prefill(runner: Runner, prompts: list[tuple[int, ...]]) -> None:
    runner.run(ScheduledBatch(tuple(Row(s, 0, p, new=NewSequence(GREEDY, p)) for s, p in enumerate(prompts))))


def plain_decode(runner: Runner, n: int) -> tuple[float, list[list[int]]]:
    """``n`` greedy decode steps of every slot: seconds, and each slot's tokens."""
    slots = range(runner.max_num_seqs)
    toks = [[int(t)] for t in runner.tokens[:runner.max_num_seqs].tolist()]
    sync(str(runner.device))
    t0 = time.perf_counter()
    outs = []
    for _ in range(n):
        # a copy: with CUDA graphs the sampled ids live in the graph's output buffer, which the next
        # replay overwrites (the drafts of the simulated table are built from these tokens)
        outs.append(runner.run(ScheduledBatch(tuple(Row(s, runner.lengths[s]) for s in slots))).sampled.token_ids.clone())
    sync(str(runner.device))
    dt = time.perf_counter() - t0
    for o in outs:
        for s, t in enumerate(o.tolist()):
            toks[s].append(t)
    return dt, toks


def spec_decode(runner: Runner, n: int, k: int, draft) -> tuple[float, int, int]:
    """Verify steps until every slot has ``n`` more tokens; ``draft(slot, emitted) -> k ids``.
    Returns seconds, steps and tokens emitted."""
    B = runner.max_num_seqs
    emitted = [0] * B
    steps = 0
    sync(str(runner.device))
    t0 = time.perf_counter()
    while min(emitted) < n:
        rows = tuple(Row(s, runner.lengths[s], draft=tuple(draft(s, emitted[s]))) for s in range(B))
        out = runner.run(ScheduledBatch(rows))
        for s, c in enumerate(out.emitted):
            emitted[s] += c
        steps += 1
    sync(str(runner.device))
    return time.perf_counter() - t0, steps, sum(emitted)


def ngram_runner(model, args, qat: bool, b: int, ctx: int, rng: random.Random):
    """A runner of ``b`` slots speculating with ``k`` host drafts, and ``b`` random prompts of
    ``--context`` tokens already prefilled: ``(runner, prompts)``."""
    V = model.config.vocab_size
    prompts = [tuple(rng.randrange(2, V) for _ in range(args.context)) for _ in range(b)]
    r = runner_for(model, b, ctx, {"method": "ngram", "num_speculative_tokens": args.k}, args.graphs, qat)
    prefill(r, prompts)
    return r, prompts


def verify_cost(model, args, qat: bool) -> None:
    print(f"\n## verify cost: 1 + k = {1 + args.k} tokens per row against 1, drafts always rejected "
          f"(context {args.context})")
    print(f"{'batch':>5} {'decode ms':>10} {'verify ms':>10} {'ratio':>6} {'tok/s plain':>12} {'tok/s spec@0':>13}")
    rng = random.Random(0)
    V = model.config.vocab_size
    for b in args.batch:
        r, _ = ngram_runner(model, args, qat, b, args.context + 2 * args.steps + 4 * args.k + 8, rng)
        plain_decode(r, 2)                                           # warm
        t_dec, _ = plain_decode(r, args.steps)
        junk = lambda s, e: [rng.randrange(2, V) for _ in range(args.k)]   # noqa: E731
        spec_decode(r, 2, args.k, junk)                              # warm
        t_ver, steps, toks = spec_decode(r, args.steps, args.k, junk)
        ms_d, ms_v = 1e3 * t_dec / args.steps, 1e3 * t_ver / steps
        print(f"{b:>5} {ms_d:>10.3f} {ms_v:>10.3f} {ms_v / ms_d:>6.2f} {b * args.steps / t_dec:>12.1f} "
              f"{toks / t_ver:>13.1f}")
        del r


def _profiled(fn, top: int) -> None:
    """Run ``fn`` once under the profiler (after it ran once unprofiled); print its kernel count,
    kernel time and top kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    print(f"  {len(kernels)} kernels, {total / 1e3:.3f} ms of kernel time")
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:80], []).append(e.device_time)
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"  {sum(times) / 1e3:8.3f} ms {100 * sum(times) / max(total, 1e-9):5.1f}%  x{len(times):<4} {name}")


def profile_steps(model, args, qat: bool) -> None:
    """Where a verify step's time goes against a decode step of the same rows and of as many rows
    as the verify step has tokens (``b * (1 + k)``): the kernels of one step of each, graph replay."""
    rng = random.Random(3)
    V = model.config.vocab_size
    for b in args.batch:
        for rows, verify in ((b, False), (b * (1 + args.k), False), (b, True)):
            r, _ = ngram_runner(model, args, qat, rows, args.context + 16 * args.k + 16, rng)
            junk = lambda s, e: [rng.randrange(2, V) for _ in range(args.k)]   # noqa: E731
            what = f"verify step, {b} rows x {1 + args.k} tokens" if verify else f"decode step, {rows} rows"
            print(f"\n## profile: {what} (context {args.context})")
            if verify:
                _profiled(lambda: spec_decode(r, 1, args.k, junk), args.top)
            else:
                _profiled(lambda: plain_decode(r, 1), args.top)
            del r


class ForcedAcceptance:
    """Within the block, the runner's greedy verification accepts by a draw instead of a test: each
    draft with probability ``p`` (a device scalar, so one captured verify graph serves every ``p``)
    until the first rejection, then the target's own token (its argmax there). The real acceptance
    runs first, so the step costs what it costs. (SGLang's simulated acceptance does the same.)"""

    def __init__(self, device: torch.device | str):
        self.p = torch.zeros((), device=device)

    def __enter__(self) -> "ForcedAcceptance":
        from dsv4.engine import runner
        self._orig = runner.verify_tokens
        runner.verify_tokens = self.verify
        return self

    def __exit__(self, *exc) -> None:
        from dsv4.engine import runner
        runner.verify_tokens = self._orig

    def verify(self, sampling, logits, slot_idx, drafts, flags):
        out, _ = self._orig(sampling, logits, slot_idx, drafts, flags)
        b, S, _ = logits.shape
        accepted = (torch.rand(b, S - 1, device=logits.device) < self.p).to(torch.int64).cumprod(1).sum(1)  # [b]
        target = logits.argmax(-1)                                                   # [b, S]
        pos = torch.arange(S, device=logits.device)
        tokens = torch.where(pos < accepted.unsqueeze(1), torch.cat([drafts, target[:, -1:]], 1), target)
        tokens = torch.where(pos <= accepted.unsqueeze(1), tokens, -1)
        return out._replace(token_ids=tokens), accepted + 1


def simulated(model, args, qat: bool) -> None:
    print(f"\n## simulated acceptance: each draft accepted with probability p until the first rejection "
          f"(k = {args.k}, {args.tokens} tokens per row; expected tokens a step 1 + p + ... + p^k)")
    print(f"{'batch':>5} {'p':>5} {'tok/s plain':>12} {'tok/s spec':>11} {'tokens/step':>12} {'speedup':>8}")
    rng = random.Random(1)
    V = model.config.vocab_size
    for b in args.batch:
        with ForcedAcceptance(args.device) as forced:
            # a slot ahead keeps verifying while others catch up
            r, prompts = ngram_runner(model, args, qat, b, args.context + (args.k + 1) * args.tokens + 8, rng)
        plain_decode(r, 1)
        r.reset(list(range(b)))
        prefill(r, prompts)
        t_plain, _ = plain_decode(r, args.tokens + args.k + 1)
        t_plain *= args.tokens / (args.tokens + args.k + 1)
        for p in args.accept:
            r.reset(list(range(b)))
            prefill(r, prompts)
            forced.p.fill_(p)
            draft = lambda s, e: [rng.randrange(2, V) for _ in range(args.k)]   # noqa: E731
            with forced:
                t_spec, steps, toks = spec_decode(r, args.tokens, args.k, draft)
            plain_rate, spec_rate = b * args.tokens / t_plain, toks / t_spec
            print(f"{b:>5} {p:>5.2f} {plain_rate:>12.1f} {spec_rate:>11.1f} {toks / steps / b:>12.2f} "
                  f"{spec_rate / plain_rate:>7.2f}x")
        del r


def engine_run(model, args, qat: bool, prompts: list[list[int]], spec: dict | None, propose=None,
               policy: bool = True):
    """Greedy generation of ``--tokens`` tokens for each prompt through :class:`Engine` (graphs on
    the GPU), the prompts prefilled outside the timing: ``(tokens/s, token ids per prompt,
    SpecStats)``. ``propose`` replaces the n-gram drafter; ``policy=False`` verifies at every step."""
    b = len(prompts)
    r = runner_for(model, b, args.context + args.tokens + 4 * args.k + 8, spec, args.graphs, qat,
                   max_num_batched_tokens=max(args.context * b, 2 * b) + b)
    engine = Engine(r, None, eos_id=-1)
    if propose is not None:
        engine.propose = propose
    if spec is not None:        # the policy is on by default where graphs replay: here on the CPU too
        engine.spec_policy = SpecPolicy() if policy else None
    for p in prompts:                                     # compile and warm outside the timing
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    engine.spec_stats = type(engine.spec_stats)()
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in prompts]
    engine.step()                                          # the prefill step
    sync(args.device)
    t0 = time.perf_counter()
    n, done = 0, {}
    while engine.has_unfinished:
        for o in engine.step():
            n += len(o.new_token_ids)
            if o.finished:
                done[o.request_id] = o.output.token_ids
    sync(args.device)
    rate = n / (time.perf_counter() - t0)
    stats = engine.spec_stats
    del engine, r
    return rate, [done[i] for i in rids], stats


def real_drafts(model, args, qat: bool) -> None:
    print(f"\n## real drafts through the engine (k = {args.k}, {args.tokens} tokens per request, greedy; "
          f"prompts repeat a 32-token segment)")
    print(f"{'batch':>5} {'method':>6} {'tok/s':>9} {'vs plain':>9} {'accepted/draft':>15} {'tokens/step':>12}")
    rng = random.Random(2)
    V = model.config.vocab_size
    for b in args.batch:
        seg = [[rng.randrange(2, V) for _ in range(32)] for _ in range(b)]
        prompts = [(s * (args.context // 32 + 1))[:args.context] for s in seg]
        base = None
        for method in ("plain", "ngram", "mtp"):
            spec = None if method == "plain" else {"method": method, "num_speculative_tokens": args.k,
                                                    "prompt_lookup_min": 2, "prompt_lookup_max": 8}
            rate, _, st = engine_run(model, args, qat, prompts, spec)
            base = base or rate
            acc = f"{st.num_accepted_tokens / st.num_draft_tokens:.3f}" if st.num_draft_tokens else "-"
            per = f"{st.mean_accepted_length:.2f}" if st.num_drafts else "1.00"
            print(f"{b:>5} {method:>6} {rate:>9.1f} {rate / base:>8.2f}x {acc:>15} {per:>12}")


def zero_acceptance(model, args, qat: bool) -> None:
    """Issue 25's second target: speculation with every draft rejected loses at most 5% against
    plain decoding (the policy turns it off, then probes). n-gram drafts replaced by plain
    decoding's own next tokens plus one (wrong wherever the speculative run still follows plain
    decoding, random where bf16 rounding made it diverge), through the engine; with the policy
    (the default) and without it (every step verifies: the raw cost)."""
    print(f"\n## zero acceptance through the engine (n-gram k = {args.k}, every draft wrong, "
          f"{args.tokens} tokens per request, context {args.context})")
    print(f"{'batch':>5} {'tok/s plain':>12} {'tok/s spec':>11} {'vs plain':>9} {'verify rows':>12} "
          f"{'plain rows':>11} {'no policy':>10} {'vs plain':>9}")
    rng = random.Random(4)
    V, k = model.config.vocab_size, args.k
    for b in args.batch:
        prompts = [[rng.randrange(2, V) for _ in range(args.context)] for _ in range(b)]
        plain, truth, _ = engine_run(model, args, qat, prompts, None)
        ahead = {tuple(p): t for p, t in zip(prompts, truth)}

        def wrong(req):
            n = len(req.output_ids)
            want = (list(ahead[tuple(req.prompt_ids)][n:n + k]) + [0] * k)[:k]
            return [(t + 1) % V for t in want]
        spec = {"method": "ngram", "num_speculative_tokens": k}
        on, _, st = engine_run(model, args, qat, prompts, spec, wrong)
        off, _, _ = engine_run(model, args, qat, prompts, spec, wrong, policy=False)
        print(f"{b:>5} {plain:>12.1f} {on:>11.1f} {on / plain:>8.3f}x {st.num_drafts:>12} "
              f"{st.num_policy_plain_rows:>11} {off:>10.1f} {off / plain:>8.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="flash", choices=["tiny", "flash", "pro"])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--format", default="fp8-mxfp4", choices=["bf16", "fp8-mxfp4", "fp8-nvfp4"])
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--accept", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per row (tables 2 and 3)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (table 1)")
    ap.add_argument("--context", type=int, default=1024, help="prompt length")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--fp32", action="store_true",
                    help="fp32 weights, QAT off (on the GPU; separates near-tie flips of bf16 from acceptance)")
    ap.add_argument("--tables", nargs="+", default=["cost", "simulated", "real", "zero"],
                    choices=["cost", "simulated", "real", "zero", "profile"],
                    help="profile (GPU): the kernels of a verify step against decode steps of as many rows and tokens")
    ap.add_argument("--top", type=int, default=15, help="kernels listed per profiled step")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    args.graphs = cuda and not args.eager
    dtype = torch.bfloat16 if cuda and not args.fp32 else torch.float32
    qat = cuda and args.format != "bf16" and not args.fp32
    config = preset(args.preset, num_layers=args.layers)
    model = build_random_model(config, args.format, args.device, dtype=dtype, with_mtp=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"# spec_bench: {args.preset} x{args.layers} {args.format} {str(dtype).removeprefix('torch.')} "
          f"qat={'on' if qat else 'off'} on {name}, {'CUDA graphs' if args.graphs else 'eager'}")
    if "cost" in args.tables:
        verify_cost(model, args, qat)
    if "simulated" in args.tables:
        simulated(model, args, qat)
    if "real" in args.tables:
        real_drafts(model, args, qat)
    if "zero" in args.tables:
        zero_acceptance(model, args, qat)
    if "profile" in args.tables and cuda:
        profile_steps(model, args, qat)


if __name__ == "__main__":
    main()
