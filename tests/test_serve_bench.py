"""`dsv4 bench serve` against the test server: synthetic completions at a concurrency, a JSONL of
chat prompts at a request rate; the summary, the JSON and the PNG."""

from __future__ import annotations

import json
import subprocess
import sys

from serve_util import ROOT


def _bench(served, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", served.url, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_bench_serve_synthetic(served, tmp_path):
    png, out = tmp_path / "b.png", tmp_path / "b.json"
    r = _bench(served, "-n", "8", "--concurrency", "4", "--input-len", "16", "--output-len", "3",
               "--plot", str(png), "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "8/8 completed" in r.stdout and "TTFT" in r.stdout and "ITL" in r.stdout and "p99" in r.stdout
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 8 and summary["output_tokens"] >= 8 and summary["ttft_s"]["p50"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_bench_serve_jsonl_chat_at_a_rate(served, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "Hello there", "max_tokens": 2}\n'
                    '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}\n')
    r = _bench(served, "-n", "4", "--request-rate", "20", "--endpoint", "chat", "--dataset", str(data),
               "--plot", "")
    assert r.returncode == 0, r.stderr
    assert "4/4 completed" in r.stdout and "(" in r.stdout and "10 output tokens" in r.stdout


# --------------------------------------------------------------------------- issue 21, item 10

def test_vllm_flag_names_and_a_v1_base_url(served, tmp_path):
    out = tmp_path / "b.json"
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", served.url + "/v1/",
                        "--num-prompts", "3", "--max-concurrency", "2", "--random-input-len", "8",
                        "--random-output-len", "2", "--random-range-ratio", "0", "--request-rate", "inf",
                        "--plot", "", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "3/3 completed" in r.stdout
    saved = json.loads(out.read_text())
    args = saved["args"]
    assert (args["num_requests"], args["concurrency"], args["input_len"], args["output_len"]) == (3, 2, 8, 2)
    assert args["base_url"] == served.url and args["request_rate"] is None
    assert saved["summary"]["output_tokens"] == 6


def test_unauthorized_says_pass_api_key(tiny_checkpoint):
    import os

    from dsv4.engine.llm import LLM
    from serve_util import InProcessServer

    llm = LLM(tiny_checkpoint, max_num_seqs=1, max_model_len=64, progress=False)
    server = InProcessServer(llm, api_key="sekret")
    env = {k: v for k, v in os.environ.items() if k != "DSV4_API_KEY"}
    try:
        r = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", server.url, "-n", "1",
                            "--plot", ""], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2
        assert r.stderr.strip().splitlines()[-1] == (f"dsv4 bench: error: the server at {server.url} answered 401 "
                                                     "unauthorized (pass --api-key, or set DSV4_API_KEY)")
        r = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", server.url, "-n", "1",
                            "--output-len", "2", "--input-len", "4", "--api-key", "sekret", "--plot", ""],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0 and "1/1 completed" in r.stdout, r.stderr
    finally:
        server.stop()
        llm.close()


def test_serve_overhead_bench_runs(tmp_path):
    """bench/serve_overhead.py (the HTTP side over a stand-in engine): every client gets every token,
    on both endpoints."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "bench/serve_overhead.py", "--concurrency", "3", "--output-len", "5",
                        "--requests-per-client", "2", "--step-ms", "1", "--port", str(port)],
                       cwd=root, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [line for line in p.stdout.splitlines() if "tok/s delivered" in line]
    assert [line.split()[0] for line in lines] == ["chat", "completions"]
