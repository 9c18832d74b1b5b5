"""DeepSeek-V4 chat encoding and completion parsing (DSV4_FACTS section 6).

The checkpoint ships no chat template; its official `encoding_dsv4.py` defines the prompt
format, restated in DSV4_FACTS section 6 and implemented here from those rules:

    prompt    = BOS [max-effort preamble] messages [<｜Assistant｜> (<think> | </think>)]
    system    = raw text [+ "\\n\\n## Tools ..."] [+ "\\n\\n## Response Format ..."]
    user turn = <｜User｜> + blocks joined by "\\n\\n" (user text, <tool_result>...</tool_result>)
    assistant = [reasoning + </think>] + content + [DSML tool calls] + EOS

A completion (what the model writes after the prompt) is parsed back by `parse_completion`,
or incrementally by `StreamingParser`; both run the same state machine, so a stream fed in any
chunking yields exactly what the whole-text parse yields. Parsing is strict: markup that is not
well-formed is reported as an error (with the raw text kept), never passed off as content.
"""

from __future__ import annotations

import json
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
from dsv4.text.markup import (  # noqa: F401
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
    USER,
)


# The three prose constants below are our own wording: DSV4_FACTS does not give the official
# text. They MUST match the official `encoding_dsv4.py` for the released weights to see the
# prompts they were trained on; check them against it before relying on tool use or max effort.
REASONING_EFFORT_MAX_PREAMBLE = (
    "Reasoning effort: maximum. Think the problem through completely before answering: break it "
    "into parts, check every step, consider alternatives and edge cases, and write out your full "
    "line of reasoning without skipping anything.\n\n"
)
TOOLS_INSTRUCTIONS = (
    "You can use the tools listed below. To call tools, write a block in exactly this form:\n\n"
    f"<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="TOOL_NAME">\n'
    f'<{DSML}parameter name="PARAMETER_NAME" string="true|false">VALUE</{DSML}parameter>\n'
    "...\n"
    f"</{DSML}invoke>\n"
    "...\n"
    f"</{DSML}tool_calls>\n\n"
    'Write string values as they are, with string="true". Write every other value (number, '
    'boolean, null, array, object) as JSON, with string="false". In thinking mode, finish your '
    f"reasoning with {THINK_END} before any tool call. Use only the tools and parameters defined "
    "by these schemas, one per line:"
)
RESPONSE_FORMAT_INSTRUCTIONS = "Your reply must strictly follow this schema:"

TOOLS_HEADER = "## Tools"
RESPONSE_FORMAT_HEADER = "## Response Format"
REASONING_EFFORTS = (None, "high", "max")  # the official encoder accepts these; only "max" changes the prompt


class ChatFormatError(ValueError):
    """A message list that cannot be encoded; the message names the message index and field."""


# ---------------------------------------------------------------------------------- encoding


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(msg: dict, index: int, key: str, *, optional: bool = False) -> str:
    """Read a text field of messages[index]; None is "" only where `optional`."""
    value = msg.get(key)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        raise ChatFormatError(f"messages[{index}].{key}: expected a string, got {type(value).__name__}")
    return value


def _tool_call_arguments(call: Any, where: str) -> tuple[str, dict]:
    """Validate one OpenAI tool call; return (name, arguments dict)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict):
        raise ChatFormatError(f"{where}.function: expected an object")
    if call.get("type", "function") != "function":
        raise ChatFormatError(f"{where}.type: expected 'function', got {call.get('type')!r}")
    name = fn.get("name")
    if not isinstance(name, str) or not name or '"' in name:
        raise ChatFormatError(f"{where}.function.name: expected a non-empty name without '\"'")
    args = fn.get("arguments")
    if args is None:
        args = {}
    elif isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ChatFormatError(f"{where}.function.arguments: invalid JSON ({exc})") from exc
    if not isinstance(args, dict):
        raise ChatFormatError(f"{where}.function.arguments: expected a JSON object")
    if any('"' in key for key in args):
        raise ChatFormatError(f"{where}.function.arguments: parameter names must not contain '\"'")
    try:
        _to_json(args)
    except (TypeError, ValueError) as exc:
        raise ChatFormatError(f"{where}.function.arguments: not JSON-serialisable ({exc})") from exc
    return name, args


def _render_tool_calls(calls: list, index: int) -> str:
    """DSML block for an assistant's tool calls ("" if there are none)."""
    if not calls:
        return ""
    invokes = []
    for k, call in enumerate(calls):
        name, args = _tool_call_arguments(call, f"messages[{index}].tool_calls[{k}]")
        params = [
            f'{PARAM_OPEN} name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else _to_json(v)}{PARAM_CLOSE}"
            for key, v in args.items()
        ]
        invokes.append(f'{INVOKE_OPEN} name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}")
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n{TOOL_CALLS_CLOSE}"


def _system_sections(tools: list[dict] | None, response_format: dict | None) -> list[str]:
    """The `## Tools` and `## Response Format` sections appended to the system text."""
    sections = []
    if tools:
        schemas = []
        for k, tool in enumerate(tools):
            schema = tool.get("function", tool) if isinstance(tool, dict) else None
            if not isinstance(schema, dict) or not isinstance(schema.get("name"), str):
                raise ChatFormatError(f"tools[{k}]: expected {{'type': 'function', 'function': {{'name': ...}}}}")
            schemas.append(_to_json(schema))
        sections.append(f"{TOOLS_HEADER}\n\n{TOOLS_INSTRUCTIONS}\n\n" + "\n".join(schemas))
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise ChatFormatError("response_format: expected an object")
        sections.append(f"{RESPONSE_FORMAT_HEADER}\n\n{RESPONSE_FORMAT_INSTRUCTIONS}\n{_to_json(response_format)}")
    return sections


def _render_user_turn(messages: list[dict], start: int, stop: int, call_order: dict[str, int]) -> str:
    """Merge messages[start:stop] (user and tool) into one user turn's text.

    Tool results become <tool_result> blocks, reordered to follow the preceding assistant's
    tool-call order; user texts keep their places. Blocks are joined by blank lines.
    """
    blocks: list[tuple[int | None, str]] = []
    seen: set[str] = set()
    for i in range(start, stop):
        msg = messages[i]
        if msg["role"] == "user":
            blocks.append((None, _text(msg, i, "content")))
            continue
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or call_id not in call_order:
            raise ChatFormatError(
                f"messages[{i}].tool_call_id: {call_id!r} matches no tool call of the preceding assistant message"
            )
        if call_id in seen:
            raise ChatFormatError(f"messages[{i}].tool_call_id: duplicate result for tool call {call_id!r}")
        seen.add(call_id)
        blocks.append((call_order[call_id], f"<tool_result>{_text(msg, i, 'content')}</tool_result>"))
    results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
    return "\n\n".join(next(results)[1] if pos is not None else text for pos, text in blocks)


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
    tools: list[dict] | None = None,
    response_format: dict | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Encode OpenAI-style chat messages into the DSV4 prompt string (DSV4_FACTS section 6).

    Args:
        messages: dicts with `role` in system/user/assistant/tool. Assistant messages may carry
            `reasoning_content` and `tool_calls`; tool messages need `tool_call_id` and `content`.
        thinking: thinking mode (generation opens with `<think>`) instead of chat mode (`</think>`).
        reasoning_effort: None, "high" or "max"; only "max" in thinking mode adds a preamble.
        drop_thinking: drop the reasoning of assistant turns before the last user turn
            (ignored, i.e. reasoning kept, when `tools` are given).
        tools: OpenAI tool definitions, rendered as a `## Tools` section of the system text.
        response_format: rendered as a `## Response Format` section of the system text.
        add_generation_prompt: end with `<｜Assistant｜>` + `<think>`/`</think>` when the
            conversation ends in a user/tool turn.
    Returns:
        The prompt text, special tokens written as strings (BOS first).
    Raises:
        ChatFormatError: a malformed message, naming its index and field.
    """
    if reasoning_effort not in REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {reasoning_effort!r}")
    if not isinstance(messages, list):
        raise ChatFormatError("messages: expected a list of message objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant", "tool"):
            role = msg.get("role") if isinstance(msg, dict) else None
            raise ChatFormatError(f"messages[{i}].role: unknown role {role!r}")

    n = len(messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] in ("user", "tool")), default=-1)
    keep_all_reasoning = not drop_thinking or bool(tools)
    sections = _system_sections(tools, response_format)
    first_system = next((i for i, m in enumerate(messages) if m["role"] == "system"), None)

    out = [BOS]
    if thinking and reasoning_effort == "max":
        out.append(REASONING_EFFORT_MAX_PREAMBLE)
    if sections and first_system is None:
        out.append("\n\n".join(sections))
    call_order: dict[str, int] = {}  # tool-call id -> position, for the latest assistant message
    i = 0
    while i < n:
        msg, role = messages[i], messages[i]["role"]
        if role == "system":
            text = _text(msg, i, "content")
            out.append("\n\n".join(([text] if text else []) + sections) if i == first_system else text)
        elif role == "assistant":
            calls = msg.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatFormatError(f"messages[{i}].tool_calls: expected a list")
            keep = thinking and (keep_all_reasoning or i > last_user)
            reasoning = _text(msg, i, "reasoning_content", optional=True)
            content = _text(msg, i, "content", optional=True)
            tool_calls = _render_tool_calls(calls, i)
            out.append((reasoning + THINK_END if keep else "") + content + tool_calls + EOS)
            call_order = {c["id"]: k for k, c in enumerate(calls) if isinstance(c.get("id"), str)}
        else:  # a run of user/tool messages is one user turn
            stop = i
            while stop < n and messages[stop]["role"] in ("user", "tool"):
                stop += 1
            out.append(USER + _render_user_turn(messages, i, stop, call_order))
            if (stop < n and messages[stop]["role"] == "assistant") or (stop == n and add_generation_prompt):
                opens_thinking = thinking and (keep_all_reasoning or stop - 1 >= last_user)
                out.append(ASSISTANT + (THINK_START if opens_thinking else THINK_END))
            i = stop
            continue
        i += 1
    return "".join(out)
