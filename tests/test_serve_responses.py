"""`POST /v1/responses` (OpenAI's Responses API) with the official `openai` client against `dsv4 serve`
(the tiny model): the same prompt as the chat route for the same conversation, streamed events, reasoning,
function calls and their outputs through `previous_response_id`, the store, JSON output, errors."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(served_long):
    return openai.OpenAI(base_url=served_long.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_tokens(client, messages, **kw):
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, logprobs=True, **kw)
    return r, [e.token for e in r.choices[0].logprobs.content]


def test_input_items_make_the_chat_routes_prompt(client):
    """Instructions, messages, an assistant's function call and its output: the prompt the chat route
    makes of the same conversation (same length, same greedy answer)."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
             {"role": "user", "content": "And tomorrow?"}]
    r = client.responses.create(model=MODEL, input=items, instructions="Be brief.", tools=[WEATHER],
                                max_output_tokens=6, temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"}]
    tool = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
    chat, _ = _chat_tokens(client, messages, tools=[tool], max_tokens=6)
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.output_text == (chat.choices[0].message.content or "")
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_stream_events_in_order_and_the_same_answer(client):
    kw = dict(model=MODEL, input="Tell me a story.", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed" and types[-2] == "response.output_item.done"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == whole.output_text
    assert [e.text for e in events if e.type == "response.output_text.done"] == [text]
    assert final.usage.output_tokens == whole.usage.output_tokens == 8 and final.status == whole.status


@pytest.mark.parametrize("effort, thinking", [("high", True), ("low", True), ("minimal", False)])
def test_reasoning_effort_turns_thinking_on(client, effort, thinking):
    # greedy: a sampled answer of the random tiny model may draw </think> within its 5 tokens (one CI
    # run in many did); the greedy one does not
    r = client.responses.create(model=MODEL, input="2+2?", max_output_tokens=5, reasoning={"effort": effort},
                                temperature=0)
    kinds = [o.type for o in r.output]
    if thinking:       # all 5 tokens are reasoning
        assert kinds == ["reasoning"] and r.usage.output_tokens_details.reasoning_tokens == 5
        assert r.output[0].content[0].text
    else:
        assert "reasoning" not in kinds and r.usage.output_tokens_details.reasoning_tokens == 0


def test_function_call_round_trip_and_the_store(client):
    """A forced call comes back as a function_call item; its output continues the stored response
    (the conversation grows by the answer and the output); GET reads it, DELETE drops it."""
    first = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=200)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    named = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=200,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [o.type for o in named.output if o.type == "function_call"]
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=3,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}])
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_streamed_function_call_events(client):
    """A forced call streamed: its item added (empty arguments), the arguments' delta and done events,
    the item done; the final response's call equals the non-streamed one's (greedy)."""
    kw = dict(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice="required", max_output_tokens=200,
              temperature=0)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert calls and calls[0].item.arguments == ""
    item_id = calls[0].item.id
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.item_id == item_id)
    done = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == item_id]
    assert done and done[0].arguments == deltas and json.loads(deltas)
    got = [(o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert got == [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert final.status == "completed"


def test_a_stored_conversation_is_never_changed(client):
    """Two continuations of one stored response: the first starts with a function call (which joins the
    stored answer's turn in its own prompt), and the second sees the stored conversation as it was."""
    first = client.responses.create(model=MODEL, input="hi", max_output_tokens=3, temperature=0)
    before = client.responses.create(model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=1)
    client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=1, input=[
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": "rain"}])
    after = client.responses.create(model=MODEL, previous_response_id=first.id, input="again", max_output_tokens=1)
    assert after.usage.input_tokens == before.usage.input_tokens


def test_json_schema_output_is_enforced(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="A number as JSON.", max_output_tokens=64,
                                text={"format": {"type": "json_schema", "name": "num", "schema": schema}})
    assert isinstance(json.loads(r.output_text)["n"], int)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(tools=[{"type": "web_search"}]), "tools", "only function tools"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input",
     "only text parts"),
    (dict(input=[{"type": "item_reference", "id": "x"}]), "input", "'item_reference' items are not supported"),
    (dict(input=[{"type": "function_call_output", "call_id": "nope", "output": "x"}]), "input", "nope"),
    (dict(background=True), "background", "not supported"),
    (dict(reasoning={"effort": "huge"}), "reasoning", "reasoning.effort"),
    (dict(extra_body={"conversation": "conv_1"}), "conversation", "Conversations API"),
    (dict(text={"format": {"type": "yaml"}}), "text", "text.format.type"),
])
def test_errors_name_the_field(client, kwargs, param, words):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**body)
    assert e.value.body["param"] == param and words in e.value.body["message"], e.value.body
