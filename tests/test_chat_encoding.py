"""Golden tests for `encode_messages`: one per rule of DSV4_FACTS section 6.

Expected prompts are written out by hand; the special strings are spelled literally so a
reader can compare them with the facts page character by character.
"""

from __future__ import annotations

import json

import pytest

from dsv4.text import ChatFormatError, Tokenizer, encode_messages, write_tiny_tokenizer
from dsv4.text.chat import REASONING_EFFORT_MAX_PREAMBLE, RESPONSE_FORMAT_INSTRUCTIONS, TOOLS_INSTRUCTIONS


def sys_(text):
    return {"role": "system", "content": text}


def user(text):
    return {"role": "user", "content": text}


def asst(content, reasoning=None, tool_calls=None):
    msg = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls is not None:
        msg["tool_calls"] = tool_calls
    return msg


def call(call_id, name, arguments):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def tool(call_id, content):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
WEATHER_SCHEMA = (
    '{"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}'
)
TIME_SCHEMA = '{"name": "now", "parameters": {"type": "object", "properties": {}}}'
TWO_TURNS = [sys_("S"), user("U1"), asst("A1", reasoning="R1"), user("U2")]


# ---------------------------------------------------------------- chat / thinking / reasoning


def test_facts_example_verbatim():
    expected = "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜></think>"
    assert encode_messages([sys_("S"), user("U1"), asst("A1"), user("U2")]) == expected


def test_chat_mode_ignores_reasoning():
    expected = "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜></think>"
    assert encode_messages(TWO_TURNS) == expected
    assert encode_messages(TWO_TURNS, drop_thinking=False) == expected


def test_single_user_turn_chat_and_thinking():
    assert encode_messages([user("hi")]) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    assert encode_messages([user("hi")], thinking=True) == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"


def test_thinking_drops_reasoning_before_last_user():
    expected = "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜><｜User｜>U2<｜Assistant｜><think>"
    assert encode_messages(TWO_TURNS, thinking=True) == expected


def test_thinking_keeps_reasoning_when_drop_thinking_false():
    expected = (
        "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>U2<｜Assistant｜><think>"
    )
    assert encode_messages(TWO_TURNS, thinking=True, drop_thinking=False) == expected


def test_thinking_keeps_reasoning_after_last_user():
    msgs = [user("U1"), asst("A1", reasoning="R1"), user("U2"), asst("A2", reasoning="R2")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>U2<｜Assistant｜><think>R2</think>A2<｜end▁of▁sentence｜>"
    )
    assert encode_messages(msgs, thinking=True) == expected
    assert encode_messages(msgs, thinking=True, add_generation_prompt=False) == expected


def test_kept_reasoning_may_be_empty():
    expected = "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜><think></think>A<｜end▁of▁sentence｜>"
    assert encode_messages([user("U"), asst("A")], thinking=True) == expected


def test_multi_turn_chat():
    msgs = [sys_("Be brief."), user("1+1?"), asst("2"), user("2+2?"), asst("4"), user("thanks")]
    expected = (
        "<｜begin▁of▁sentence｜>Be brief.<｜User｜>1+1?<｜Assistant｜></think>2<｜end▁of▁sentence｜>"
        "<｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜><｜User｜>thanks<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_no_generation_prompt():
    assert encode_messages([sys_("S"), user("U")], add_generation_prompt=False) == "<｜begin▁of▁sentence｜>S<｜User｜>U"


def test_consecutive_user_messages_share_one_turn():
    expected = "<｜begin▁of▁sentence｜><｜User｜>a\n\nb<｜Assistant｜></think>"
    assert encode_messages([user("a"), user("b")]) == expected


def test_system_text_is_raw_and_multiline():
    expected = "<｜begin▁of▁sentence｜>line 1\nline 2<｜User｜>u<｜Assistant｜></think>"
    assert encode_messages([sys_("line 1\nline 2"), user("u")]) == expected


# ---------------------------------------------------------------- reasoning effort


def test_max_reasoning_effort_preamble_only_in_thinking_mode():
    body = "S<｜User｜>U<｜Assistant｜>"
    msgs = [sys_("S"), user("U")]
    got = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert got == "<｜begin▁of▁sentence｜>" + REASONING_EFFORT_MAX_PREAMBLE + body + "<think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == "<｜begin▁of▁sentence｜>" + body + "<think>"
    assert encode_messages(msgs, reasoning_effort="max") == "<｜begin▁of▁sentence｜>" + body + "</think>"
    assert REASONING_EFFORT_MAX_PREAMBLE.endswith("\n\n")
    with pytest.raises(ValueError, match="reasoning_effort"):
        encode_messages(msgs, thinking=True, reasoning_effort="extreme")


# ---------------------------------------------------------------- tools and response format


def test_tools_section_appended_to_system_text():
    got = encode_messages([sys_("S"), user("U")], tools=[WEATHER_TOOL, TIME_TOOL])
    expected = (
        "<｜begin▁of▁sentence｜>S\n\n## Tools\n\n" + TOOLS_INSTRUCTIONS + "\n\n"
        + WEATHER_SCHEMA + "\n" + TIME_SCHEMA + "<｜User｜>U<｜Assistant｜></think>"
    )
    assert got == expected


def test_tools_instructions_describe_the_dsml_format():
    for piece in ["<｜DSML｜tool_calls>", '<｜DSML｜invoke name="', '<｜DSML｜parameter name="', 'string="true', "</｜DSML｜tool_calls>"]:
        assert piece in TOOLS_INSTRUCTIONS


def test_tools_without_system_message():
    got = encode_messages([user("U")], tools=[TIME_TOOL])
    expected = "<｜begin▁of▁sentence｜>## Tools\n\n" + TOOLS_INSTRUCTIONS + "\n\n" + TIME_SCHEMA + "<｜User｜>U<｜Assistant｜></think>"
    assert got == expected


def test_response_format_section():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    got = encode_messages([sys_("S"), user("U")], response_format=fmt)
    expected = (
        "<｜begin▁of▁sentence｜>S\n\n## Response Format\n\n" + RESPONSE_FORMAT_INSTRUCTIONS
        + '\n{"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}'
        + "<｜User｜>U<｜Assistant｜></think>"
    )
    assert got == expected


def test_tools_then_response_format():
    got = encode_messages([sys_("S"), user("U")], tools=[TIME_TOOL], response_format={"type": "json_object"})
    expected = (
        "<｜begin▁of▁sentence｜>S\n\n## Tools\n\n" + TOOLS_INSTRUCTIONS + "\n\n" + TIME_SCHEMA
        + "\n\n## Response Format\n\n" + RESPONSE_FORMAT_INSTRUCTIONS + '\n{"type": "json_object"}'
        + "<｜User｜>U<｜Assistant｜></think>"
    )
    assert got == expected


def test_tool_call_markup_every_parameter_type():
    args = {"s": "Paris, FR", "i": 3, "f": 2.5, "b": False, "n": None, "l": [1, "x"], "d": {"k": "東京"}}
    msgs = [user("U"), asst("Checking.", tool_calls=[call("c1", "f", args), call("c2", "now", "{}")])]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>Checking.\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="s" string="true">Paris, FR</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="i" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="f" string="false">2.5</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="b" string="false">false</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">null</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="l" string="false">[1, "x"]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="d" string="false">{"k": "東京"}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="now">\n'
        "\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
    )
    assert encode_messages(msgs) == expected
    # arguments as a JSON string or as a dict encode the same
    as_json = [user("U"), asst("Checking.", tool_calls=[call("c1", "f", json.dumps(args)), call("c2", "now", {})])]
    assert encode_messages(as_json) == expected


def test_missing_or_empty_arguments_mean_no_parameters():
    expected = encode_messages([user("U"), asst("", tool_calls=[call("a", "now", {})])])
    for args in (None, "", "  "):
        assert encode_messages([user("U"), asst("", tool_calls=[call("a", "now", args)])]) == expected


def test_tool_results_follow_call_order_and_keep_reasoning_with_tools():
    calls = [call("a", "get_weather", {"city": "Oslo"}), call("b", "now", {})]
    msgs = [
        sys_("S"),
        user("Weather and time?"),
        asst("", reasoning="two tools", tool_calls=calls),
        tool("b", "12:00"),  # results arrive out of order
        tool("a", "rain"),
        asst("Rain, noon.", reasoning="done"),
        user("Thanks"),
    ]
    expected = (
        "<｜begin▁of▁sentence｜>S\n\n## Tools\n\n" + TOOLS_INSTRUCTIONS + "\n\n" + WEATHER_SCHEMA + "\n" + TIME_SCHEMA
        + "<｜User｜>Weather and time?<｜Assistant｜><think>two tools</think>\n\n"
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="city" string="true">Oslo</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n'
        "</｜DSML｜tool_calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>rain</tool_result>\n\n<tool_result>12:00</tool_result>"
        "<｜Assistant｜><think>done</think>Rain, noon.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks<｜Assistant｜><think>"
    )
    assert encode_messages(msgs, thinking=True, tools=[WEATHER_TOOL, TIME_TOOL]) == expected


def test_tool_history_without_tools_drops_old_reasoning():
    calls = [call("a", "now", {})]
    msgs = [user("time?"), asst("", reasoning="call it", tool_calls=calls), tool("a", "noon"), asst("Noon.", reasoning="r2")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>time?<｜Assistant｜></think>\n\n"
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>'
        "<｜User｜><tool_result>noon</tool_result><｜Assistant｜><think>r2</think>Noon.<｜end▁of▁sentence｜>"
    )
    assert encode_messages(msgs, thinking=True) == expected


def test_tool_results_merge_with_following_user_text():
    msgs = [user("go"), asst("", tool_calls=[call("x", "now", {})]), tool("x", "noon"), user("and tomorrow?")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>\n\n"
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>'
        "<｜User｜><tool_result>noon</tool_result>\n\nand tomorrow?<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_prompt_tokenizes_with_single_special_ids(tmp_path):
    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path, 512))
    msgs = [sys_("S"), user("U"), asst("", tool_calls=[call("a", "now", {"tz": "UTC"})]), tool("a", "noon")]
    prompt = encode_messages(msgs, thinking=True, tools=[TIME_TOOL])
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and tok.decode(ids) == prompt
    assert ids[-2:] == [tok.special_id("<｜Assistant｜>"), tok.special_id("<think>")]
    assert ids.count(tok.eos_id) == 1 and ids.count(tok.special_id("<｜User｜>")) == 2


# ---------------------------------------------------------------- malformed messages


@pytest.mark.parametrize(
    "messages, match",
    [
        ([user("u"), {"role": "developer", "content": "x"}], r"messages\[1\]\.role"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        (["hello"], r"messages\[0\]\.role"),
        ([user("u"), tool("a", "r")], r"messages\[1\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("zz", "r")], r"messages\[2\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", "r"), tool("a", "r")], r"messages\[3\]\.tool_call_id.*duplicate"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), asst("x"), tool("a", "r")], r"messages\[3\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", None)], r"messages\[2\]\.content"),
        ([user(["part"])], r"messages\[0\]\.content"),
        ([sys_(None), user("u")], r"messages\[0\]\.content"),
        ([user("u"), asst(42)], r"messages\[1\]\.content"),
        ([user("u"), asst("a", reasoning=7)], r"messages\[1\]\.reasoning_content"),
        ([user("u"), asst("", tool_calls=[call("a", "f", "{bad json")])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([user("u"), asst("", tool_calls=[call("a", "f", "[1, 2]")])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([user("u"), asst("", tool_calls=[call("a", "", {})])], r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
        ([user("u"), asst("", tool_calls=[{"id": "a"}])], r"messages\[1\]\.tool_calls\[0\]\.function"),
        ([user("u"), asst("", tool_calls="nope")], r"messages\[1\]\.tool_calls"),
        ([user("u"), asst("", tool_calls=[call("a", "f", {"x": {1, 2}})])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([user("u"), asst("", tool_calls=[call("a", "f", {'a"b': 1})])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
    ],
)
def test_malformed_messages_raise_chat_format_error(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        encode_messages(messages)


def test_bad_tools_and_response_format():
    with pytest.raises(ChatFormatError, match=r"tools\[1\]"):
        encode_messages([user("u")], tools=[TIME_TOOL, {"type": "function"}])
    with pytest.raises(ChatFormatError, match="response_format"):
        encode_messages([user("u")], response_format="json")
    assert issubclass(ChatFormatError, ValueError)
