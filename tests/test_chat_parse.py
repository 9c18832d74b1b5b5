"""Parsing completions: whole-text `parse_completion` and the streaming parser agree, round
trips through `encode_messages`, the parser is lenient where DeepSeek's own parser is (DSV4_FACTS
6b: a parameter value ends only at its own closing tag, an empty block is no calls, role markers
are text), and malformed markup is flagged rather than leaked or dropped."""

from __future__ import annotations

import json
import random
import re

import pytest

from dsv4.text import (
    ContentDelta,
    ParseError,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallEvent,
    encode_messages,
    parse_completion,
)

EOS = "<｜end▁of▁sentence｜>"


def invoke(name, *params):
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + "\n</｜DSML｜invoke>"


def param(key, value, string):
    return f'<｜DSML｜parameter name="{key}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>'


def block(*invokes):
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(invokes) + "\n</｜DSML｜tool_calls>"


WEATHER = invoke("get_weather", param("city", "Oslo", True), param("days", "3", False))
NOW = invoke("now")


# ---------------------------------------------------------------- well-formed completions


def test_chat_mode_plain_answer():
    got = parse_completion("Hello there." + EOS, thinking=False)
    assert (got.reasoning, got.content, got.tool_calls, got.finish_reason, got.error) == (None, "Hello there.", [], "stop", None)
    assert got.raw == "Hello there." + EOS


def test_thinking_mode_reasoning_then_answer():
    got = parse_completion("Let me think.\nOK.</think>The answer is 4." + EOS, thinking=True)
    assert (got.reasoning, got.content, got.finish_reason, got.error) == ("Let me think.\nOK.", "The answer is 4.", "stop", None)


def test_truncated_completions_are_length():
    got = parse_completion("Half an ans", thinking=False)
    assert (got.content, got.finish_reason, got.error) == ("Half an ans", "length", None)
    got = parse_completion("still thinking", thinking=True)
    assert (got.reasoning, got.content, got.finish_reason) == ("still thinking", "", "length")
    got = parse_completion("Hello\n\n<｜DS", thinking=False)  # a partial tag is only text when the stream ends
    assert (got.content, got.finish_reason, got.error) == ("Hello\n\n<｜DS", "length", None)


def test_tool_calls_parsed():
    text = "r</think>Let me check." + block(WEATHER, NOW) + EOS
    got = parse_completion(text, thinking=True)
    assert got.error is None and got.finish_reason == "tool_calls"
    assert (got.reasoning, got.content) == ("r", "Let me check.")
    assert got.tool_calls == [
        ToolCall("get_weather", {"city": "Oslo", "days": 3}, '{"city": "Oslo", "days": 3}', "call_0"),
        ToolCall("now", {}, "{}", "call_1"),
    ]


def test_tool_calls_without_eos_and_id_prefix():
    got = parse_completion(block(NOW), thinking=False, call_id_prefix="call_abc_")
    assert (got.content, got.finish_reason, got.error) == ("", "tool_calls", None)
    assert got.tool_calls[0].id == "call_abc_0"


def test_string_parameter_is_raw_text():
    value = 'line 1\n  "quoted" {not json} <b>html</b> 東京 🌧️'
    got = parse_completion(block(invoke("w", param("v", value, True), param("t", '"x"', False))) + EOS, thinking=False)
    assert got.error is None and got.tool_calls[0].arguments == {"v": value, "t": "x"}


# ---------------------------------------------------------------- parse(encode(x)) round trips

ALL_TYPES = {
    "s": "Paris, FR",
    "empty": "",
    "multiline": "a\nb\n\n  c",
    "looks_like_json": "123",
    "unicode": "東京 🌧️",
    "i": -42,
    "big": 12345678901234567890,
    "f": 2.5,
    "exp": 1e-07,
    "t": True,
    "b": False,
    "n": None,
    "l": [1, "two", [3.0], {"x": None}],
    "d": {"nested": {"k": ["v", 1]}, "z": False},
    "empty_list": [],
    "empty_dict": {},
}


# String values an agent editing this very parser would send: markup of every kind, but never the
# value's own closing tag, which no encoding can carry.
MARKUP_VALUES = {
    "dsml": "x = '｜DSML｜'",
    "closers": "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n</think><｜end▁of▁sentence｜>",
    "openers": '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="k" string="true">',
    "roles": "<｜User｜>hi<｜Assistant｜><think>",
    "half_close": "</｜DSML｜parameter",
    "json": {"html": "</｜DSML｜invoke></｜DSML｜tool_calls>", "list": ["<｜DSML｜invoke", "｜DSML｜"]},
}


def _completion_of(assistant: dict, thinking: bool) -> str:
    """Encode [user, assistant] and cut off the prompt: what the model would have generated."""
    prompt = encode_messages([{"role": "user", "content": "go"}], thinking=thinking)
    full = encode_messages([{"role": "user", "content": "go"}, assistant], thinking=thinking, add_generation_prompt=False)
    assert full.startswith(prompt)
    return full[len(prompt):]


def _tc(name, args, call_id="c"):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize(
    "assistant",
    [
        {"role": "assistant", "content": "Just text.", "reasoning_content": "hmm"},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [_tc("all_types", ALL_TYPES)]},
        {"role": "assistant", "content": "Two calls:", "reasoning_content": "plan\nsteps",
         "tool_calls": [_tc("a", {"x": 1}, "1"), _tc("b", {}, "2"), _tc("a", {"x": "1"}, "3")]},
        {"role": "assistant", "content": "multi\n\nparagraph", "tool_calls": [_tc("one", {k: ALL_TYPES[k] for k in ("s", "n", "d")})]},
        {"role": "assistant", "content": "Quoting <｜User｜> and <｜Assistant｜>.", "reasoning_content": "a <｜latest_reminder｜> b",
         "tool_calls": [_tc("edit", MARKUP_VALUES)]},
    ],
)
def test_round_trip_through_encoding(assistant, thinking):
    got = parse_completion(_completion_of(assistant, thinking), thinking=thinking)
    assert got.error is None
    assert got.content == assistant["content"]
    assert got.reasoning == ((assistant.get("reasoning_content") or "") if thinking else None)
    calls = assistant.get("tool_calls", [])
    assert [(c.name, c.arguments) for c in got.tool_calls] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert got.finish_reason == ("tool_calls" if calls else "stop")
    for c in got.tool_calls:
        assert json.loads(c.arguments_json) == c.arguments


# ---------------------------------------------------------------- malformed markup

MALFORMED = {
    "unclosed invoke before EOS": ("x" + "\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="w">\n' + param("a", "1", False) + "\n" + EOS, "unclosed"),
    "unclosed invoke at end": ("x" + "\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="w">\n' + param("a", "1", False), "unclosed"),
    "invoke closed by block end": ("\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="w">\n</｜DSML｜tool_calls>' + EOS, "unclosed"),
    "invoke inside invoke": ("\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="w">\n' + NOW + "\n</｜DSML｜tool_calls>" + EOS, "unclosed <｜DSML｜invoke> before <｜DSML｜invoke"),
    "unclosed block": (block(NOW)[: -len("</｜DSML｜tool_calls>")] + EOS, "unclosed"),
    "unclosed block at end": ("x" + block(NOW)[: -len("</｜DSML｜tool_calls>")], "unclosed"),
    "block tag at end": ("x\n\n<｜DSML｜tool_calls", "unclosed"),
    "bad JSON param": ("x" + block(invoke("w", param("a", "{oops", False))) + EOS, "not valid JSON"),
    "NaN is not JSON": ("x" + block(invoke("w", param("a", "NaN", False))) + EOS, "not valid JSON"),
    "unknown tag in invoke": ("x" + block(invoke("w", "<｜DSML｜argument>1</｜DSML｜argument>")) + EOS, "unexpected text"),
    "text in invoke": ("x" + block(invoke("w", "hello", param("a", "1", False))) + EOS, "unexpected text in <｜DSML｜invoke> 'w': 'hello'"),
    "unknown tag in block": ("x" + block("<｜DSML｜call>1</｜DSML｜call>") + EOS, "unexpected text in"),
    "parameter value never closed": ("x" + block(invoke("w", '<｜DSML｜parameter name="a" string="true">1')) + EOS, "not closed"),
    "parameter value cut off": ("x" + "\n\n<｜DSML｜tool_calls>\n" + '<｜DSML｜invoke name="w">\n<｜DSML｜parameter name="a" string="true">abc', "not closed"),
    "duplicate parameter": ("x" + block(invoke("w", param("a", "1", False), param("a", "2", False))) + EOS, "duplicate"),
    "bad string flag": ("x" + block(invoke("w", '<｜DSML｜parameter name="a" string="yes">1</｜DSML｜parameter>')) + EOS, "malformed <｜DSML｜parameter> tag"),
    "parameter tag without name": ("x" + block(invoke("w", '<｜DSML｜parameter string="true">1</｜DSML｜parameter>')) + EOS, "malformed <｜DSML｜parameter> tag"),
    "invoke name unquoted": ("x" + block('<｜DSML｜invoke name=w>\n</｜DSML｜invoke>') + EOS, "malformed <｜DSML｜invoke> tag"),
    "invoke tag cut by a newline": ("x" + block('<｜DSML｜invoke name="w"\n</｜DSML｜invoke>') + EOS, "malformed <｜DSML｜invoke> tag"),
    "malformed block tag": ("x\n\n<｜DSML｜tool_callsX>\n" + NOW + "\n</｜DSML｜tool_calls>" + EOS, "malformed"),
    "DSML without blank line": ("x\n<｜DSML｜tool_calls>\n" + NOW + "\n</｜DSML｜tool_calls>" + EOS, "outside a tool_calls block"),
    "bare invoke in content": ("x " + NOW + EOS, "outside a tool_calls block"),
    "text after block": ("x" + block(NOW) + "and more" + EOS, "after"),
    "text after EOS": ("x" + EOS + "more", "after"),
    "think tag in content": ("a</think>b" + EOS, "unexpected </think>"),
    "BOS in content": ("a<｜begin▁of▁sentence｜>b" + EOS, "unexpected <｜begin▁of▁sentence｜>"),
}
MALFORMED_THINKING = {
    "EOS before </think>": ("reasoning" + EOS, "before </think>"),
    "tool call before </think>": ("reasoning" + block(NOW) + EOS, "before </think>"),
    "second <think>": ("<think>r</think>a" + EOS, "unexpected <think>"),
}

# Accepted as DeepSeek's own parser accepts them (the three marked "beyond" go a step further, in
# the same spirit: free whitespace, and only the whole closing tag or a real tag is markup):
# (text, thinking, reasoning, content, [(name, arguments)], finish_reason).
LENIENT = {
    "value holds DSML closing tags and EOS": (
        block(invoke("edit", param("code", "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>", True))) + EOS, False,
        None, "", [("edit", {"code": "</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>"})], "tool_calls"),
    "value holds what looks like the next parameter": (
        "x" + block(invoke("w", '<｜DSML｜parameter name="a" string="true">1', param("b", "2", False))) + EOS, False,
        None, "x", [("w", {"a": '1\n<｜DSML｜parameter name="b" string="false">2'})], "tool_calls"),
    "value holds role markers and think tags": (
        "r</think>" + block(invoke("say", param("text", "<｜User｜>hi<｜Assistant｜><think>x</think>", True))) + EOS, True,
        "r", "", [("say", {"text": "<｜User｜>hi<｜Assistant｜><think>x</think>"})], "tool_calls"),
    "value holds a half closing tag": (  # beyond
        block(invoke("w", param("v", "a </｜DSML｜parameter b", True))) + EOS, False,
        None, "", [("w", {"v": "a </｜DSML｜parameter b"})], "tool_calls"),
    "JSON value holds markup": (
        block(invoke("w", param("d", '{"t": "</｜DSML｜invoke>"}', False))) + EOS, False,
        None, "", [("w", {"d": {"t": "</｜DSML｜invoke>"}})], "tool_calls"),
    "empty block": ("x\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>" + EOS, False, None, "x", [], "stop"),
    "empty block, no newline": ("\n\n<｜DSML｜tool_calls></｜DSML｜tool_calls>", False, None, "", [], "stop"),  # beyond
    "empty block in thinking mode": ("r</think>ok\n\n<｜DSML｜tool_calls>\n</｜DSML｜tool_calls>" + EOS, True, "r", "ok", [], "stop"),
    "role markers in content": ("a <｜User｜> b <｜Assistant｜> c <｜latest_reminder｜>" + EOS, False,
                                None, "a <｜User｜> b <｜Assistant｜> c <｜latest_reminder｜>", [], "stop"),
    "role markers in reasoning": ("<｜User｜>r<｜Assistant｜></think>c<｜User｜>" + EOS, True, "<｜User｜>r<｜Assistant｜>", "c<｜User｜>", [], "stop"),
    "bare DSML word in content": ("the ｜DSML｜ token" + EOS, False, None, "the ｜DSML｜ token", [], "stop"),  # beyond
}


@pytest.mark.parametrize("name", sorted(LENIENT))
def test_lenient_where_the_official_parser_is(name):
    text, thinking, reasoning, content, calls, reason = LENIENT[name]
    got = parse_completion(text, thinking=thinking)
    assert got.error is None, got.error
    assert (got.reasoning, got.content, got.finish_reason) == (reasoning, content, reason)
    assert [(c.name, c.arguments) for c in got.tool_calls] == calls
    for c in got.tool_calls:
        assert json.loads(c.arguments_json) == c.arguments


@pytest.mark.parametrize("name", sorted(MALFORMED) + sorted(MALFORMED_THINKING))
def test_malformed_markup_is_flagged(name):
    thinking = name in MALFORMED_THINKING
    text, match = (MALFORMED_THINKING if thinking else MALFORMED)[name]
    got = parse_completion(text, thinking=thinking)
    assert got.error is not None, name
    assert re.search(match, got.error), got.error
    assert got.raw == text  # nothing lost
    assert "｜DSML｜" not in got.content and "｜DSML｜" not in (got.reasoning or "")
    parser = StreamingParser(thinking)
    events = parser.feed(text) + parser.finish()
    assert [e.message for e in events if isinstance(e, ParseError)] == [got.error]


def test_calls_before_a_malformed_one_are_kept():
    text = "x" + block(NOW, invoke("w", param("a", "{oops", False))) + EOS
    got = parse_completion(text, thinking=False)
    assert [c.name for c in got.tool_calls] == ["now"] and "not valid JSON" in got.error


def test_parse_error_event_carries_the_block_up_to_the_error():
    bad = param("a", "{oops", False)
    events = StreamingParser(False).feed("x" + block(NOW, invoke("w", bad)) + EOS)
    err = [e for e in events if isinstance(e, ParseError)]
    assert len(err) == 1
    assert err[0].raw == "<｜DSML｜tool_calls>\n" + NOW + '\n<｜DSML｜invoke name="w">\n' + bad


# ---------------------------------------------------------------- streaming


def _stream(text: str, thinking: bool, chunks: list[int] | None = None):
    """Feed `text` in pieces of the given sizes (default: one character at a time)."""
    parser = StreamingParser(thinking)
    events, pos = [], 0
    for size in chunks or [1] * len(text):
        events += parser.feed(text[pos : pos + size])
        pos += size
    events += parser.feed(text[pos:]) + parser.finish()
    return parser, events


def _summary(events):
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = [e.call for e in events if isinstance(e, ToolCallEvent)]
    errors = [(e.message, e.raw) for e in events if isinstance(e, ParseError)]
    return reasoning, content, calls, errors


def _inputs():
    cases = [(t, False) for t, _ in MALFORMED.values()] + [(t, True) for t, _ in MALFORMED_THINKING.values()]
    cases += [(case[0], case[1]) for case in LENIENT.values()]
    cases += [
        ("Hello there." + EOS, False),
        ("r</think>Let me check." + block(WEATHER, NOW) + EOS, True),
        ("Hello\n\n<｜DS", False),
        ("a\n\nb\n\n\n<c> </ d <｜ e" + EOS, False),
        ("r1 < / </thin </think>x\n\n<｜DSML｜tool_calls>\n" + NOW + "\n</｜DSML｜tool_calls>  \n" + EOS, True),
        ("<｜end▁of▁sentence", False),
    ]
    for thinking in (False, True):
        cases.append((_completion_of({"role": "assistant", "content": "c\n\n", "reasoning_content": "r\n\n<",
                                      "tool_calls": [_tc("all", ALL_TYPES), _tc("n", {})]}, thinking), thinking))
        cases.append((_completion_of({"role": "assistant", "content": "<｜User｜>", "tool_calls": [_tc("edit", MARKUP_VALUES)]},
                                     thinking), thinking))
    rng = random.Random(0)
    pieces = ["a", " ", "\n", "\n\n", "<", "</", "｜", "<｜DS", "<｜DSML｜tool_calls>", "\n\n<｜DSML｜tool_calls>\n",
              NOW, WEATHER, "</think>", "<think>", EOS, "<｜end▁of", "</｜DSML｜tool_calls>", "東京", "🌧️",
              "<｜User｜>", "<｜Assistant｜>", "<｜DSML｜parameter", '<｜DSML｜parameter name="v" string="true">',
              '<｜DSML｜invoke name="w">\n', "</｜DSML｜parameter>", "</｜DSML｜invoke>", "\n\n<｜DSML｜tool_calls>"]
    for _ in range(300):
        cases.append(("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))), rng.random() < 0.5))
    return cases


def test_streaming_one_char_at_a_time_matches_whole_text():
    for text, thinking in _inputs():
        whole = parse_completion(text, thinking=thinking)
        parser, events = _stream(text, thinking)
        reasoning, content, calls, errors = _summary(events)
        assert (reasoning if thinking else None, content, calls) == (whole.reasoning, whole.content, whole.tool_calls), text
        assert [m for m, _ in errors] == ([whole.error] if whole.error else []), text
        assert parser.result() == whole, text
        assert not thinking or not any(isinstance(e, ReasoningDelta) and not e.text for e in events)


def test_reasoning_and_content_never_carry_markup():
    for text, thinking in _inputs():
        got = parse_completion(text, thinking=thinking)
        for part in (got.content, got.reasoning or ""):
            for markup in ("<｜DSML｜", "</｜DSML｜", "</think>", "<think>", EOS, "<｜begin▁of▁sentence｜>"):
                assert markup not in part, (text, part)


def test_streaming_any_chunking_gives_identical_events():
    rng = random.Random(1)
    for text, thinking in _inputs():
        _, whole_events = _stream(text, thinking, [len(text)])
        for _ in range(3):
            sizes = [rng.randint(1, 7) for _ in range(len(text))]
            _, events = _stream(text, thinking, sizes)
            assert _summary(events) == _summary(whole_events), text


def test_streaming_holds_back_possible_markup():
    parser = StreamingParser(thinking=False)
    assert parser.feed("Sure.\n") == [ContentDelta("Sure.")]
    assert parser.feed("\n<｜DS") == []
    assert parser.feed("ML｜tool_calls>\n" + NOW[:-3]) == []
    assert parser.feed(NOW[-3:]) == [ToolCallEvent(ToolCall("now", {}, "{}", "call_0"))]
    assert parser.feed("\n</｜DSML｜tool_calls>" + EOS) == []
    assert parser.finish() == []
    assert parser.result().finish_reason == "tool_calls"


def test_streaming_releases_text_that_is_not_markup():
    parser = StreamingParser(thinking=True)
    assert parser.feed("a </thi") == [ReasoningDelta("a ")]
    assert parser.feed("ng") == [ReasoningDelta("</thing")]
    assert parser.feed("</think>\n\nx") == [ContentDelta("\n\nx")]
    assert parser.feed("<｜end▁of▁sentence") == []
    assert parser.finish() == [ContentDelta("<｜end▁of▁sentence")]


def test_content_never_retracts_or_leaks_while_streaming():
    text = _completion_of({"role": "assistant", "content": "Calling.", "tool_calls": [_tc("all", ALL_TYPES)]}, False)
    final = parse_completion(text, thinking=False).content
    parser, content = StreamingParser(False), ""
    for ch in text:
        content += "".join(e.text for e in parser.feed(ch) if isinstance(e, ContentDelta))
        assert final.startswith(content)
    assert content == final == "Calling."
