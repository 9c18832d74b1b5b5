"""The serving layer's own cost: how many streamed tokens a second `dsv4 serve`'s HTTP side (FastAPI,
the chat parser, server-sent events) delivers to many clients when the engine costs nothing.

The real app and uvicorn run in a subprocess over a stand-in engine (the engine's request API: every
running request gets one token per step, a step every ``--step-ms``, sleeping like a GPU step the host
waits on). This process streams ``--concurrency`` requests at a time and reports, per endpoint, the
tokens a second delivered against what the stand-in engine made, and the server's CPU time per
1000 tokens (from ``/proc``; the server shares the machine with the clients here):

    python bench/serve_overhead.py --concurrency 64 256 --output-len 256 --step-ms 10

No GPU and no weights: the tiny model's tokenizer, and nothing is computed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dsv4.engine.core import CompletionOutput, EngineStats, RequestOutput  # noqa: E402


class InstantEngine:
    """The engine's request API with no model: one token (`` x``) per running request per step."""

    def __init__(self, max_num_seqs: int, vocab_size: int, token_id: int, step_s: float):
        self.max_num_seqs, self.vocab_size, self.token_id, self.step_s = max_num_seqs, vocab_size, token_id, step_s
        self.running: dict[str, tuple[int, CompletionOutput]] = {}
        self.waiting: list[tuple[str, int, CompletionOutput]] = []
        self.aborted: set[str] = set()
        self.lock = threading.Lock()

    def check(self, prompt_ids, params) -> None:
        pass

    def add_request(self, prompt_ids, params, request_id=None, detokenize=True, skip_special_tokens=True,
                    cache_salt=None) -> str:
        with self.lock:
            self.waiting.append((request_id, params.max_tokens, CompletionOutput(prompt_token_ids=list(prompt_ids))))
        return request_id

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.add(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        outs = []
        with self.lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                rid, n, out = self.waiting.pop(0)
                self.running[rid] = (n, out)
            aborted, self.aborted = self.aborted, set()
        for rid, (n, out) in list(self.running.items()):
            if rid in aborted:
                out.finish_reason = "abort"
                del self.running[rid]
                outs.append(RequestOutput(rid, [], "", True, out))
                continue
            out.token_ids.append(self.token_id)
            out.text += " x"
            done = len(out.token_ids) >= n
            if done:
                out.finish_reason = "length"
                del self.running[rid]
            outs.append(RequestOutput(rid, [self.token_id], " x", done, out))
        return outs

    def fail_all(self, reason: str = "error") -> list[str]:
        ended = list(self.running) + [rid for rid, _, _ in self.waiting]
        self.running, self.waiting = {}, []
        return ended

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), len(self.running), self.max_num_seqs)


def serve(args) -> int:
    """The server side (a subprocess): the real app over the stand-in engine."""
    from dsv4.engine.llm import LLM
    from dsv4.serve.cli import _listen
    from dsv4.serve.server import run_server

    def load():
        llm = LLM("tiny", max_num_seqs=1, progress=False)     # only its tokenizer and limits are used
        token = llm.tokenizer.encode(" x")[-1]
        engine = InstantEngine(args.max_num_seqs, llm.tokenizer.vocab_size, token, args.step_ms / 1000)
        return SimpleNamespace(engine=engine, tokenizer=llm.tokenizer, max_model_len=4096,
                               max_num_seqs=args.max_num_seqs, path="instant")

    sock = _listen("127.0.0.1", args.port)
    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()       # the event loop's thread: the HTTP side, not the stand-in engine
        prof.enable()
    try:
        return run_server(load, model_names=["instant"], host="127.0.0.1", port=args.port, sock=sock,
                          stream_interval=args.stream_interval)
    finally:
        if prof is not None:
            import pstats
            prof.disable()
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _one(client, url: str, body: dict) -> int:
    """Stream one request; the tokens it got (each is the text `` x``)."""
    text = []
    async with client.stream("POST", url, json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                text.append(choices[0].get("text") or (choices[0].get("delta") or {}).get("content") or "")
    return "".join(text).count(" x")


async def _load(base: str, endpoint: str, concurrency: int, requests: int, output_len: int) -> tuple[int, float]:
    import httpx

    body = {"model": "instant", "max_tokens": output_len, "stream": True, "ignore_eos": True}
    if endpoint == "chat":
        url, body = f"{base}/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "hi"}]}
    else:
        url, body = f"{base}/v1/completions", {**body, "prompt": "hi"}
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one():
            async with sem:
                return await _one(client, url, body)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(requests)))
        return sum(counts), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--requests-per-client", type=int, default=2, help="requests = concurrency x this")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=10.0, help="the stand-in engine's step time")
    p.add_argument("--stream-interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--endpoint", nargs="+", default=["chat", "completions"], choices=["chat", "completions"])
    p.add_argument("--port", type=int, default=8931)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile the server's event loop (cProfile) and print its N costliest functions")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-num-seqs", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return serve(args)
    import httpx

    top = max(args.concurrency)
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port), "--step-ms",
                               str(args.step_ms), "--max-num-seqs", str(top), "--profile", str(args.profile),
                               "--stream-interval", str(args.stream_interval)],
                              stderr=None if args.profile else subprocess.DEVNULL)
    base = f"http://127.0.0.1:{args.port}"
    try:
        for _ in range(240):
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit("the server did not start")
        print(f"stand-in engine: a step every {args.step_ms} ms, one token per running request; "
              f"{args.output_len} tokens a request; --stream-interval {args.stream_interval}; "
              f"{os.cpu_count()} CPUs shared by server and clients")
        for endpoint in args.endpoint:
            for c in args.concurrency:
                cpu0 = _cpu_seconds(server.pid)
                n = c * args.requests_per_client
                tokens, wall = asyncio.run(_load(base, endpoint, c, n, args.output_len))
                cpu = _cpu_seconds(server.pid) - cpu0
                if tokens != n * args.output_len:
                    raise SystemExit(f"{endpoint}: the clients got {tokens} of the {n * args.output_len} tokens")
                made = c * 1000 / args.step_ms       # tokens a second the stand-in makes at full occupancy
                print(f"{endpoint:12s} concurrency {c:4d}: {tokens / wall:9.0f} tok/s delivered "
                      f"({tokens / wall / made:5.1%} of the {made:.0f} tok/s the engine steps make), server CPU "
                      f"{cpu / tokens * 1e6:6.1f} us a token ({cpu / wall:4.0%} of a core)")
    finally:
        server.terminate()
        server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
