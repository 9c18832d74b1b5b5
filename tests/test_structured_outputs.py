"""Structured outputs through `dsv4 serve` with the official `openai` client, on the tiny random model.

Random weights never write JSON or DSML on their own, so every valid answer here is the grammar's
doing: `chat.completions.parse` with a pydantic model, `response_format` json_object, vLLM's
`structured_outputs` (regex, choice, grammar), and `tool_choice` "required" or named (arguments that
validate against the tool's schema), with thinking on and off, streaming and not. Bad schemas and
grammars are 400s naming the field, before anything runs.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")


class Person(pydantic.BaseModel):
    name: str
    age: int
    member: bool
    role: Literal["admin", "user"]
    tags: list[str]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "days"], "additionalProperties": False}, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"]}}}
THINKING = {"chat_template_kwargs": {"thinking": True}}


@pytest.fixture(scope="module")
def client(served_long):
    return openai.OpenAI(base_url=served_long.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _valid_call(call, tools) -> dict:
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    assert set(args) <= set(schema["properties"]) and set(schema.get("required", [])) <= set(args)
    for key, value in args.items():
        sub = schema["properties"][key]
        if "enum" in sub:
            assert value in sub["enum"]
        elif sub.get("type") == "integer":
            assert isinstance(value, int) and value >= sub.get("minimum", value)
        elif sub.get("type") == "string":
            assert isinstance(value, str) and len(value) <= sub.get("maxLength", len(value))
    return args


@pytest.mark.parametrize("thinking", [False, True], ids=["chat", "thinking"])
def test_parse_gives_a_valid_object_every_time(client, thinking):
    """Four seeded choices a request, under a token limit: closing mode finishes each object in time."""
    done = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
        n=4, seed=7, temperature=1.0, max_tokens=200, extra_body=THINKING if thinking else None)
    assert len(done.choices) == 4
    for choice in done.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person), choice.message.content
        if thinking:       # the reasoning is free and apart; the JSON is the answer after </think>
            assert choice.message.content.startswith("{") and choice.message.reasoning_content


def test_json_object_and_streaming(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON please"}], stream=True, seed=3,
        response_format={"type": "json_object"}, max_tokens=120)
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_extra_in_completions_and_chat(client):
    out = client.completions.create(model="tiny", prompt="The code is", max_tokens=40, seed=1,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "pick"}], seed=2,
                                          extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert chat.choices[0].message.content in ("red", "green", "blue")
    lark = 'start: "x=" NUM ";"\nNUM: /[1-9][0-9]?/'
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "set x"}], seed=4,
                                          extra_body={"structured_outputs": {"grammar": lark}})
    assert re.fullmatch(r"x=[1-9][0-9]?;", chat.choices[0].message.content)
    out = client.completions.create(model="tiny", prompt="{", max_tokens=60, seed=5, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}})
    assert isinstance(json.loads(out.choices[0].text)["n"], int)


def _forced_call(client, stream: bool, thinking: bool, seed: int, choice):
    """(finish_reason, tool calls) of one forced request, streamed or whole."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, TIME],
                  tool_choice=choice, seed=seed, max_tokens=160, extra_body=THINKING if thinking else None)
    if not stream:
        out = client.chat.completions.create(**kwargs).choices[0]
        return out.finish_reason, out.message.tool_calls
    parts, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = parts.setdefault(tc.index, {"name": None, "arguments": ""})
            entry["name"] = tc.function.name or entry["name"]
            entry["arguments"] += tc.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    return finish, [openai.types.chat.ChatCompletionMessageToolCall(
        id="x", type="function", function={"name": p["name"], "arguments": p["arguments"]}) for p in parts.values()]


FORCED = [(stream, thinking, choice) for stream in (False, True) for thinking in (False, True)
          for choice in ("required", {"type": "function", "function": {"name": "get_time"}})]


@pytest.fixture(scope="module")
def forced_results(client):
    """Every forced-tool case at once (the server batches them)."""
    with ThreadPoolExecutor(len(FORCED)) as pool:
        futures = [pool.submit(_forced_call, client, stream, thinking, seed, choice)
                   for seed, (stream, thinking, choice) in enumerate(FORCED)]
        return [f.result() for f in futures]


@pytest.mark.parametrize("case", range(len(FORCED)),
                         ids=[f"{'stream' if s else 'whole'}-{'thinking' if t else 'chat'}-{'required' if c == 'required' else 'named'}"
                              for s, t, c in FORCED])
def test_forced_tool_calls_are_valid(forced_results, case):
    finish, calls = forced_results[case]
    assert finish == "tool_calls" and calls
    for call in calls:
        _valid_call(call, [WEATHER, TIME])
    if FORCED[case][2] != "required":
        assert [c.function.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"structured_outputs": {"grammar": "start: x +"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_bad_constraints_are_400s_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body=body)
    assert e.value.body["param"] == param, e.value.body
    assert e.value.body["message"].startswith(param), e.value.body
