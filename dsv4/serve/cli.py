"""Flags and entry points of ``dsv4 serve`` and ``dsv4 bench serve`` (imported by :mod:`dsv4.cli`;
the server's own dependencies load only when a command runs)."""

from __future__ import annotations

import argparse
import os
import socket

from ..cli_common import HelpFormatter, positive_int
from ..engine.config import EngineConfig
from ..errors import UsageError


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return value


def add_serve_parser(p: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine flags, :class:`~dsv4.engine.config.EngineConfig`'s, are
    added by :mod:`dsv4.cli`)."""
    p.add_argument("--seed", type=int, default=None,
                   help="the seed of requests that give none (choice k uses seed + k), so the same request "
                        "gives the same answer; default: each unseeded request draws a random seed")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free port)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model name(s) clients send as `model` (default: the --model value, or 'tiny')")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 and the tokenizer routes (default: "
                        "$DSV4_API_KEY if set, else no key)")
    p.add_argument("--shutdown-timeout", type=_seconds, default=30.0,
                   help="on SIGTERM/Ctrl-C, seconds running requests may take to finish before they are aborted")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--access-log", action="store_true", help="also log uvicorn's access line per HTTP request")
    p.add_argument("--stream-interval", type=positive_int, default=1, metavar="N",
                   help="after a request's first token, stream its output every N tokens (and at its end): "
                        "less server work per token with many streams, at N tokens' latency (vLLM's flag)")


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (so a busy port is a one-line error before the model loads)."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port} (--host/--port): {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace, engine: EngineConfig, load) -> int:
    """``dsv4 serve``: check the engine config against the machine and the checkpoint
    (:func:`~dsv4.engine.llm.plan_engine`: device, dtype, limits, checkpoint, tokenizer), bind, then
    load the model while answering 503, then serve until a signal. A failed load ends the process
    (re-raised for the CLI to print once)."""
    from ..engine.llm import plan_engine
    plan_engine(engine, require_tokenizer=True)   # an unusable argument fails here, before the port is taken
    from .server import run_server
    names = args.served_model_name or [args.model or "tiny"]
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    api_key = args.api_key or os.environ.get("DSV4_API_KEY") or None
    return run_server(load, model_names=names, host=host, port=port, api_key=api_key,
                      shutdown_timeout=args.shutdown_timeout, log_level=args.log_level, access_log=args.access_log,
                      sock=sock, default_seed=args.seed, stream_interval=args.stream_interval)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks (bench serve: load-test an OpenAI-compatible server)",
                           formatter_class=HelpFormatter)
    kinds = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = kinds.add_parser("serve", help="send N requests to a running server; throughput, TTFT/ITL percentiles, PNG",
                         formatter_class=HelpFormatter,
                         description="Flags also take vLLM's `vllm bench serve` names: --num-prompts, "
                                     "--max-concurrency, --random-input-len, --random-output-len, "
                                     "--random-range-ratio.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (with or without the /v1 of OpenAI clients' base URLs)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="bearer key (default: $DSV4_API_KEY)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--num-requests", "--num-prompts", "-n", type=positive_int, default=64, help="requests to send")
    p.add_argument("--concurrency", "--max-concurrency", type=positive_int, default=None,
                   help="requests in flight at once (default: all, or unlimited with --request-rate)")
    p.add_argument("--request-rate", type=float, default=None,
                   help="requests per second, Poisson arrivals (default, or inf: send as concurrency allows)")
    p.add_argument("--dataset", default=None, metavar="JSONL",
                   help="prompts: one JSON object per line with 'prompt' (text) or 'messages', optional "
                        "'max_tokens' (default: synthetic prompts); 'agent': multi-turn conversations sharing a "
                        "system prompt, run with prefix caching off and then on (dsv4.serve.bench_agent)")
    p.add_argument("--conversations", type=positive_int, default=16,
                   help="--dataset agent: conversations run concurrently (one user each)")
    p.add_argument("--turns", type=positive_int, default=8, help="--dataset agent: turns of each conversation")
    p.add_argument("--system-len", type=positive_int, default=4096,
                   help="--dataset agent: tokens of the system prompt every conversation shares")
    p.add_argument("--turn-len", type=positive_int, default=1024,
                   help="--dataset agent: tokens of each turn's new user or tool message")
    p.add_argument("--input-len", "--random-input-len", type=positive_int, default=256,
                   help="synthetic prompt length in tokens (mean)")
    p.add_argument("--output-len", "--random-output-len", type=positive_int, default=128,
                   help="max_tokens of each request (mean)")
    p.add_argument("--range-ratio", "--random-range-ratio", type=float, default=0.5,
                   help="synthetic lengths are uniform in [len x (1 - r), len x (1 + r)]")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic prompts and arrivals")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate max_tokens tokens for every request (a fixed workload)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    p.add_argument("--plot", default="bench_serve.png", help="PNG with the latency CDFs and throughput over time "
                                                             "('' for none)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results (and every request) as JSON")


def bench(args: argparse.Namespace) -> int:
    from .bench import run_bench
    return run_bench(args)
