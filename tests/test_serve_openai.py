"""`dsv4 serve` through the official `openai` client, sync and async: completions and chat,
streaming and not, seeds, logprobs (the prompt's too), thinking, usage; errors in OpenAI's shape
with the right status; the tokenizer routes and /metrics. Tiny model on CPU, a few tokens each."""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import pytest

from serve_util import metric

openai = pytest.importorskip("openai")

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(served):
    return openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "dsv4-tiny"]
    assert client.models.retrieve("dsv4-tiny").id == "dsv4-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completions_prompt_forms_and_n(client, served):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    ids = httpx.post(served.url + "/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)
    # the same prompt as token ids, greedy: the same text
    same = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0)
    assert same.choices[0].text == r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=["a", "b b"], max_tokens=2, n=2, temperature=0.8, seed=3)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.completion_tokens == 8
    lists = client.completions.create(model="dsv4-tiny", prompt=[[0, 5, 6], [0, 7]], max_tokens=1)
    assert len(lists.choices) == 2 and lists.usage.prompt_tokens == 5


def test_seed_reproducible_and_choices_differ(client):
    kw = dict(model=MODEL, prompt="The sea", max_tokens=6, temperature=1.0, seed=1234)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    two = client.completions.create(**kw, n=2)
    assert two.choices[0].text == a.choices[0].text          # choice 0 keeps the request's seed
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, seed=7)
    assert (client.chat.completions.create(**chat).choices[0].message.content ==
            client.chat.completions.create(**chat).choices[0].message.content)


def test_echo_logprobs_give_the_prompt_logprobs(client):
    prompt = [0, 40, 41, 42, 43]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=2, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    for tok, value, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == value and len(top) <= 3 and max(top.values()) >= value
    # the generated token's logprob equals what a plain request reports
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=2, temperature=0)
    assert math.isclose(plain.choices[0].logprobs.token_logprobs[0], lp.token_logprobs[-1], abs_tol=1e-5)
    assert r.choices[0].text.endswith(plain.choices[0].text)
    # max_tokens=0 with echo: the prompt alone
    only = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert only.usage.completion_tokens == 0


def test_completion_streaming_with_usage(client):
    stream = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, stream=True, temperature=0,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert text == full.choices[0].text


def test_chat_plain_and_streaming(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant" and c.finish_reason == "length"
    assert len(c.logprobs.content) == 4 and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
    assert r.usage.completion_tokens == 4 and r.usage.completion_tokens_details.reasoning_tokens == 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}, logprobs=True)
    chunks = list(stream)
    assert len({ch.id for ch in chunks}) == 1 and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    lps = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert [t.token for t in lps] == [t.token for t in c.logprobs.content]
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_thinking_reasoning_content(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=5,
                                       temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    # random weights never close </think> in 5 tokens: everything is reasoning, counted as such
    assert m.reasoning_content and m.content in ("", None) or "</think>" not in (m.content or "")
    assert r.usage.completion_tokens_details.reasoning_tokens == 5
    off = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}], max_tokens=2,
                                         temperature=0)
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    effort = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "2+2?"}],
                                            max_tokens=2, reasoning_effort="max")
    assert effort.usage.prompt_tokens > r.usage.prompt_tokens        # the max-effort preamble


def test_async_client_concurrent(aclient):
    async def main():
        chats = [aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"n{i}"}],
                                                 max_tokens=3, seed=i) for i in range(6)]
        comps = [aclient.completions.create(model=MODEL, prompt=f"p{i}", max_tokens=3) for i in range(6)]
        # ignore_eos: exactly max_tokens tokens, whatever a random draw is (the end token, stray markup)
        stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "s"}],
                                                       max_tokens=3, stream=True, extra_body={"ignore_eos": True})
        streamed = [c async for c in stream]
        return await asyncio.gather(*chats, *comps), streamed

    results, streamed = asyncio.run(main())
    assert all(r.usage.completion_tokens == 3 or r.choices[0].finish_reason == "stop" for r in results), \
        [(r.usage.completion_tokens, r.choices[0].finish_reason) for r in results]
    assert streamed[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("seed, first", [(422, "<｜end▁of▁sentence｜>"), (7, "</think>")])
def test_chat_ignore_eos_generates_past_the_end_token_and_stray_markup(client, seed, first):
    # On the tiny model these seeds draw the end token / a stray </think> first. Under ignore_eos neither
    # ends the choice: the parser never sees the end token, and text after bad markup is raw content.
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "s"}], max_tokens=3, seed=seed)
    extra = {"ignore_eos": True, "skip_special_tokens": False}
    r = client.chat.completions.create(**kwargs, logprobs=True, extra_body=extra)
    assert [e.token for e in r.choices[0].logprobs.content][0] == first        # the draw happened
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=extra))
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == r.choices[0].message.content
    plain = client.chat.completions.create(**kwargs, extra_body={"skip_special_tokens": False})
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens == 1   # without it: the end


@pytest.mark.parametrize("kwargs, status, param, words", [
    (dict(max_tokens=-1), 400, "max_tokens", "greater than or equal"),
    (dict(top_p=1.5), 400, "top_p", "less than or equal to 1"),
    (dict(model="nope"), 404, "model", "does not exist"),
    (dict(max_tokens=10_000), 400, "max_tokens", "max_model_len (512)"),
    (dict(messages=[]), 400, "messages", "non-empty"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", "Input should be"),
    (dict(messages=[{"role": "user", "content": "x"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "r"}]), 400, "messages", "invalid JSON"),
    (dict(messages=[{"role": "user", "content": "word " * 600}]), 400, "messages", "max_model_len is 512"),
    (dict(reasoning_effort="medium"), 400, "reasoning_effort", "'high' or 'max'"),
    (dict(tool_choice={"type": "function", "function": {"name": "g"}},
          tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tool_choice", "no tool named 'g'"),
    (dict(logit_bias={"x7": 1}), 400, "logit_bias", "keys must be token ids"),
    (dict(logit_bias={"7": 101}), 400, "logit_bias", "numbers in [-100, 100]"),
    (dict(logit_bias={"100000": 1}), 400, "logit_bias", "outside [0, "),
    (dict(extra_body={"min_tokens": 3}), 400, "min_tokens", "must be <= max_tokens (2)"),
    (dict(extra_body={"min_tokens": 1}, response_format={"type": "json_object"}), 400, "min_tokens",
     "the grammar decides"),
    (dict(extra_body={"allowed_token_ids": [5]}, response_format={"type": "json_object"}), 400,
     "allowed_token_ids", "the grammar decides"),
    (dict(extra_body={"stop_token_ids": list(range(65))}), 400, "stop_token_ids", "at most 64"),
    (dict(extra_body={"stop_token_ids": [3, 100000]}), 400, "stop_token_ids", "outside [0, "),
])
def test_chat_errors(client, kwargs, status, param, words):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == status
    err = e.value.body
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and words in err["message"], err


def test_logit_bias_and_min_tokens(client):
    """OpenAI's logit_bias (string keys) forces or bans a token, sampled or greedy, streamed or not;
    vLLM's min_tokens holds a stop token id back until then, even one the bias all but forces."""
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=4, logprobs=0)
    forced = client.completions.create(**ask, seed=3, logit_bias={"7": 100})
    tokens = forced.choices[0].logprobs.tokens
    assert len(tokens) == 4 and len(set(tokens)) == 1
    chunks = list(client.completions.create(**ask, temperature=0, logit_bias={"7": 100}, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == forced.choices[0].text
    greedy = client.completions.create(**ask, temperature=0).choices[0].logprobs.tokens
    banned = client.completions.create(**ask, temperature=0, logit_bias={"7": -100}).choices[0].logprobs.tokens
    assert tokens[0] not in banned and (tokens[0] in greedy or banned == greedy)
    stop = dict(ask, max_tokens=6, temperature=0, logit_bias={"7": 100}, extra_body={"stop_token_ids": [7]})
    at_once = client.completions.create(**stop)
    assert at_once.usage.completion_tokens == 1 and at_once.choices[0].finish_reason == "stop"
    held = client.completions.create(**{**stop, "extra_body": {"stop_token_ids": [7], "min_tokens": 3}})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    assert tokens[0] not in held.choices[0].logprobs.tokens[:3] and len(held.choices[0].logprobs.tokens) == 3
    shown = client.completions.create(**{**stop, "extra_body": {"stop_token_ids": [7], "include_stop_str_in_output": True}})
    assert shown.choices[0].logprobs.tokens == tokens[:1]      # the stop token's entry kept with its text
    # vLLM's allowed_token_ids: one id forces it, two give a draw of those two only
    t300 = client.completions.create(**ask, extra_body={"allowed_token_ids": [300]}).choices[0].logprobs.tokens
    assert len(set(t300)) == 1 and t300[0] != tokens[0]
    two = client.completions.create(**dict(ask, max_tokens=12), seed=5, extra_body={"allowed_token_ids": [7, 300]})
    assert set(two.choices[0].logprobs.tokens) == {tokens[0], t300[0]}


def test_vllm_stop_usage_and_truncation_extras(client):
    """include_stop_str_in_output, stream_options.continuous_usage_stats, truncate_prompt_tokens."""
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    text = base.choices[0].text
    stop = text[2:4]
    cut = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    first = text.find(stop)
    assert cut.choices[0].text == text[:first] and kept.choices[0].text == text[:first + len(stop)]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop and base.choices[0].model_extra["stop_reason"] is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                                 max_tokens=4, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True, "stop_token_ids": [7],
                                                             "logit_bias": {"7": 100}}))
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] == 7
    for create, kw in ((client.completions.create, dict(prompt="Hello")),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "Hello"}]))):
        chunks = list(create(model=MODEL, max_tokens=4, temperature=0, stream=True, **kw, extra_body={"ignore_eos": True},
                             stream_options={"include_usage": True, "continuous_usage_stats": True}))
        used = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None for c in chunks) and used == sorted(used) and used[-1] == 4
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        plain = list(create(model=MODEL, max_tokens=4, temperature=0, stream=True, **kw,
                            stream_options={"include_usage": True}))
        assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None
    ids = [5, 6, 7, 8, 9, 10, 11, 12]
    short = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=0,
                                      extra_body={"truncate_prompt_tokens": 3})
    tail = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=3, temperature=0, logprobs=0)
    assert short.usage.prompt_tokens == 3 and short.choices[0].text == tail.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 40}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": 7})
    assert chat.usage.prompt_tokens == 7


def test_continue_final_message_goes_on_from_the_prefix(client, served):
    """vLLM's continue_final_message: the answer continues the last assistant message; its tokens are
    the greedy continuation of the rendered prompt, which ends in the message's text (no end token)."""
    convo = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2,"}]
    r = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=4, temperature=0, logprobs=True,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                   "ignore_eos": True})
    prompt = "<｜begin▁of▁sentence｜><｜User｜>Count.<｜Assistant｜></think>1, 2,"
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True})
    assert [e.token for e in r.choices[0].logprobs.content] == raw.choices[0].logprobs.tokens
    assert r.usage.prompt_tokens == raw.usage.prompt_tokens
    for extra, param in (({"continue_final_message": True}, "continue_final_message"),
                         ({"add_generation_prompt": False}, "add_generation_prompt"),
                         ({"continue_final_message": True, "add_generation_prompt": False,
                           "response_format": {"type": "json_object"}}, "continue_final_message")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=convo, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=convo[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "needs an assistant message last" in e.value.body["message"]


@pytest.mark.parametrize("route, field, value", [
    ("chat", "use_beam_search", True), ("completions", "bad_words", ["x"]), ("chat", "allowed_token_ids", []),
    ("completions", "guided_json", {"type": "object"}), ("chat", "echo", True), ("completions", "prompt_logprobs", 1),
    ("chat", "truncate_prompt_tokens", 0),
])
def test_vllm_fields_not_implemented_are_refused_by_name(client, route, field, value):
    create = client.chat.completions.create if route == "chat" else client.completions.create
    kw = dict(messages=[{"role": "user", "content": "hi"}]) if route == "chat" else dict(prompt="hi")
    with pytest.raises(openai.BadRequestError) as e:
        create(model=MODEL, max_tokens=2, **kw, extra_body={field: value})
    assert e.value.body["param"] == field and field in e.value.body["message"]
    # the same fields at their defaults (as SDKs and vLLM clients send them) are fine
    if field in ("use_beam_search", "echo"):
        create(model=MODEL, max_tokens=1, **kw, extra_body={field: False})


def test_prompt_too_long_names_both_lengths(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600, max_tokens=1)
    assert "600 tokens" in e.value.body["message"] and "512" in e.value.body["message"]
    assert e.value.body["code"] == "context_length_exceeded"


def test_http_errors_shape(served):
    url = served.url
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.get(url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_bodies_that_are_not_utf8_json_get_a_400_saying_so(served):
    url, body = served.url, '{"model": "tiny", "prompt": "café", "max_tokens": 1}'
    json_header = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        for content, headers, words in (
                (body.encode("latin-1"), json_header, ["not valid UTF-8", "0xe9"]),
                (body.encode("utf-16"), json_header, ["not valid UTF-8"]),
                (body.encode(), {}, ["no Content-Type", "application/json"]),
                (body.encode(), {"content-type": "text/plain"}, ["application/json", "text/plain"]),
                (b"", json_header, ["empty body"])):
            r = httpx.post(url + path, content=content, headers=headers)
            error = r.json()["error"]
            assert r.status_code == 400 and error["type"] == "invalid_request_error", (path, r.text)
            assert all(w in error["message"] for w in words), (path, error)
    r = httpx.post(url + "/v1/completions", content=body.encode(), headers={"content-type": "application/json; "
                                                                                           "charset=utf-8"})
    assert r.status_code == 200


def test_tokenizer_routes(served):
    url = served.url
    t = httpx.post(url + "/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()
    assert t["count"] == len(t["tokens"]) and t["max_model_len"] == 512
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hello there"}
    with_bos = httpx.post(url + "/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    assert with_bos == [0] + t["tokens"]
    chat = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    text = httpx.post(url + "/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    info = httpx.get(url + "/tokenizer_info").json()
    assert info["eos_token"] == "<｜end▁of▁sentence｜>"
    assert httpx.post(url + "/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_metrics_and_health(served, client):
    client.completions.create(model=MODEL, prompt="m", max_tokens=2)
    page = httpx.get(served.url + "/metrics").text
    for name in ("dsv4_num_requests_running", "dsv4_num_requests_waiting", "dsv4_slots_used", "dsv4_slot_usage_ratio",
                 "dsv4_prompt_tokens_total", "dsv4_generation_tokens_total", "dsv4_time_to_first_token_seconds_count",
                 "dsv4_inter_token_latency_seconds_count", "dsv4_e2e_request_latency_seconds_count"):
        metric(page, name)
    assert metric(page, "dsv4_generation_tokens_total") >= 2 and metric(page, "dsv4_slots_total") == 16
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["slots_total"] == 16
    assert "completion cmpl-" in served.log() and "ttft" in served.log()


def test_a_non_streaming_client_that_hangs_up_frees_its_slot(served):
    name = 'dsv4_requests_finished_total{finish_reason="abort",model_name="tiny"}'

    def aborted() -> float:
        try:
            return metric(httpx.get(served.url + "/metrics").text, name)
        except KeyError:
            return 0.0

    before = aborted()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.5),
                   json={"model": MODEL, "prompt": "x", "max_tokens": 400, "ignore_eos": True})
    for _ in range(100):
        health = httpx.get(served.url + "/health").json()
        if health["slots_used"] == 0 and aborted() == before + 1:
            break
        time.sleep(0.05)
    assert health["slots_used"] == 0 and aborted() == before + 1


def test_every_role_response_format_and_penalties(client, served):
    from dsv4.text.chat import encode_messages
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                {"role": "user", "content": [{"type": "text", "text": "U1"}, {"type": "text", "text": "U2"}]},
                {"role": "assistant", "content": "A"}, {"role": "user", "content": "U3"},
                {"role": "latest_reminder", "content": "R"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, response_format=fmt,
                                       frequency_penalty=1.5, presence_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.3, "top_k": 5, "min_p": 0.1})
    assert r.choices[0].finish_reason in ("length", "stop")
    # the server's prompt is the DSV4 encoding of the same conversation (text parts joined)
    plain = [{**m, "content": "U1\n\nU2"} if isinstance(m["content"], list) else m for m in messages]
    want = encode_messages(plain, response_format=fmt)
    ids = httpx.post(served.url + "/tokenize", json={"prompt": want, "add_special_tokens": False}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids)


def test_events_survive_clients_that_split_lines_on_unicode_line_breaks():
    """Model text may hold U+2028, U+2029 or U+0085, which JSON may carry raw but ``str.splitlines``
    (httpx's ``iter_lines``, which many streaming clients read events with) breaks lines at: every
    event escapes them, so each event stays one line and decodes to the same text."""
    import json

    from httpx._decoders import LineDecoder

    from dsv4.serve.serving_common import sse
    from dsv4.serve.serving_messages import _event
    text = "a\u2028b\u2029c\x85d \\u2028 \u00e9\u4e2d"
    for event in (sse({"choices": [{"delta": {"content": text}}]}), _event("content_block_delta", {"text": text})):
        lines = [line for line in LineDecoder().decode(event) if line.startswith("data: ")]
        assert len(lines) == 1, lines
        data = json.loads(lines[0][6:])
        assert (data.get("text") or data["choices"][0]["delta"]["content"]) == text
        assert "\u00e9\u4e2d" in lines[0]                 # other text stays UTF-8
