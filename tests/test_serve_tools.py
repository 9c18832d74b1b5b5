"""Tool calls, reasoning and faults through the server, with scripted model output.

Random weights never write DSML, so the engine's token for a request whose prompt names a script
(`[[script:NAME]]` in a message) is replaced by the script's next token: everything after that,
the detokenizer, the stop checker, the chat parser, the server's streaming and the `openai`
client, is the real code. Script `boom` raises inside the engine's output handling (a failing
detokenizer): that request alone fails.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
import logging
import re
import time

import httpx
import pytest

from serve_util import InProcessServer

openai = pytest.importorskip("openai")

EOS = "<｜end▁of▁sentence｜>"
D = "｜DSML｜"
CALLS = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
         f'</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
         f'<{D}invoke name="get_time">\n<{D}parameter name="zone" string="true">CET</{D}parameter>\n</{D}invoke>\n'
         f'</{D}tool_calls>')
SCRIPTS = {
    "calls": "Checking." + CALLS + EOS,
    "think": "Two and two.</think>It is 4." + EOS,
    "think_call": "I need the weather.</think>" + CALLS + EOS,
    "malformed": (f'Sure.\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="x" string="false">{{bad'
                  f'</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>' + EOS),
    "lookalike": "Use <b>bold</b> and a | bar; </think" + EOS,
    "stray_think": "Fine.</think>and more" + EOS,
    "specials": "Hello<｜User｜> there<｜latest_reminder｜>!" + EOS,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def server():
    from dsv4.engine.llm import LLM
    llm = LLM(max_num_seqs=12, max_model_len=2048, progress=False)
    tok, engine = llm.tokenizer, llm.engine
    scripts = {name: tok.encode(text) for name, text in SCRIPTS.items()}
    chosen: dict[str, list[int] | None] = {}
    original = engine._take

    def take(track, token, logprob, top):
        rid = track.request.request_id
        if rid not in chosen:
            m = re.search(r"\[\[script:(\w+)\]\]", tok.decode(track.request.prompt_ids))
            chosen[rid] = None if m is None else m.group(1)
        name = chosen[rid]
        if name == "boom":
            raise RuntimeError("detokenizer exploded")
        if name is not None:
            n = len(track.out.token_ids)
            token = scripts[name][n] if n < len(scripts[name]) else tok.eos_id
        return original(track, token, logprob, top)

    engine._take = take
    srv = InProcessServer(llm)
    yield srv
    srv.stop()
    del engine._take


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ask(name: str, **kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"[[script:{name}]]"}], "max_tokens": 400, **kw}


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _stream(client, **kw) -> list:
    return list(client.chat.completions.create(**kw, stream=True))


@pytest.fixture(scope="module")
def runs(client, server):
    """Every scripted request of this module, sent at once (they share the engine's steps)."""
    records = _Records()
    logging.getLogger("dsv4.serve").addHandler(records)
    thinking = {"chat_template_kwargs": {"thinking": True}}
    jobs = {
        "calls": lambda: client.chat.completions.create(**_ask("calls", tools=TOOLS)),
        "calls_again": lambda: client.chat.completions.create(**_ask("calls", tools=TOOLS)),
        "calls_stream": lambda: _stream(client, **_ask("calls", tools=TOOLS)),
        "think": lambda: client.chat.completions.create(**_ask("think", extra_body=thinking)),
        "think_call_stream": lambda: _stream(client, **_ask("think_call", tools=TOOLS, reasoning_effort="high")),
        "lookalike": lambda: client.chat.completions.create(**_ask("lookalike")),
        "malformed": lambda: client.chat.completions.create(**_ask("malformed", tools=TOOLS)),
        "malformed_stream": lambda: _stream(client, **_ask("malformed", tools=TOOLS)),
    }
    try:
        with ThreadPoolExecutor(len(jobs)) as pool:
            futures = {name: pool.submit(job) for name, job in jobs.items()}
            done = {name: f.result() for name, f in futures.items()}
    finally:
        logging.getLogger("dsv4.serve").removeHandler(records)
    done["log"] = records.messages
    return done


def _deltas(chunks: list) -> tuple[str, str, dict, str | None]:
    """(reasoning, content, calls by index, finish reason) of a streamed chat completion; checks that
    each call's first delta brings its id and name, and later ones only argument fragments."""
    reasoning = content = ""
    calls, finish = {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name and tc.function.arguments == ""   # name first
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_tool_calls(runs, client):
    c = runs["calls"].choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    calls = c.message.tool_calls
    assert [t.function.name for t in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1].function.arguments) == {"zone": "CET"}
    again = runs["calls_again"].choices[0].message.tool_calls
    ids = [t.id for t in calls + again]
    assert len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)
    # the calls go back into the history and the conversation continues
    history = [{"role": "user", "content": "weather?"}, c.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"},
               {"role": "tool", "tool_call_id": calls[1].id, "content": "12:00"}]
    follow = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=2)
    assert follow.choices[0].finish_reason in ("length", "stop")


def test_tool_calls_stream_as_deltas(runs):
    reasoning, content, calls, finish = _deltas(runs["calls_stream"])
    assert content == "Checking." and finish == "tool_calls" and reasoning == ""
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert json.loads(calls[1]["arguments"]) == {"zone": "CET"}
    assert len({runs["calls_stream"][0].id} | {ch.id for ch in runs["calls_stream"]}) == 1


def test_reasoning_and_content_split(runs):
    r = runs["think"]
    m = r.choices[0].message
    assert m.reasoning_content == "Two and two." and m.content == "It is 4." and r.choices[0].finish_reason == "stop"
    assert 0 < r.usage.completion_tokens_details.reasoning_tokens < r.usage.completion_tokens
    reasoning, content, calls, finish = _deltas(runs["think_call_stream"])
    assert reasoning == "I need the weather." and content == "" and finish == "tool_calls"
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_time"]


def test_markup_never_in_content_and_lookalikes_are_text(runs):
    for name in ("calls_stream", "think_call_stream"):
        for chunk in runs[name]:
            text = (chunk.choices[0].delta.content or "") if chunk.choices else ""
            assert D not in text and "</think>" not in text and EOS not in text
    assert runs["lookalike"].choices[0].message.content == "Use <b>bold</b> and a | bar; </think"


def test_malformed_block_ends_the_choice_with_raw_text(runs):
    c = runs["malformed"].choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith("Sure.<" + D + "tool_calls>") and "{bad" in c.message.content
    _, streamed, calls, finish = _deltas(runs["malformed_stream"])
    assert streamed == c.message.content and not calls and finish == "stop"
    assert sum("malformed tool-call markup" in m for m in runs["log"]) == 2


def test_a_failing_request_fails_alone(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            boom = http.post("/v1/chat/completions", json=_ask("boom"))
            boom_stream = http.post("/v1/chat/completions", json=_ask("boom", stream=True))
            fine = [http.post("/v1/chat/completions", json=_ask("lookalike")) for _ in range(3)]
            return await asyncio.gather(boom, boom_stream, *fine)

    boom, boom_stream, *fine = asyncio.run(main())
    assert boom.status_code == 500
    assert boom.json()["error"]["code"] == "engine_error" and "detokenizer exploded" in boom.json()["error"]["message"]
    events = [line[6:] for line in boom_stream.text.splitlines() if line.startswith("data: ")]
    assert "detokenizer exploded" in events[-2] and events[-1] == "[DONE]"
    want = "Use <b>bold</b> and a | bar; </think"
    assert all(r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want for r in fine)
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots_used"] == 0


def _finished(server, reason: str, want: float | None = None) -> float:
    """The finished-requests counter for ``reason``; with ``want``, waits (up to 10 s) until it gets
    there: a request the server ended itself is counted when the engine has ended it too, a step or
    so after its response went out."""
    deadline = time.monotonic() + 10
    while True:
        page = httpx.get(server.url + "/metrics").text
        m = re.search(rf'^dsv4_requests_finished_total{{[^}}]*finish_reason="{reason}"[^}}]*}} (\S+)$', page, re.M)
        got = 0.0 if m is None else float(m.group(1))
        if want is None or got >= want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


def test_a_choice_the_parser_cuts_short_is_stop_in_the_metric_too(server, client):
    records = _Records()
    logging.getLogger("dsv4.serve").addHandler(records)
    before = {r: _finished(server, r) for r in ("stop", "abort")}
    try:
        cut = client.chat.completions.create(**_ask("malformed", tools=TOOLS)).choices[0]
        stray = client.chat.completions.create(**_ask("stray_think")).choices[0]
    finally:
        logging.getLogger("dsv4.serve").removeHandler(records)
    assert cut.finish_reason == "stop" and stray.finish_reason == "stop"
    assert stray.message.content == "Fine.</think>"
    assert _finished(server, "stop", before["stop"] + 2) == before["stop"] + 2
    assert _finished(server, "abort") == before["abort"]
    warned = [m for m in records.messages if "generation stopped" in m]
    assert len(warned) == 2 and "malformed tool-call markup" in warned[0]
    assert "unexpected </think> in content" in warned[1] and "tool-call" not in warned[1], warned


def test_special_tokens_are_skipped_unless_asked_for(client):
    kept = "Hello<｜User｜> there<｜latest_reminder｜>!"
    chat = client.chat.completions.create(**_ask("specials"))
    assert chat.choices[0].message.content == "Hello there!" and chat.choices[0].finish_reason == "stop"
    _, streamed, _, _ = _deltas(_stream(client, **_ask("specials")))
    assert streamed == "Hello there!"
    raw = client.chat.completions.create(**_ask("specials"), extra_body={"skip_special_tokens": False})
    assert raw.choices[0].message.content == kept
    _, streamed, _, _ = _deltas(_stream(client, **_ask("specials"), extra_body={"skip_special_tokens": False}))
    assert streamed == kept
    prompt = {"model": "tiny", "prompt": "[[script:specials]]", "max_tokens": 40}
    assert client.completions.create(**prompt).choices[0].text == "Hello there!"
    raw = client.completions.create(**prompt, extra_body={"skip_special_tokens": False}).choices[0].text
    assert raw.startswith(kept), raw


def test_a_slow_prompt_preparation_does_not_hold_up_the_event_loop(server, monkeypatch):
    """Chat template and tokenization run on a worker thread (``ServingContext.prepare``): while a
    request's prompt takes a second to tokenize, the loop still answers others (and streams tokens)."""
    tok = server.state.ctx.tokenizer
    encode = tok.encode

    def slow_encode(text, *a, **kw):
        if "[[slow]]" in text:
            time.sleep(1.5)
        return encode(text, *a, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, server.url + "/v1/chat/completions", timeout=60,
                           json={"model": "tiny", "messages": [{"role": "user", "content": "[[slow]] hi"}],
                                 "max_tokens": 2})
        time.sleep(0.3)                                   # the slow request is being prepared now
        t0 = time.monotonic()
        assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
        waited = time.monotonic() - t0
        assert slow.result().status_code == 200
    assert waited < 0.6, f"/v1/models waited {waited:.2f} s behind another request's tokenization"
