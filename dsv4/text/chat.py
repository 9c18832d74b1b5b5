"""DeepSeek-V4 chat encoding: OpenAI-style messages -> the prompt the model was trained on.

The checkpoint ships no chat template; DeepSeek's `encoding_dsv4.py` defines the format. DSV4_FACTS
section 6 restates its rules and 6b gives its prose verbatim; this module implements both:

    prompt    = BOS [REASONING_EFFORT_MAX] turn*
    system    = content [tools section] [response-format section]  (each section after "\n\n")
    developer = <｜User｜> content [tools section] [response-format section]
    user turn = <｜User｜> blocks joined by "\n\n"  (a run of user texts and <tool_result>s)
    reminder  = <｜latest_reminder｜> content
    assistant = [reasoning </think>] content [DSML tool calls] EOS

and after a user or developer turn that ends the conversation or is followed by an assistant or
latest_reminder turn, the transition `<｜Assistant｜>` + (`<think>` | `</think>`).

Parsing the model's answer back lives in `dsv4.text.chat_parse`; its names are re-exported here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from dsv4.text.chat_parse import (  # noqa: F401  (re-exported: the parser's public names)
    ContentDelta,
    Event,
    ParsedCompletion,
    ParseError,
    ReasoningDelta,
    StreamingParser,
    ToolCall,
    ToolCallEvent,
    parse_completion,
)
from dsv4.text.markup import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    LATEST_REMINDER,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_TAG,
    USER,
    to_json,
)

# The trained prose, copied verbatim from DSV4_FACTS 6b (= the official encoder's strings). Not a
# word of it is ours: the released weights saw exactly these bytes. TOOLS_TEMPLATE is formatted
# with dsml_token, thinking_start_token, thinking_end_token and tool_schemas; the response-format
# template with schema. One line each, so they diff against 6b as they are.
TOOLS_TEMPLATE = '## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools by writing a "<{dsml_token}tool_calls>" block like the following:\n\n<{dsml_token}tool_calls>\n<{dsml_token}invoke name="$TOOL_NAME">\n<{dsml_token}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml_token}parameter>\n...\n</{dsml_token}invoke>\n<{dsml_token}invoke name="$TOOL_NAME2">\n...\n</{dsml_token}invoke>\n</{dsml_token}tool_calls>\n\nString parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by {thinking_start_token}), you MUST output your complete reasoning inside {thinking_start_token}...{thinking_end_token} BEFORE any tool calls or final response.\n\nOtherwise, output directly after {thinking_end_token} with tool calls or final response.\n\n### Available Tool Schemas\n\n{tool_schemas}\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n'
REASONING_EFFORT_MAX = 'Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\nExplicitly write out your entire deliberation process, documenting every intermediate step, considered alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n'
RESPONSE_FORMAT_TEMPLATE = '## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}'

REASONING_EFFORTS = (None, "high", "max")  # what the official encoder accepts; only "max" adds text
ROLES = ("system", "developer", "user", "tool", "assistant", "latest_reminder")
_USER_ROLES = ("user", "developer")  # turns that count for "the last user message"


class ChatFormatError(ValueError):
    """A request that cannot be encoded; the message names the field (`messages[3].content`,
    `tools[0]`, `reasoning_effort`)."""


@dataclass
class _Turn:
    """One unit of the prompt: a message, or a run of user/tool messages merged into one user turn.

    `text` is rendered except for what depends on the neighbours: an assistant's reasoning (kept
    or dropped) and the transition after a user or developer turn.
    """

    role: str  # system | developer | user | latest_reminder | assistant
    text: str
    reasoning: str = ""  # assistant only
    has_tools: bool = False  # tool schemas are declared here (then all reasoning is kept)


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """Encode OpenAI-style chat messages into the DSV4 prompt string (DSV4_FACTS 6 and 6b).

    Args:
        messages: dicts with `role` in system/developer/user/tool/assistant/latest_reminder.
            System and developer messages may carry `tools` and `response_format`; assistant
            messages `reasoning_content` and `tool_calls`; tool messages `tool_call_id` and a
            `content` that is a string, a list of text parts or None.
        thinking: thinking mode (generation opens with `<think>`) instead of chat mode (`</think>`).
        reasoning_effort: None, "high" or "max"; only "max" in thinking mode adds a preamble.
        drop_thinking: in thinking mode, drop the reasoning of assistant turns and the developer
            messages before the last user turn (ignored, i.e. all kept, when any tools are given).
        tools: request-level tool definitions (OpenAI `{"type": "function", "function": {...}}`
            or bare function objects): a tools section on the first message if it is a system
            message, else on a new empty system message put first.
        response_format: request-level response format, placed like `tools`; `{}` adds nothing.
        add_generation_prompt: end with `<｜Assistant｜>` + `<think>`/`</think>` when the
            conversation ends in a user, tool or developer turn.
        continue_final_message: the last message is an assistant turn the model goes on writing (a
            prefill, vLLM's `continue_final_message`, Anthropic's trailing assistant message): it is
            rendered without its end token. Its text continues its content; in thinking mode its
            reasoning (possibly empty) is closed before it. It may not carry tool calls.
    Returns:
        The prompt text, special tokens written as strings (BOS first).
    Raises:
        ChatFormatError: a malformed request, naming the field (`messages[2].tool_call_id`).
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ChatFormatError(f"reasoning_effort: expected None, 'high' or 'max', got {reasoning_effort!r}")
    _check_messages(messages)
    if continue_final_message:
        last = len(messages) - 1
        if messages[last]["role"] != "assistant":
            raise ChatFormatError(f"messages[{last}].role: continuing the final message needs an assistant "
                                  f"message last, got {messages[last]['role']!r}")
        if messages[last].get("tool_calls"):
            raise ChatFormatError(f"messages[{last}].tool_calls: a message to continue cannot carry tool calls")
    turns = _turns(_with_request_fields(messages, tools, response_format))
    keep_reasoning = not drop_thinking or any(turn.has_tools for turn in turns)
    if thinking and not keep_reasoning:
        turns = _drop_earlier_developer_turns(turns)
    preamble = REASONING_EFFORT_MAX if thinking and reasoning_effort == "max" else ""
    text = BOS + preamble + _render(turns, thinking, keep_reasoning, add_generation_prompt)
    return text[:-len(EOS)] if continue_final_message else text      # the assistant turn stays open


# ------------------------------------------------------------------------ checks and fields


def _check_messages(messages: Any) -> None:
    """Every message is an object with a known role; tools only where they are rendered."""
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("messages: expected a non-empty list of message objects")
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise ChatFormatError(f"messages[{i}].role: unknown role {role!r}, expected one of {', '.join(ROLES)}")
        for key in ("tools", "response_format"):
            if msg.get(key) and role not in ("system", "developer"):
                raise ChatFormatError(f"messages[{i}].{key}: only system and developer messages take {key}")


def _with_request_fields(messages: list[dict], tools: Any, response_format: Any) -> list[tuple[str, dict]]:
    """Pair each message with its name for errors, and place the request-level tools and
    response_format: on the first message if it is a system message, else on a new empty system
    message put first (as the official API does)."""
    _sections(tools, response_format, "")  # check them here, so errors name the request parameter
    named = [(f"messages[{i}]", msg) for i, msg in enumerate(messages)]
    request = {key: value for key, value in (("tools", tools), ("response_format", response_format)) if value}
    if not request:
        return named
    first = messages[0]
    if first["role"] != "system":
        return [("request", {"role": "system", "content": "", **request})] + named
    for key in request:
        if first.get(key):
            raise ChatFormatError(f"{key}: given both as a request parameter and in messages[0].{key}")
    return [("messages[0]", {**first, **request})] + named[1:]


def _text(msg: dict, where: str, key: str, *, none_ok: bool = True) -> str:
    """A text field of a message; None (or absent) reads as "" where `none_ok`."""
    value = msg.get(key)
    if value is None and none_ok:
        return ""
    if not isinstance(value, str):
        raise ChatFormatError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _json(value: Any, where: str) -> str:
    try:
        return to_json(value)
    except (TypeError, ValueError) as exc:
        raise ChatFormatError(f"{where}: not JSON-serialisable ({exc})") from exc


# ------------------------------------------------------------------------ system sections


def _tool_schema(tool: Any, where: str) -> dict:
    """The function object of an OpenAI tool `{"type": "function", "function": {...}}`, or a bare
    function object; rendered as given (name, description, parameters, in the caller's order)."""
    if isinstance(tool, dict) and "function" in tool:
        if tool.get("type", "function") != "function":
            raise ChatFormatError(f"{where}.type: expected 'function', got {tool.get('type')!r}")
        tool, where = tool["function"], f"{where}.function"
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ChatFormatError(
            f"{where}: expected {{'type': 'function', 'function': {{'name': ...}}}} or a function object with a name"
        )
    return tool


def _tools_section(tools: Any, where: str) -> str:
    if not isinstance(tools, list):
        raise ChatFormatError(f"{where}tools: expected a list of tool definitions")
    schemas = [_json(_tool_schema(tool, f"{where}tools[{k}]"), f"{where}tools[{k}]") for k, tool in enumerate(tools)]
    return TOOLS_TEMPLATE.format(
        dsml_token=DSML,
        thinking_start_token=THINK_START,
        thinking_end_token=THINK_END,
        tool_schemas="\n".join(schemas),
    )


def _sections(tools: Any, response_format: Any, where: str) -> str:
    """The tools and response-format sections, each as "\\n\\n" + section ("" if neither).

    `where` prefixes field names in errors: "" for request parameters, "messages[i]." otherwise.
    Empty tools and an empty response format add nothing.
    """
    out = ""
    if tools is not None and tools != []:
        out += "\n\n" + _tools_section(tools, where)
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ChatFormatError(f"{where}response_format: expected an object")
        if response_format:
            schema = _json(response_format, f"{where}response_format")
            out += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=schema)
    return out


# ------------------------------------------------------------------------ turns


def _turns(named: list[tuple[str, dict]]) -> list[_Turn]:
    """Render each message into a turn; a run of user and tool messages becomes one user turn."""
    turns: list[_Turn] = []
    call_order: dict[str, int] = {}  # tool-call id -> position, in the latest assistant message
    i = 0
    while i < len(named):
        where, msg = named[i]
        role = msg["role"]
        if role in ("user", "tool"):
            stop = i
            while stop < len(named) and named[stop][1]["role"] in ("user", "tool"):
                stop += 1
            turns.append(_Turn("user", USER + _user_turn_text(named[i:stop], call_order)))
            i = stop
            continue
        if role == "assistant":
            turn, call_order = _assistant_turn(msg, where)
            turns.append(turn)
        elif role == "latest_reminder":
            turns.append(_Turn(role, LATEST_REMINDER + _text(msg, where, "content")))
        else:  # system, developer: content and their own sections
            head = USER if role == "developer" else ""
            sections = _sections(msg.get("tools"), msg.get("response_format"), f"{where}.")
            turns.append(_Turn(role, head + _text(msg, where, "content") + sections, has_tools=bool(msg.get("tools"))))
        i += 1
    return turns


def _tool_result_text(msg: dict, where: str) -> str:
    """A tool message's content: a string, None (empty), or text parts joined by blank lines."""
    content = msg.get("content")
    if not isinstance(content, list):
        return _text(msg, where, "content")
    texts = []
    for k, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ChatFormatError(
                f"{where}.content[{k}]: expected a text part {{'type': 'text', 'text': ...}}, got {kind!r}"
            )
        texts.append(part["text"])
    return "\n\n".join(texts)


def _user_turn_text(run: list[tuple[str, dict]], call_order: dict[str, int]) -> str:
    """Merge a run of user and tool messages into one user turn's text.

    Tool results become <tool_result> blocks, reordered to follow the preceding assistant's
    tool-call order; user texts keep their places. Blocks are joined by blank lines.
    """
    blocks: list[tuple[int | None, str]] = []  # (call position for a tool result, text)
    seen: set[str] = set()
    for where, msg in run:
        if msg["role"] == "user":
            blocks.append((None, _text(msg, where, "content", none_ok=False)))
            continue
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in call_order:
            raise ChatFormatError(
                f"{where}.tool_call_id: {call_id!r} matches no tool call of the preceding assistant message"
            )
        if call_id in seen:
            raise ChatFormatError(f"{where}.tool_call_id: duplicate result for tool call {call_id!r}")
        seen.add(call_id)
        blocks.append((call_order[call_id], f"<tool_result>{_tool_result_text(msg, where)}</tool_result>"))
    results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
    return "\n\n".join(next(results)[1] if pos is not None else text for pos, text in blocks)


def _assistant_turn(msg: dict, where: str) -> tuple[_Turn, dict[str, int]]:
    """An assistant turn (reasoning kept aside) and the position of each of its tool-call ids."""
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ChatFormatError(f"{where}.tool_calls: expected a list")
    text = _text(msg, where, "content") + _tool_calls_markup(calls, where) + EOS
    order = {call["id"]: k for k, call in enumerate(calls) if isinstance(call.get("id"), str)}
    return _Turn("assistant", text, reasoning=_text(msg, where, "reasoning_content")), order


# ------------------------------------------------------------------------ tool calls


def _tool_call(call: Any, where: str) -> tuple[str, dict]:
    """Validate one OpenAI tool call; return (name, arguments as a dict)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ChatFormatError(f"{where}.function: expected an object")
    if call.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type: expected 'function', got {call.get('type')!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not name or '"' in name:
        raise ChatFormatError(f"{where}.function.name: expected a non-empty name without '\"'")
    return name, _call_arguments(fn.get("arguments"), f"{where}.function.arguments ({name})")


def _call_arguments(args: Any, where: str) -> dict:
    """Arguments as a dict: a JSON-object string, a dict, or ""/None for none."""
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"{where}: invalid JSON ({exc})") from exc
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}: expected a JSON object, got {type(args).__name__}")
    for key in args:
        if not isinstance(key, str) or '"' in key:
            raise ChatFormatError(f"{where}: parameter name {key!r} is not a string without '\"'")
    _json(args, where)
    return args


def _parameter(key: str, value: Any) -> str:
    """Strings raw with string="true"; every other value as JSON with string="false"."""
    if isinstance(value, str):
        return f'{PARAM_OPEN} name="{key}" string="true">{value}{PARAM_CLOSE}'
    return f'{PARAM_OPEN} name="{key}" string="false">{to_json(value)}{PARAM_CLOSE}'


def _tool_calls_markup(calls: list, where: str) -> str:
    """The DSML block for an assistant's tool calls ("" if there are none)."""
    if not calls:
        return ""
    invokes = []
    for k, call in enumerate(calls):
        name, args = _tool_call(call, f"{where}.tool_calls[{k}]")
        params = "\n".join(_parameter(key, value) for key, value in args.items())
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n{params}\n{INVOKE_CLOSE}')
    return f"\n\n{TOOL_CALLS_TAG}>\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


# ------------------------------------------------------------------------ rendering


def _last_user(turns: list[_Turn]) -> int:
    return max((k for k, turn in enumerate(turns) if turn.role in _USER_ROLES), default=-1)


def _drop_earlier_developer_turns(turns: list[_Turn]) -> list[_Turn]:
    """Thinking mode with dropped thinking: developer messages before the last user turn go too."""
    last_user = _last_user(turns)
    return [turn for k, turn in enumerate(turns) if turn.role != "developer" or k >= last_user]


def _answer_follows(turns: list[_Turn], k: int, add_generation_prompt: bool) -> bool:
    """Whether the assistant's turn opens after the user/developer turn `k`: it does before an
    assistant or latest_reminder turn and at the end; before any other turn nothing is added."""
    if k + 1 == len(turns):
        return add_generation_prompt
    return turns[k + 1].role in ("assistant", "latest_reminder")


def _render(turns: list[_Turn], thinking: bool, keep_reasoning: bool, add_generation_prompt: bool) -> str:
    """Join the turns with the reasoning kept where it is, and the assistant transitions.

    Reasoning (and the `<think>` that opens it) shows only in thinking mode, and only after the
    last user turn unless `keep_reasoning`.
    """
    last_user = _last_user(turns)
    out = []
    for k, turn in enumerate(turns):
        if turn.role == "assistant" and thinking and (keep_reasoning or k > last_user):
            out.append(turn.reasoning + THINK_END)
        out.append(turn.text)
        if turn.role in _USER_ROLES and _answer_follows(turns, k, add_generation_prompt):
            opens_thinking = thinking and (keep_reasoning or k >= last_user)
            out.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
    return "".join(out)
