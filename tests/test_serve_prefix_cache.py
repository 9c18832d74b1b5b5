"""Prefix caching through `dsv4 serve` with the official `openai` client: ``usage.prompt_tokens_details.
cached_tokens`` (streamed usage too) is what the block arithmetic says (tiny model: blocks of 16
tokens), a conversation's next turn reuses its earlier turns, the Prometheus counters move, and the
flags turn it off. Tiny model on CPU (the shared server of the server tests)."""

from __future__ import annotations

import random

import httpx
import pytest

from serve_util import metric

openai = pytest.importorskip("openai")

MODEL = "tiny"
BLOCK = 16


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_cached_tokens_in_usage_and_streamed_usage(client, served):
    rng = random.Random(2711)
    prompt = [0] + [rng.randrange(5, 500) for _ in range(39)]             # 40 tokens: saved at 32
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32           # one token must still run
    assert again.choices[0].text == first.choices[0].text
    longer = prompt + [7, 8, 9]
    stream = list(client.completions.create(model=MODEL, prompt=longer, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    usage = stream[-1].usage
    assert usage.prompt_tokens == 43 and usage.prompt_tokens_details.cached_tokens == 32
    # vLLM's cache_salt: prefixes are shared only between requests with the same salt
    salted = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": "tenant-a"}) for _ in range(2)]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in salted] == [0, 32]
    assert salted[1].choices[0].text == first.choices[0].text
    short = client.completions.create(model=MODEL, prompt=prompt[:BLOCK], max_tokens=1, temperature=0)
    assert short.usage.prompt_tokens_details.cached_tokens == 0            # 16 tokens: at most 15 reusable

    page = httpx.get(served.url + "/metrics").text
    assert metric(page, "dsv4_prefix_cache_hits_total") >= 96
    assert metric(page, "dsv4_prefix_cache_queries_total") >= 40 * 4 + 43 + 16
    assert metric(page, "dsv4_prefix_cache_bytes") > 0
    assert metric(page, "dsv4_prefix_cache_capacity_bytes") >= metric(page, "dsv4_prefix_cache_bytes")
    metric(page, "dsv4_prefix_cache_evictions_total")


def test_chat_next_turn_reuses_the_conversation(client):
    messages = [{"role": "system", "content": "You are a terse assistant. " * 6},
                {"role": "user", "content": "Tell me about caching prefixes of long prompts."}]
    for turn in range(3):
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
        cached = r.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            # everything up to the last block boundary before this turn's new message at least
            assert cached % BLOCK == 0 and cached >= previous // BLOCK * BLOCK, (turn, cached, previous)
            assert cached < r.usage.prompt_tokens
        previous = r.usage.prompt_tokens
        stream = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        assert stream[-1].usage.prompt_tokens_details.cached_tokens == (previous - 1) // BLOCK * BLOCK
        messages += [{"role": "assistant", "content": r.choices[0].message.content or "ok"},
                     {"role": "user", "content": f"And then, step {turn}?"}]


def test_flags_and_llm_argument():
    from dsv4.cli import build_parser
    from dsv4.engine.config import EngineConfig
    from dsv4.engine.llm import plan_engine
    from dsv4.engine.limits import DEFAULT_CPU_PREFIX_CACHE_BYTES
    parse = build_parser().parse_args
    assert parse(["serve"]).enable_prefix_caching is True
    args = parse(["serve", "--no-enable-prefix-caching", "--prefix-cache-gib", "0.5"])
    assert args.enable_prefix_caching is False and args.prefix_cache_gib == 0.5
    assert parse(["generate", "--enable-prefix-caching", "x"]).enable_prefix_caching is True
    with pytest.raises(SystemExit):
        parse(["serve", "--prefix-cache-gib", "0"])
    def plan(**kw):
        return plan_engine(EngineConfig(model="tiny", device="cpu", **kw))
    assert plan().prefix_cache_bytes == DEFAULT_CPU_PREFIX_CACHE_BYTES
    assert plan(prefix_cache_gib=0.25).prefix_cache_bytes == 2**28
    assert plan(enable_prefix_caching=False).prefix_cache_bytes == 0


def test_bench_serve_agent_dataset_runs_off_then_on(served, tmp_path):
    """`dsv4 bench serve --dataset agent` (a subprocess of the real CLI) against the tiny server:
    both passes complete, the off pass reuses nothing, the on pass reuses the conversations."""
    import json
    import subprocess
    import sys
    out = tmp_path / "agent.json"
    r = subprocess.run([sys.executable, "-m", "dsv4.cli", "bench", "serve", "--base-url", served.url, "--dataset",
                        "agent", "--conversations", "2", "--turns", "3", "--system-len", "30", "--turn-len", "6",
                        "--output-len", "6", "--plot", "", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "TTFT p50 off (ms)" in r.stdout and "caching on / off" in r.stdout
    data = json.loads(out.read_text())
    assert data["off"]["completed"] == data["on"]["completed"] == 6
    assert data["off"]["cached_tokens"] == 0 and data["on"]["hit_rate"] > 0.3
    assert all(data["on"]["per_turn"][t]["cached_tokens"] > 0 for t in ("2", "3"))
