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
