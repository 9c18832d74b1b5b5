"""``dsv4 bench serve``: load-test an OpenAI-compatible server and report its latencies.

Sends N streaming requests (``/v1/completions`` or ``/v1/chat/completions``) at a given request
rate (Poisson arrivals) and/or concurrency, from synthetic prompts (token-id prompts of a chosen
length for completions, random words for chat) or a JSONL file. Per request it records the time to
first token (TTFT), the gaps between streamed tokens (inter-token latency, ITL) and the end-to-end
time; output tokens are the server's ``usage`` counts. Prints throughput and p50/p90/p99, and
writes a PNG with the latency CDFs and the output throughput over time (matplotlib, if installed).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx

from ..errors import UsageError

_WORDS = ("time year people way day man thing woman life child world school state family student group country "
          "problem hand part place case week company system program question work government number night point "
          "home water room mother area money story fact month lot right study book eye job word business issue").split()


@dataclass
class Result:
    """One request's measurements (seconds from the start of the run)."""

    sent: float
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    token_times: list[float] = field(default_factory=list)
    error: str | None = None


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    s = sorted(values)

    def pick(q: float) -> float:
        k = (len(s) - 1) * q
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (k - lo)

    return {"mean": sum(s) / len(s), "p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


# ------------------------------------------------------------------ the workload
def _lengths(mean: int, ratio: float, rng: random.Random) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def build_requests(args, vocab_size: int, model: str) -> list[tuple[str, dict]]:
    """(endpoint path, JSON body) for each request."""
    rng = random.Random(args.seed)
    chat = args.endpoint == "chat"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    items: list[dict] = []
    if args.dataset:
        try:
            with open(args.dataset, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise UsageError(f"cannot read the dataset {args.dataset} (--dataset): {e}") from None
        if not rows:
            raise UsageError(f"the dataset {args.dataset} (--dataset) has no prompts")
        for i in range(args.num_requests):
            row = rows[i % len(rows)]
            if "messages" not in row and "prompt" not in row:
                raise UsageError(f"{args.dataset}: line {i % len(rows) + 1} has neither 'prompt' nor 'messages'")
            items.append(row)
    else:
        lo_id, hi_id = 100, max(101, min(vocab_size, 100_000) - 100)
        for _ in range(args.num_requests):
            n = _lengths(args.input_len, args.range_ratio, rng)
            if chat:
                items.append({"prompt": " ".join(rng.choice(_WORDS) for _ in range(n))})
            else:
                items.append({"prompt": [rng.randrange(lo_id, hi_id) for _ in range(n)]})
            items[-1]["max_tokens"] = _lengths(args.output_len, args.range_ratio, rng)
    out = []
    for item in items:
        body = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                "max_tokens": int(item.get("max_tokens", args.output_len))}
        if chat:
            body["messages"] = item.get("messages") or [{"role": "user", "content": item["prompt"]}]
        else:
            prompt = item.get("prompt")
            if prompt is None:
                raise UsageError("--endpoint completions needs 'prompt' in every dataset line")
            body["prompt"] = prompt
        out.append((path, body))
    return out


def server_root(url: str) -> str:
    """The server's address without a trailing ``/`` or ``/v1`` (OpenAI clients' base URLs end in
    ``/v1``; the routes here add it themselves)."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


# ------------------------------------------------------------------ sending
async def _one(http: httpx.AsyncClient, path: str, body: dict, t0: float) -> Result:
    res = Result(sent=time.perf_counter() - t0)
    start = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"].get("message", "error")
                    return res
                if chunk.get("usage"):
                    res.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if not _has_output(chunk):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.token_times.append(now - t0)
        res.e2e = time.perf_counter() - start
        res.ok = True
    except json.JSONDecodeError as e:    # say what the server sent there (a server bug to report)
        res.error = f"{type(e).__name__}: {e}; near {e.doc[max(0, e.pos - 60):e.pos + 20]!r}"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def _has_output(chunk: dict) -> bool:
    for c in chunk.get("choices") or []:
        if c.get("text") or c.get("logprobs"):
            return True
        d = c.get("delta") or {}
        if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
            return True
    return False


async def _run(args, requests: list[tuple[str, dict]], headers: dict) -> tuple[list[Result], float]:
    rng = random.Random(args.seed + 1)
    limit = args.concurrency or (len(requests) if not args.request_rate else 100_000)
    sem = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=min(limit, 4096), max_keepalive_connections=min(limit, 4096))
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout, connect=60)) as http:
        t0 = time.perf_counter()

        async def gated(path, body):
            async with sem:
                return await _one(http, path, body, t0)

        tasks = []
        for path, body in requests:
            tasks.append(asyncio.create_task(gated(path, body)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


# ------------------------------------------------------------------ report
def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput_tok_s": out_tokens / duration if duration else 0.0,
        "total_throughput_tok_s": (in_tokens + out_tokens) / duration if duration else 0.0,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_s": _percentiles([x for r in ok for x in r.itl]),
        "e2e_s": _percentiles([r.e2e for r in ok if r.e2e is not None]),
    }


def print_summary(s: dict, out=sys.stdout) -> None:
    def ms(d, k):
        return "-" if d[k] is None else f"{d[k] * 1000:9.1f}"

    print(f"requests: {s['completed']}/{s['requests']} completed ({s['failed']} failed) in {s['duration_s']:.2f} s",
          file=out)
    print(f"throughput: {s['request_throughput']:.2f} req/s, {s['output_throughput_tok_s']:.1f} output tok/s, "
          f"{s['total_throughput_tok_s']:.1f} total tok/s ({s['prompt_tokens']} prompt + {s['output_tokens']} "
          "output tokens)", file=out)
    print(f"{'latency (ms)':<16}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}", file=out)
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        d = s[key]
        print(f"{name:<16}{ms(d, 'mean'):>10}{ms(d, 'p50'):>10}{ms(d, 'p90'):>10}{ms(d, 'p99'):>10}", file=out)


def plot(results: list[Result], summary: dict, path: str, title: str) -> str:
    """The PNG: CDFs of TTFT, ITL and E2E, and output tokens/s over time. Returns what was done."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot written (pip install matplotlib)"
    ok = [r for r in results if r.ok]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    series = (("TTFT", [r.ttft for r in ok if r.ttft is not None]), ("inter-token latency", [x for r in ok for x in r.itl]),
              ("end-to-end latency", [r.e2e for r in ok if r.e2e is not None]))
    for ax, (name, values) in zip(axes.flat, series):
        values = sorted(v * 1000 for v in values)
        if values:
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    times = sorted(t for r in ok for t in r.token_times)
    ax = axes.flat[3]
    if times:
        width = max(summary["duration_s"] / 40, 0.5)
        bins = int(summary["duration_s"] / width) + 1
        counts = [0] * bins
        for t in times:
            counts[min(int(t / width), bins - 1)] += 1
        ax.plot([i * width for i in range(bins)], [c / width for c in counts])
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("streamed output chunks per second (~tokens/s)")
    ax.set_title("output throughput over time")
    ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def run_bench(args) -> int:
    """Entry point of ``dsv4 bench serve``."""
    import os
    if args.request_rate is not None and args.request_rate <= 0:
        raise UsageError("--request-rate must be > 0")
    key = args.api_key or os.environ.get("DSV4_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if args.request_rate == math.inf:   # vLLM's spelling of "no rate limit"
        args.request_rate = None
    base = args.base_url = server_root(args.base_url)
    try:
        models = httpx.get(base + "/v1/models", headers=headers, timeout=30)
    except httpx.HTTPError as e:
        raise UsageError(f"cannot reach the server at {base} (--base-url): {e}") from None
    if models.status_code == 401:
        raise UsageError(f"the server at {base} answered 401 unauthorized (pass --api-key, or set DSV4_API_KEY)"
                         if not key else f"the server at {base} answered 401 unauthorized: it refused the key "
                         "(--api-key or DSV4_API_KEY)")
    try:
        models.raise_for_status()
        model = args.model or models.json()["data"][0]["id"]
        info = httpx.get(base + "/tokenizer_info", headers=headers, timeout=30)
        vocab = info.json().get("vocab_size", 32_000) if info.status_code == 200 else 32_000
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as e:
        raise UsageError(f"the server at {base} (--base-url) did not answer /v1/models as an OpenAI-compatible "
                         f"server: {e}") from None
    if args.dataset == "agent":
        from .bench_agent import run_agent_bench
        return run_agent_bench(args, model, headers)
    requests = build_requests(args, vocab, model)
    mode = (f"rate {args.request_rate}/s" if args.request_rate else "all at once") + \
        (f", concurrency {args.concurrency}" if args.concurrency else "")
    print(f"dsv4 bench serve: {len(requests)} {args.endpoint} requests to {base} ({model}), {mode}", file=sys.stderr)
    results, duration = asyncio.run(_run(args, requests, headers))
    summary = summarize(results, duration)
    print_summary(summary)
    failed = [r.error for r in results if not r.ok]
    if failed:
        print(f"first failure: {failed[0]}", file=sys.stderr)
    if args.plot:
        print(plot(results, summary, args.plot, f"dsv4 bench serve: {model}, {args.endpoint}, {mode}"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "args": {k: v for k, v in vars(args).items() if k != "api_key"},
                       "requests": [asdict(r) for r in results]}, f, indent=1)
    return 0 if not failed else 1
