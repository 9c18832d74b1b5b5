"""Golden tests for `encode_messages`: one per rule of DSV4_FACTS sections 6 and 6b.

Expected prompts are written out by hand from the facts page, never built from the encoder's
own constants: the trained prose below is 6b's text with its placeholders filled in by hand, and
the special strings are spelled literally, so a reader can compare them character by character.
"""

from __future__ import annotations

import json

import pytest

from dsv4.text import ChatFormatError, Tokenizer, encode_messages, write_tiny_tokenizer

BOS = "<｜begin▁of▁sentence｜>"

# DSV4_FACTS 6b, TOOLS_TEMPLATE with {dsml_token} = ｜DSML｜, {thinking_start_token} = <think>,
# {thinking_end_token} = </think>; the schemas go between these two pieces.
TOOLS_BEFORE_SCHEMAS = (
    "## Tools\n"
    "\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n'
    "\n"
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n"
    "\n"
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n'
    "\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n"
    "\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n"
    "\n"
    "### Available Tool Schemas\n"
    "\n"
)
TOOLS_AFTER_SCHEMAS = "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n"
    "\n"
)
RESPONSE_FORMAT_BEFORE_SCHEMA = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"


def tools_section(*schemas: str) -> str:
    """The section as appended to a system message: a blank line, then the filled template."""
    return "\n\n" + TOOLS_BEFORE_SCHEMAS + "\n".join(schemas) + TOOLS_AFTER_SCHEMAS


def format_section(schema: str) -> str:
    return "\n\n" + RESPONSE_FORMAT_BEFORE_SCHEMA + schema


def sys_(text, **fields):
    return {"role": "system", "content": text, **fields}


def dev(text, **fields):
    return {"role": "developer", "content": text, **fields}


def user(text):
    return {"role": "user", "content": text}


def reminder(text):
    return {"role": "latest_reminder", "content": text}


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
JSON_OBJECT = {"type": "json_object"}
TWO_TURNS = [sys_("S"), user("U1"), asst("A1", reasoning="R1"), user("U2")]
NOW_CALL_MARKUP = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'


# ---------------------------------------------------------------- chat / thinking / history


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


def test_continue_final_message_leaves_the_assistant_turn_open():
    msgs = [user("U1"), asst("A1"), user("U2"), asst('Sure: {"a"', reasoning="R2")]
    assert encode_messages(msgs, continue_final_message=True) == (
        "<｜begin▁of▁sentence｜><｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        '<｜User｜>U2<｜Assistant｜></think>Sure: {"a"')
    assert encode_messages(msgs, thinking=True, continue_final_message=True).endswith(
        '<｜User｜>U2<｜Assistant｜><think>R2</think>Sure: {"a"')            # the reasoning closed before it
    assert encode_messages([user("U"), asst(None)], continue_final_message=True).endswith("<｜Assistant｜></think>")
    with pytest.raises(ChatFormatError, match=r"messages\[0\]\.role: continuing the final message needs an "
                                              r"assistant message last, got 'user'"):
        encode_messages([user("U")], continue_final_message=True)
    call = {"id": "c", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    with pytest.raises(ChatFormatError, match=r"messages\[1\]\.tool_calls: a message to continue cannot carry"):
        encode_messages([user("U"), {**asst("A"), "tool_calls": [call]}], continue_final_message=True)


def test_no_generation_prompt():
    assert encode_messages([sys_("S"), user("U")], add_generation_prompt=False) == "<｜begin▁of▁sentence｜>S<｜User｜>U"


def test_consecutive_user_messages_share_one_turn():
    expected = "<｜begin▁of▁sentence｜><｜User｜>a\n\nb<｜Assistant｜></think>"
    assert encode_messages([user("a"), user("b")]) == expected


def test_system_text_is_raw_and_multiline():
    expected = "<｜begin▁of▁sentence｜>line 1\nline 2<｜User｜>u<｜Assistant｜></think>"
    assert encode_messages([sys_("line 1\nline 2"), user("u")]) == expected


def test_none_contents_render_empty():
    msgs = [sys_(None), user("U"), asst(None, reasoning=None)]
    expected = "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜><think></think><｜end▁of▁sentence｜>"
    assert encode_messages(msgs, thinking=True) == expected


# ---------------------------------------------------------------- transitions


def test_no_transition_before_a_system_or_developer_message():
    msgs = [user("U"), sys_("S"), dev("D"), user("V")]
    expected = "<｜begin▁of▁sentence｜><｜User｜>US<｜User｜>D<｜User｜>V<｜Assistant｜></think>"
    assert encode_messages(msgs) == expected


def test_conversation_ending_in_a_system_message_gets_no_transition():
    assert encode_messages([user("U"), sys_("S")]) == "<｜begin▁of▁sentence｜><｜User｜>US"


# ---------------------------------------------------------------- reasoning effort


def test_max_reasoning_effort_preamble_only_in_thinking_mode():
    msgs = [sys_("S"), user("U")]
    got = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert got == "<｜begin▁of▁sentence｜>" + REASONING_EFFORT_MAX + "S<｜User｜>U<｜Assistant｜><think>"
    assert encode_messages(msgs, thinking=True, reasoning_effort="high") == "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜><think>"
    assert encode_messages(msgs, thinking=True) == "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜><think>"
    assert encode_messages(msgs, reasoning_effort="max") == "<｜begin▁of▁sentence｜>S<｜User｜>U<｜Assistant｜></think>"


def test_max_reasoning_effort_comes_before_the_tools_section():
    got = encode_messages([user("U")], thinking=True, reasoning_effort="max", tools=[TIME_TOOL])
    assert got == BOS + REASONING_EFFORT_MAX + tools_section(TIME_SCHEMA) + "<｜User｜>U<｜Assistant｜><think>"


@pytest.mark.parametrize("effort", ["low", "medium", "MAX", ""])
def test_other_reasoning_efforts_are_errors_naming_the_value(effort):
    with pytest.raises(ChatFormatError, match=f"reasoning_effort.*{effort!r}"):
        encode_messages([user("U")], thinking=True, reasoning_effort=effort)


# ---------------------------------------------------------------- tools and response format


def test_tools_section_appended_to_system_text():
    got = encode_messages([sys_("S"), user("U")], tools=[WEATHER_TOOL, TIME_TOOL])
    assert got == BOS + "S" + tools_section(WEATHER_SCHEMA, TIME_SCHEMA) + "<｜User｜>U<｜Assistant｜></think>"


def test_tools_without_system_message_follow_a_blank_line():
    got = encode_messages([user("U")], tools=[TIME_TOOL])
    assert got.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n\nYou have access")
    assert got == BOS + tools_section(TIME_SCHEMA) + "<｜User｜>U<｜Assistant｜></think>"


def test_tools_on_empty_or_none_system_text():
    for text in ("", None):
        got = encode_messages([sys_(text), user("U")], tools=[TIME_TOOL])
        assert got == BOS + tools_section(TIME_SCHEMA) + "<｜User｜>U<｜Assistant｜></think>"


def test_request_tools_go_on_a_new_first_system_message_when_the_first_is_not_system():
    msgs = [user("U1"), asst("A1"), sys_("S"), user("U2")]
    expected = (
        BOS + tools_section(TIME_SCHEMA)
        + "<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>S<｜User｜>U2<｜Assistant｜></think>"
    )
    assert encode_messages(msgs, tools=[TIME_TOOL]) == expected


def test_bare_function_objects_render_like_openai_tools():
    bare = [WEATHER_TOOL["function"], TIME_TOOL["function"]]
    expected = BOS + "S" + tools_section(WEATHER_SCHEMA, TIME_SCHEMA) + "<｜User｜>U<｜Assistant｜></think>"
    assert encode_messages([sys_("S"), user("U")], tools=bare) == expected


def test_tool_schema_is_the_function_object_as_given():
    fn = {"parameters": {"type": "object"}, "name": "wetter", "description": "Wetter in 東京", "strict": True}
    got = encode_messages([user("U")], tools=[{"type": "function", "function": fn}])
    schema = '{"parameters": {"type": "object"}, "name": "wetter", "description": "Wetter in 東京", "strict": true}'
    assert got == BOS + tools_section(schema) + "<｜User｜>U<｜Assistant｜></think>"


def test_response_format_section():
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}
    got = encode_messages([sys_("S"), user("U")], response_format=fmt)
    expected = (
        "<｜begin▁of▁sentence｜>S\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"
        '{"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}}'
        "<｜User｜>U<｜Assistant｜></think>"
    )
    assert got == expected


def test_response_format_without_system_message():
    got = encode_messages([user("U")], response_format=JSON_OBJECT)
    assert got == BOS + format_section('{"type": "json_object"}') + "<｜User｜>U<｜Assistant｜></think>"


def test_tools_then_response_format():
    got = encode_messages([sys_("S"), user("U")], tools=[TIME_TOOL], response_format=JSON_OBJECT)
    expected = BOS + "S" + tools_section(TIME_SCHEMA) + format_section('{"type": "json_object"}') + "<｜User｜>U<｜Assistant｜></think>"
    assert got == expected


def test_empty_tools_and_response_format_render_nothing():
    plain = encode_messages([sys_("S"), user("U")])
    assert encode_messages([sys_("S"), user("U")], tools=[], response_format={}) == plain
    assert encode_messages([user("U")], response_format={}) == "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>"
    assert encode_messages([sys_("S", tools=[], response_format={}), user("U")]) == plain


def test_tools_and_response_format_on_a_system_message():
    msgs = [sys_("S", tools=[TIME_TOOL], response_format=JSON_OBJECT), user("U")]
    expected = BOS + "S" + tools_section(TIME_SCHEMA) + format_section('{"type": "json_object"}') + "<｜User｜>U<｜Assistant｜></think>"
    assert encode_messages(msgs) == expected


def test_request_fields_combine_with_the_first_system_messages_own():
    msgs = [sys_("S", response_format=JSON_OBJECT), user("U")]
    expected = BOS + "S" + tools_section(TIME_SCHEMA) + format_section('{"type": "json_object"}') + "<｜User｜>U<｜Assistant｜></think>"
    assert encode_messages(msgs, tools=[TIME_TOOL]) == expected


def test_a_later_system_message_keeps_its_own_tools():
    msgs = [user("U1"), asst("A1"), sys_("S", tools=[TIME_TOOL]), user("U2")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "S" + tools_section(TIME_SCHEMA) + "<｜User｜>U2<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


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
    # arguments as a JSON string (ASCII-escaped or not) or as a dict encode the same
    as_json = [user("U"), asst("Checking.", tool_calls=[call("c1", "f", json.dumps(args)), call("c2", "now", {})])]
    assert encode_messages(as_json) == expected


def test_missing_or_empty_arguments_mean_no_parameters():
    expected = "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>" + NOW_CALL_MARKUP + "<｜end▁of▁sentence｜>"
    for args in ({}, "{}", None, "", "  "):
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
        BOS + "S" + tools_section(WEATHER_SCHEMA, TIME_SCHEMA)
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
    # tools declared on the system message keep the reasoning just the same
    msgs[0] = sys_("S", tools=[WEATHER_TOOL, TIME_TOOL])
    assert encode_messages(msgs, thinking=True) == expected


def test_tool_history_without_tools_drops_old_reasoning():
    calls = [call("a", "now", {})]
    msgs = [user("time?"), asst("", reasoning="call it", tool_calls=calls), tool("a", "noon"), asst("Noon.", reasoning="r2")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>time?<｜Assistant｜></think>" + NOW_CALL_MARKUP + "<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>noon</tool_result><｜Assistant｜><think>r2</think>Noon.<｜end▁of▁sentence｜>"
    )
    assert encode_messages(msgs, thinking=True) == expected


def test_tool_results_merge_with_following_user_text():
    msgs = [user("go"), asst("", tool_calls=[call("x", "now", {})]), tool("x", "noon"), user("and tomorrow?")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>" + NOW_CALL_MARKUP + "<｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>noon</tool_result>\n\nand tomorrow?<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


@pytest.mark.parametrize(
    "content, rendered",
    [
        ([{"type": "text", "text": "line 1"}, {"type": "text", "text": "line 2"}], "line 1\n\nline 2"),
        ([{"type": "text", "text": "only"}], "only"),
        ([], ""),
        (None, ""),
        ("", ""),
    ],
)
def test_tool_result_content_forms(content, rendered):
    msgs = [user("go"), asst("", tool_calls=[call("x", "now", {})]), tool("x", content)]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>go<｜Assistant｜></think>" + NOW_CALL_MARKUP + "<｜end▁of▁sentence｜>"
        f"<｜User｜><tool_result>{rendered}</tool_result><｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_prompt_tokenizes_with_single_special_ids(tmp_path):
    tok = Tokenizer.from_dir(write_tiny_tokenizer(tmp_path, 512))
    msgs = [sys_("S"), user("U"), asst("", tool_calls=[call("a", "now", {"tz": "UTC"})]), tool("a", "noon"), reminder("R")]
    prompt = encode_messages(msgs, thinking=True, tools=[TIME_TOOL])
    ids = tok.encode(prompt)
    assert ids[0] == tok.bos_id and tok.decode(ids) == prompt
    assert ids[-4:-2] == [tok.special_id("<｜Assistant｜>"), tok.special_id("<think>")]
    assert ids[-2] == tok.special_id("<｜latest_reminder｜>")
    assert ids.count(tok.eos_id) == 1 and ids.count(tok.special_id("<｜User｜>")) == 2


# ---------------------------------------------------------------- developer and latest_reminder


def test_developer_renders_as_a_user_turn():
    expected = "<｜begin▁of▁sentence｜>S<｜User｜>Be terse.<｜Assistant｜></think>"
    assert encode_messages([sys_("S"), dev("Be terse.")]) == expected


def test_developer_then_user_are_two_turns_without_a_transition_between():
    expected = "<｜begin▁of▁sentence｜><｜User｜>D<｜User｜>U<｜Assistant｜></think>"
    assert encode_messages([dev("D"), user("U")]) == expected


def test_developer_with_its_own_tools_and_response_format():
    msgs = [dev("D", tools=[TIME_TOOL], response_format=JSON_OBJECT), user("U")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>D" + tools_section(TIME_SCHEMA) + format_section('{"type": "json_object"}')
        + "<｜User｜>U<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_developer_counts_as_the_last_user_turn():
    msgs = [user("U"), asst("A1", reasoning="R1"), dev("D"), asst("A2", reasoning="R2")]
    expected = (
        "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>D<｜Assistant｜><think>R2</think>A2<｜end▁of▁sentence｜>"
    )
    assert encode_messages(msgs, thinking=True) == expected


def test_thinking_drops_developer_messages_before_the_last_user_turn():
    msgs = [sys_("S"), dev("D1"), user("U1"), asst("A1", reasoning="R1"), dev("D2"), user("U2")]
    dropped = (
        "<｜begin▁of▁sentence｜>S<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>U2<｜Assistant｜><think>"
    )
    assert encode_messages(msgs, thinking=True) == dropped
    kept_chat = (
        "<｜begin▁of▁sentence｜>S<｜User｜>D1<｜User｜>U1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>D2<｜User｜>U2<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == kept_chat
    kept_thinking = (
        "<｜begin▁of▁sentence｜>S<｜User｜>D1<｜User｜>U1<｜Assistant｜><think>R1</think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>D2<｜User｜>U2<｜Assistant｜><think>"
    )
    assert encode_messages(msgs, thinking=True, drop_thinking=False) == kept_thinking


def test_dropping_a_developer_message_does_not_merge_the_user_turns_around_it():
    expected = "<｜begin▁of▁sentence｜><｜User｜>U1<｜User｜>U2<｜Assistant｜><think>"
    assert encode_messages([user("U1"), dev("D"), user("U2")], thinking=True) == expected


def test_developer_messages_stay_when_tools_are_given():
    msgs = [dev("D"), user("U")]
    expected = BOS + tools_section(TIME_SCHEMA) + "<｜User｜>D<｜User｜>U<｜Assistant｜><think>"
    assert encode_messages(msgs, thinking=True, tools=[TIME_TOOL]) == expected


def test_latest_reminder_follows_the_assistant_transition_and_adds_none():
    assert encode_messages([user("U"), reminder("R")]) == "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think><｜latest_reminder｜>R"
    got = encode_messages([user("U"), reminder("R")], thinking=True)
    assert got == "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜><think><｜latest_reminder｜>R"


def test_latest_reminder_between_other_turns():
    msgs = [sys_("S"), reminder("R1"), user("U"), asst("A"), reminder("R2"), user("V")]
    expected = (
        "<｜begin▁of▁sentence｜>S<｜latest_reminder｜>R1<｜User｜>U<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜latest_reminder｜>R2<｜User｜>V<｜Assistant｜></think>"
    )
    assert encode_messages(msgs) == expected


def test_latest_reminder_is_not_a_user_turn():
    msgs = [user("U"), reminder("R"), asst("A", reasoning="kept")]
    expected = "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜><think><｜latest_reminder｜>Rkept</think>A<｜end▁of▁sentence｜>"
    assert encode_messages(msgs, thinking=True) == expected


# ---------------------------------------------------------------- malformed requests


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], r"messages: expected a non-empty list"),
        ([user("u"), {"role": "function", "content": "x"}], r"messages\[1\]\.role"),
        ([{"content": "x"}], r"messages\[0\]\.role"),
        (["hello"], r"messages\[0\]\.role"),
        ([user("u"), tool("a", "r")], r"messages\[1\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("zz", "r")], r"messages\[2\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", "r"), tool("a", "r")], r"messages\[3\]\.tool_call_id.*duplicate"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), asst("x"), tool("a", "r")], r"messages\[3\]\.tool_call_id"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", 7)], r"messages\[2\]\.content"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", [{"type": "image_url"}])], r"messages\[2\]\.content\[0\].*'image_url'"),
        ([user("u"), asst("", tool_calls=[call("a", "now", {})]), tool("a", ["x"])], r"messages\[2\]\.content\[0\]"),
        ([user(["part"])], r"messages\[0\]\.content"),
        ([user(None)], r"messages\[0\]\.content"),
        ([sys_(3), user("u")], r"messages\[0\]\.content"),
        ([user("u"), asst(42)], r"messages\[1\]\.content"),
        ([user("u"), asst("a", reasoning=7)], r"messages\[1\]\.reasoning_content"),
        ([user("u"), asst("", tool_calls=[call("a", "f", "{bad json")])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments \(f\): invalid JSON"),
        ([user("u"), asst("", tool_calls=[call("a", "f", "[1, 2]")])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments \(f\)"),
        ([user("u"), asst("", tool_calls=[call("a", "", {})])], r"messages\[1\]\.tool_calls\[0\]\.function\.name"),
        ([user("u"), asst("", tool_calls=[{"id": "a"}])], r"messages\[1\]\.tool_calls\[0\]\.function"),
        ([user("u"), asst("", tool_calls="nope")], r"messages\[1\]\.tool_calls"),
        ([user("u"), asst("", tool_calls=[call("a", "f", {"x": {1, 2}})])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([user("u"), asst("", tool_calls=[call("a", "f", {'a"b': 1})])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([user("u"), asst("", tool_calls=[call("a", "f", {1: 1})])], r"messages\[1\]\.tool_calls\[0\]\.function\.arguments"),
        ([{"role": "user", "content": "u", "tools": [TIME_TOOL]}], r"messages\[0\]\.tools: only system and developer"),
        ([user("u"), {"role": "assistant", "content": "", "response_format": JSON_OBJECT}], r"messages\[1\]\.response_format"),
        ([sys_("S", tools=[TIME_TOOL, {"type": "function"}]), user("u")], r"messages\[0\]\.tools\[1\]"),
        ([dev("D", tools={"name": "now"})], r"messages\[0\]\.tools: expected a list"),
        ([dev("D", response_format="json")], r"messages\[0\]\.response_format: expected an object"),
    ],
)
def test_malformed_messages_raise_chat_format_error(messages, match):
    with pytest.raises(ChatFormatError, match=match):
        encode_messages(messages)


def test_bad_request_tools_and_response_format():
    with pytest.raises(ChatFormatError, match=r"^tools\[1\]"):
        encode_messages([user("u")], tools=[TIME_TOOL, {"type": "function"}])
    with pytest.raises(ChatFormatError, match=r"^tools\[0\]\.type"):
        encode_messages([user("u")], tools=[{"type": "retrieval", "function": {"name": "x"}}])
    with pytest.raises(ChatFormatError, match="^response_format"):
        encode_messages([user("u")], response_format="json")
    with pytest.raises(ChatFormatError, match="^tools: given both as a request parameter and in messages"):
        encode_messages([sys_("S", tools=[TIME_TOOL]), user("u")], tools=[TIME_TOOL])
    assert issubclass(ChatFormatError, ValueError)
