"""``dsv4 bench serve --dataset agent``: the agent workload, with prefix caching off and on in one run.

Each of ``--conversations`` users runs a conversation of ``--turns`` turns against the chat endpoint.
Every conversation starts with the same system prompt (``--system-len`` tokens: the tool
definitions and instructions agents resend); each turn resends the whole conversation plus a new user
or tool message of ``--turn-len`` tokens (random words, sized with the server's ``/tokenize``), and the model's answer (``--output-len`` tokens) is appended for
the next turn. A conversation's turns run one after the other; the conversations run concurrently.

The workload runs twice against the same server, with the same conversations: first with caching
off (every request carries a fresh vLLM ``cache_salt``, so it can reuse nothing, and saves under a
salt nobody asks for again), then on (no salt). Printed: TTFT per turn for both passes and their
ratio, the share of prompt tokens served from the cache (``usage.prompt_tokens_details.
cached_tokens``), requests/s and prompt tokens/s.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass

import httpx

from .bench import _WORDS, _has_output, _percentiles


@dataclass
class Turn:
    """One request's measurements."""

    conversation: int
    turn: int
    ok: bool = False
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def tokens_per_word(base_url: str, headers: dict) -> float:
    """The server tokenizer's tokens per word of the synthetic text (its ``/tokenize`` route), so
    that ``--system-len`` and ``--turn-len`` are in tokens whatever the tokenizer."""
    sample = _words(random.Random(0), 400)
    try:
        r = httpx.post(base_url + "/tokenize", json={"prompt": sample}, headers=headers, timeout=60)
        r.raise_for_status()
        return max(len(r.json()["tokens"]) / 400, 0.1)
    except (httpx.HTTPError, ValueError, KeyError):
        return 1.3          # a BPE tokenizer's usual rate, when the server has no /tokenize


def conversations(args, per_word: float = 1.0) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each conversation's new messages, one per turn (fixed by
    ``--seed``, so both passes send the same text); lengths in tokens at ``per_word`` tokens a word."""
    rng = random.Random(args.seed)

    def words(tokens: int) -> str:
        return _words(rng, max(1, round(tokens / per_word)))

    system = "You are an agent with these tools and rules. " + words(args.system_len)
    convs = []
    for c in range(args.conversations):
        msgs = []
        for t in range(args.turns):
            head = f"Task {c}: " if t == 0 else ("Tool result: " if t % 2 else "User: ")
            msgs.append(head + words(args.turn_len))
        convs.append(msgs)
    return system, convs


async def _ask(http: httpx.AsyncClient, body: dict, rec: Turn) -> str:
    """Send one streaming chat request; fill ``rec``; return the answer's text."""
    start, text = time.perf_counter(), []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error")
                    return ""
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens, rec.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if _has_output(chunk):
                    if rec.ttft is None:
                        rec.ttft = time.perf_counter() - start
                    for c in chunk["choices"]:
                        text.append((c.get("delta") or {}).get("content") or "")
        rec.e2e, rec.ok = time.perf_counter() - start, True
    except json.JSONDecodeError as e:    # say what the server sent there (a server bug to report)
        rec.error = f"{type(e).__name__}: {e}; near {e.doc[max(0, e.pos - 60):e.pos + 20]!r}"
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}"
    return "".join(text)


async def _pass(args, model: str, headers: dict, system: str, convs: list[list[str]], caching: bool
                ) -> tuple[list[Turn], float]:
    limit = args.concurrency or len(convs)
    sem = asyncio.Semaphore(limit)
    records: list[Turn] = []
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=httpx.Timeout(args.timeout, connect=60),
                                 limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit)) as http:
        async def run(c: int, msgs: list[str]) -> None:
            async with sem:
                history = [{"role": "system", "content": system}]
                for t, msg in enumerate(msgs):
                    history.append({"role": "user", "content": msg})
                    body = {"model": model, "messages": history, "stream": True, "max_tokens": args.output_len,
                            "stream_options": {"include_usage": True}, "temperature": args.temperature,
                            "ignore_eos": args.ignore_eos}
                    if not caching:
                        body["cache_salt"] = uuid.uuid4().hex
                    rec = Turn(c, t + 1)
                    records.append(rec)
                    answer = await _ask(http, body, rec)
                    if not rec.ok:
                        return
                    history.append({"role": "assistant", "content": answer or "ok"})

        t0 = time.perf_counter()
        await asyncio.gather(*(run(c, m) for c, m in enumerate(convs)))
        return records, time.perf_counter() - t0


def summarize_pass(records: list[Turn], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    turns = sorted({r.turn for r in ok})
    return {
        "requests": len(records), "completed": len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "prompt_tokens": prompt, "cached_tokens": sum(r.cached_tokens for r in ok),
        "hit_rate": sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        "prompt_throughput_tok_s": prompt / duration if duration else 0.0,
        "output_throughput_tok_s": sum(r.output_tokens for r in ok) / duration if duration else 0.0,
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "per_turn": {t: {"prompt_tokens": sum(r.prompt_tokens for r in ok if r.turn == t) / max(
                         1, sum(1 for r in ok if r.turn == t)),
                         "cached_tokens": sum(r.cached_tokens for r in ok if r.turn == t) / max(
                         1, sum(1 for r in ok if r.turn == t)),
                         "ttft_s": _percentiles([r.ttft for r in ok if r.turn == t and r.ttft is not None])}
                     for t in turns},
    }


def print_report(off: dict, on: dict, out=sys.stdout) -> None:
    def ms(x):
        return "-" if x is None else f"{x * 1000:.1f}"

    print(f"{'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'TTFT p50 off (ms)':>18} {'TTFT p50 on (ms)':>17} "
          f"{'on/off':>7}", file=out)
    for t, row in on["per_turn"].items():
        a = off["per_turn"].get(t, {}).get("ttft_s", {}).get("p50")
        b = row["ttft_s"]["p50"]
        ratio = f"{b / a:.2f}" if a and b is not None else "-"
        print(f"{t:>4} {row['prompt_tokens']:>10.0f} {row['cached_tokens']:>10.0f} {ms(a):>18} {ms(b):>17} {ratio:>7}",
              file=out)
    for name, s in (("caching off", off), ("caching on", on)):
        print(f"{name}: {s['completed']}/{s['requests']} requests in {s['duration_s']:.2f} s, "
              f"{s['request_throughput']:.2f} req/s, {s['prompt_throughput_tok_s']:.0f} prompt tok/s, "
              f"hit rate {s['hit_rate'] * 100:.1f}% ({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens), "
              f"TTFT p50 {ms(s['ttft_s']['p50'])} ms", file=out)
    if off["request_throughput"]:
        print(f"caching on / off: {on['request_throughput'] / off['request_throughput']:.2f}x requests/s", file=out)


def run_agent_bench(args, model: str, headers: dict) -> int:
    system, convs = conversations(args, tokens_per_word(args.base_url, headers))
    print(f"dsv4 bench serve --dataset agent: {len(convs)} conversations x {args.turns} turns, shared system "
          f"prompt of ~{args.system_len} tokens, ~{args.turn_len} tokens a turn, {args.output_len} tokens an answer; "
          "caching off, then on", file=sys.stderr)
    results = {}
    for name, caching in (("off", False), ("on", True)):
        records, duration = asyncio.run(_pass(args, model, headers, system, convs, caching))
        results[name] = (records, summarize_pass(records, duration))
    off, on = results["off"][1], results["on"][1]
    print_report(off, on)
    failed = [r.error for name in results for r in results[name][0] if not r.ok]
    if failed:
        print(f"first failure: {failed[0]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"off": off, "on": on, "args": {k: v for k, v in vars(args).items() if k != "api_key"},
                       "requests": {k: [asdict(r) for r in v[0]] for k, v in results.items()}}, f, indent=1)
    return 0 if not failed else 1
