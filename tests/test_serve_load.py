"""Load and disconnects: 64 concurrent streaming clients against 16 slots, a quarter of them hanging
up at random points. Every kept stream is well-formed and complete, nothing is lost (greedy
streams equal a batched non-streamed run of the same prompts), /health stays OK throughout, every
disconnect aborts its request, and at the end every slot is free."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from serve_util import metric

CLIENTS, QUITTERS = 64, 16


async def _client(http: httpx.AsyncClient, i: int, plan: dict) -> dict:
    body = {"model": "tiny", "prompt": f"Request {i}: once upon a time", "max_tokens": plan["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    endpoint = "/v1/completions"
    if plan["chat"]:
        body = {**body, "messages": [{"role": "user", "content": body.pop("prompt")}]}
        endpoint = "/v1/chat/completions"
    events: list[str] = []
    async with http.stream("POST", endpoint, json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        if plan["quit_after"] == 0:
            return {"quit": True}
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if plan["quit_after"] is not None and len(events) >= plan["quit_after"]:
                    return {"quit": True}      # leaving the block closes the connection mid-stream
            else:
                assert line == "", line
    return {"quit": False, "events": events}


def _check_stream(events: list[str], plan: dict) -> str:
    """A kept stream: JSON chunks of one id, a finish reason, usage, [DONE]; returns its text."""
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == plan["max_tokens"]
    body = [c["choices"][0] for c in chunks[:-1]]
    assert all(c["finish_reason"] is None for c in body[:-1]) and body[-1]["finish_reason"] == "length"
    if plan["chat"]:
        return "".join(c["delta"].get("content") or "" for c in body)
    return "".join(c["text"] for c in body)


def test_64_streaming_clients_with_disconnects(served):
    rng = random.Random(12)
    quitters = set(rng.sample(range(CLIENTS), QUITTERS))
    plans = [{"chat": i % 3 == 0,
              "max_tokens": 48 if i in quitters else rng.randint(2, 8),
              "quit_after": rng.randint(0, 6) if i in quitters else None} for i in range(CLIENTS)]
    before = httpx.get(served.url + "/metrics").text

    async def main():
        limits = httpx.Limits(max_connections=CLIENTS + 8)
        async with httpx.AsyncClient(base_url=served.url, timeout=300, limits=limits) as http:
            health: list[int] = []
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    health.append((await http.get("/health")).status_code)
                    await asyncio.sleep(0.2)

            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(_client(http, i, p) for i, p in enumerate(plans)))
            done.set()
            await watcher
            # every disconnect reaches the scheduler within a step: the slots drain
            for _ in range(200):
                state = (await http.get("/health")).json()
                if state["slots_used"] == 0 and state["running"] == 0 and state["waiting"] == 0:
                    break
                await asyncio.sleep(0.05)
            return results, health, state

    results, health, state = asyncio.run(main())
    assert health and set(health) == {200}
    assert state["status"] == "ok" and state["slots_used"] == 0 and state["running"] == 0, state
    texts = {}
    for i, (plan, res) in enumerate(zip(plans, results)):
        assert res["quit"] == (i in quitters)
        if not res["quit"]:
            texts[i] = _check_stream(res["events"], plan)
    assert len(texts) == CLIENTS - QUITTERS
    # nothing lost: the kept completion streams equal one batched, non-streamed request
    kept = [i for i in texts if not plans[i]["chat"]]
    by_len: dict[int, list[int]] = {}
    for i in kept:
        by_len.setdefault(plans[i]["max_tokens"], []).append(i)
    for n, ids in by_len.items():
        r = httpx.post(served.url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": [f"Request {i}: once upon a time" for i in ids], "max_tokens": n,
            "temperature": 0, "ignore_eos": True}).json()
        assert [c["text"] for c in r["choices"]] == [texts[i] for i in ids]
    after = httpx.get(served.url + "/metrics").text
    name = 'dsv4_requests_finished_total{finish_reason="abort",model_name="tiny"}'
    aborted = metric(after, name) - _or0(before, name)
    assert aborted == QUITTERS
    assert metric(after, "dsv4_slots_used") == 0 and metric(after, "dsv4_num_requests_running") == 0


def _or0(page: str, name: str) -> float:
    try:
        return metric(page, name)
    except KeyError:
        return 0.0


def test_stream_interval_sends_the_same_tokens_in_fewer_chunks(tiny_checkpoint):
    """--stream-interval 4: the first token alone (time to first token unchanged), then chunks of at
    least 4 tokens, the end with whatever is left; the streamed text and logprobs equal the
    non-streamed answer's."""
    import openai

    from dsv4.engine.llm import LLM
    from serve_util import InProcessServer

    llm = LLM(tiny_checkpoint, max_num_seqs=2, max_model_len=64, progress=False)
    server = InProcessServer(llm, stream_interval=4)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ask = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=0,
                   extra_body={"ignore_eos": True})
        whole = client.completions.create(**ask).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**ask, stream=True) if c.choices]
        sizes = [len(c.logprobs.tokens) for c in chunks if c.logprobs and c.logprobs.tokens]
        assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 10 and len(sizes) < 10, sizes
        assert "".join(c.text for c in chunks) == whole.text
        assert [t for c in chunks if c.logprobs for t in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
        assert chunks[-1].finish_reason == "length"
    finally:
        server.stop()
