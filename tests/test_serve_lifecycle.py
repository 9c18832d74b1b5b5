"""The server's life: 503 while the model loads, the API key, and SIGTERM (drain: new requests get
503, running streams finish or are aborted at --shutdown-timeout, exit status 0)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from serve_util import ServerProcess

BODY = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def llm():
    from dsv4.engine.llm import LLM
    return LLM(max_num_seqs=2, max_model_len=128, progress=False)


def test_503_while_starting_then_ready(llm):
    from dsv4.serve.app import create_app
    release = threading.Event()

    def load():
        release.wait(60)
        return llm

    with TestClient(create_app(load, model_names=["tiny"])) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "starting"
        r = client.post("/v1/completions", json=BODY)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["type"] == "service_unavailable" and "loading" in r.json()["error"]["message"]
        assert client.get("/metrics").status_code == 200          # metrics are up from the start
        release.set()
        end = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < end:
            time.sleep(0.02)
        assert client.post("/v1/completions", json=BODY).status_code == 200


def test_api_key(llm):
    from dsv4.serve.app import create_app
    with TestClient(create_app(llm, model_names=["tiny"], api_key="sekret")) as client:
        for path in ("/v1/models", "/tokenizer_info"):
            r = client.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
        ok = client.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def _read_stream(url: str, body: dict, headers: dict, out: dict, key: str, started: threading.Event) -> None:
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        out[key + "_status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    out[key] = events


def test_sigterm_drains_then_exits_0():
    server = ServerProcess("--max-num-seqs", "4", "--max-model-len", "512", "--shutdown-timeout", "3",
                           "--api-key", "k", env={"OMP_NUM_THREADS": "1"})
    try:
        server.wait_ready()
        url, auth = server.url, {"Authorization": "Bearer k"}
        out: dict = {}
        short_started, long_started = threading.Event(), threading.Event()
        body = {"model": "tiny", "prompt": "Hi", "temperature": 0, "ignore_eos": True}
        short = threading.Thread(target=_read_stream, args=(url, {**body, "max_tokens": 8}, auth, out, "short",
                                                            short_started))
        long = threading.Thread(target=_read_stream, args=(url, {**body, "max_tokens": 400}, auth, out, "long",
                                                           long_started))
        short.start()
        long.start()
        assert short_started.wait(60) and long_started.wait(60)
        server.signal()
        t0 = time.monotonic()
        draining = refused = None
        while time.monotonic() - t0 < 2:   # the socket stays open: new work is turned away
            try:
                draining = httpx.get(url + "/health", timeout=2)
                refused = httpx.post(url + "/v1/completions", json=BODY, headers=auth, timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.05)
        short.join(60)
        long.join(60)
        code = server.proc.wait(60)
        elapsed = time.monotonic() - t0
    finally:
        server.stop()
    assert draining is not None and draining.status_code == 503 and draining.json()["status"] == "draining"
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    for key, reason in (("short", "length"), ("long", "abort")):
        events = out[key]
        assert out[key + "_status"] == 200 and events[-1] == "[DONE]", (key, events[-3:])
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == reason
    assert code == 0 and elapsed < 30, server.log()
    log = server.log()
    assert "draining" in log and "aborting 1 running request" in log
