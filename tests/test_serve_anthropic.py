"""`POST /v1/messages` with the official `anthropic` client against `dsv4 serve` (the tiny model).

Create and stream, thinking blocks, stop sequences, usage, a forced tool call and the tool-use round
trip (tool_use in an assistant turn, tool_result in the next user turn), and errors in Anthropic's
shape. Random weights write no tool calls of their own, so the tool_use blocks come from
``tool_choice`` ``any`` / ``tool`` (the grammar of the chat route).
"""

from __future__ import annotations

import httpx
import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")

MODEL = "tiny"
WEATHER = {"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"]}}


@pytest.fixture(scope="module")
def client(served_long):
    return anthropic.Anthropic(base_url=served_long.url, api_key="unused", max_retries=0, timeout=120)


def test_create_text_with_usage_and_stop_sequence(client):
    msg = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.",
                                 messages=[{"role": "user", "content": "Tell me a story."}],
                                 extra_body={"temperature": 0.8, "top_k": 50})
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 12
    assert all(b.type == "text" for b in msg.content)
    # a stop sequence the greedy answer is sure to hold: two of its characters
    again = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body={"temperature": 0},
                                   messages=[{"role": "user", "content": "Tell me a story."}])
    text = "".join(b.text for b in again.content)
    assert again.stop_reason == "max_tokens" and len(text) > 4, again
    stop = text[2:4]
    cut = client.messages.create(model=MODEL, max_tokens=12, system="Be brief.", extra_body={"temperature": 0},
                                 stop_sequences=[stop], messages=[{"role": "user", "content": "Tell me a story."}])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert "".join(b.text for b in cut.content) == text[:text.index(stop)]


def test_stream_events_and_final_message(client):
    names = []
    # greedy: sampled, the random tiny model's first token was sometimes the end of the reasoning,
    # leaving no thinking block (a flaky failure in CI)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": "Hi"}],
                                thinking={"type": "enabled", "budget_tokens": 6},
                                extra_body={"temperature": 0}) as stream:
        for event in stream:
            names.append(event.type)
        final = stream.get_final_message()
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert "message_delta" in names and "content_block_start" in names and "content_block_stop" in names
    assert final.content[0].type == "thinking"         # the reasoning, capped at 6 tokens by the budget
    assert final.usage.output_tokens <= 16 and final.stop_reason in ("end_turn", "max_tokens")


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_tool_use_round_trip(client, stream):
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    kwargs = dict(model=MODEL, max_tokens=150, tools=[WEATHER], messages=messages,
                  tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = client.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    assert isinstance(calls[0].input["city"], str) and len(calls[0].input["city"]) <= 12
    assert isinstance(calls[0].input["days"], int)
    # the round trip: the assistant turn with its tool_use, then the tool_result
    follow = client.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=messages + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "Sunny, 21 C"}]}])
    assert follow.stop_reason in ("end_turn", "max_tokens") and follow.usage.input_tokens > msg.usage.input_tokens


def test_a_final_assistant_message_is_a_prefill(client, served_long):
    """Anthropic's prefill: the answer continues the final assistant message (only the new text comes
    back), the same tokens as the chat route's continue_final_message; refused with thinking or
    trailing white space."""
    import openai
    convo = [{"role": "user", "content": "Give me JSON."}, {"role": "assistant", "content": 'Here: {"a":'}]
    msg = client.messages.create(model=MODEL, max_tokens=5, messages=convo, extra_body={"temperature": 0})
    chat = openai.OpenAI(base_url=served_long.url + "/v1", api_key="unused", max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=5, temperature=0, messages=convo,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert msg.content[0].text == chat.choices[0].message.content and msg.usage.output_tokens == 5
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    for bad, words in (({"thinking": {"type": "enabled", "budget_tokens": 16}}, "thinking enabled"),
                       ({"messages": [convo[0], {"role": "assistant", "content": "Here: "}]}, "trailing whitespace")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{"model": MODEL, "max_tokens": 64, "messages": convo, **bad})
        assert words in e.value.body["error"]["message"]


def test_errors_in_anthropic_shape(client, served_long):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "x"}],
                               tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    assert "no tool named 'nope'" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(served_long.url + "/v1/messages", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
