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
import re
from dataclasses import dataclass
from typing import Any, Union

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_START = f"\n\n<{DSML}tool_calls"  # content ends where this begins
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"

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


# ----------------------------------------------------------------------------------- parsing


@dataclass
class ToolCall:
    """One parsed tool call; `arguments_json` is `arguments` re-serialised as JSON."""

    name: str
    arguments: dict
    arguments_json: str
    id: str


@dataclass
class ParsedCompletion:
    """A parsed completion. `raw` is always the full completion text as given.

    `finish_reason`: "length" if the text ended before EOS (and before a closed tool-call
    block), else "tool_calls" if any call was parsed, else "stop". `error` is set when markup
    was malformed; parsing stops there and the rest of the text is left only in `raw`.
    """

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    error: str | None
    raw: str


@dataclass(frozen=True)
class ReasoningDelta:
    """More reasoning text (thinking mode, before `</think>`)."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """More answer text."""

    text: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A complete, well-formed tool call."""

    call: ToolCall


@dataclass(frozen=True)
class ParseError:
    """Malformed markup; `raw` is the offending text. Nothing after it is parsed."""

    message: str
    raw: str


Event = Union[ReasoningDelta, ContentDelta, ToolCallEvent, ParseError]

_DSML_OPENERS = (f"<{DSML}", f"</{DSML}")
_STRAY = (BOS, USER, ASSISTANT, LATEST_REMINDER, THINK_START, *_DSML_OPENERS)
_REASONING_MARKERS = (THINK_END, EOS, TOOL_CALLS_START, *_STRAY)
_CONTENT_MARKERS = (EOS, TOOL_CALLS_START, THINK_END, *_STRAY)
_BLOCK_MARKERS = (INVOKE_CLOSE, TOOL_CALLS_CLOSE, EOS)
_INVOKE_RE = re.compile(rf'\s*{INVOKE_OPEN} name="([^"\n]+)">(.*){INVOKE_CLOSE}', re.S)
_PARAM_RE = re.compile(rf'\s*{PARAM_OPEN} name="([^"\n]+)" string="(true|false)">(.*?){PARAM_CLOSE}', re.S)


class _MarkupError(Exception):
    """Raised inside the parser; becomes a ParseError event and `ParsedCompletion.error`."""

    def __init__(self, message: str, raw: str) -> None:
        super().__init__(message)
        self.message, self.raw = message, raw


def _scan(buf: str, markers: tuple[str, ...], final: bool, start: int = 0) -> tuple[int, str | None]:
    """Find the first marker in `buf` whose match is already certain.

    Returns (pos, marker): the earliest (then longest) complete marker at `pos`, or
    (pos, None) where `buf[:pos]` is certainly plain text: unless `final`, a tail of `buf`
    that could still grow into a marker is held back, so any chunking decides alike.
    """
    pos, found = len(buf), None
    for m in markers:
        p = buf.find(m, start)
        if p != -1 and (p < pos or (p == pos and len(m) > len(found))):
            pos, found = p, m
    if final:
        return pos, found
    longest = max(map(len, markers))
    for s in range(max(0, len(buf) - longest + 1), len(buf)):
        tail = buf[s:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return (pos, found) if found is not None and pos < s else (min(s, pos), None)
    return pos, found


def _parse_invoke(segment: str, call_id: str) -> ToolCall:
    """Parse `[ws] <invoke name="N"> params </invoke>` into a ToolCall (or raise _MarkupError)."""
    m = _INVOKE_RE.fullmatch(segment)
    if m is None:
        raise _MarkupError(f"malformed {INVOKE_OPEN}> element", segment)
    name, body = m.group(1), m.group(2)
    args: dict[str, Any] = {}
    pos = 0
    while (p := _PARAM_RE.match(body, pos)) is not None:
        key, is_string, value = p.groups()
        if DSML in value:
            raise _MarkupError(f"tool {name!r}: parameter {key!r} is not closed properly", segment)
        if key in args:
            raise _MarkupError(f"tool {name!r}: duplicate parameter {key!r}", segment)
        try:
            args[key] = value if is_string == "true" else json.loads(value)
        except json.JSONDecodeError:
            raise _MarkupError(f"tool {name!r}: parameter {key!r} is not valid JSON: {value!r}", segment) from None
        pos = p.end()
    if body[pos:].strip():
        raise _MarkupError(f"tool {name!r}: unexpected text in invoke: {body[pos:].strip()[:80]!r}", segment)
    return ToolCall(name=name, arguments=args, arguments_json=_to_json(args), id=call_id)


class StreamingParser:
    """Incremental completion parser: `feed` text deltas, then `finish`.

    Never emits a prefix of markup (`</think>`, the tool-call block start, EOS, ...) as text:
    such a suffix is held until it is decided. Events are chunking-independent: any split of
    the same text gives the same events (up to how deltas are cut) as `parse_completion`.

    Args:
        thinking: the prompt opened `<think>`, so the completion starts with reasoning.
        call_id_prefix: tool-call ids are `f"{call_id_prefix}{n}"`, n counting from 0.
    """

    def __init__(self, thinking: bool, call_id_prefix: str = "call_") -> None:
        self.thinking = thinking
        self.call_id_prefix = call_id_prefix
        self._state = "reasoning" if thinking else "content"
        self._buf = ""
        self._scanned = 0  # in the tool-call block: buf[:_scanned] holds no marker start
        self._opened = False  # the ">" of the tool_calls tag has been read
        self._raw: list[str] = []
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[ToolCall] = []
        self._error: str | None = None
        self._block_closed = False
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        """Consume a text delta; return the events it completes."""
        if self._finished:
            raise RuntimeError("StreamingParser.feed() after finish()")
        self._raw.append(text)
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        """Declare the end of the completion; flush held text and report unclosed markup."""
        if self._finished:
            return []
        self._finished = True
        return self._run(final=True)

    def result(self) -> ParsedCompletion:
        """Everything parsed so far as a ParsedCompletion (call after `finish`)."""
        raw = "".join(self._raw)
        complete = EOS in raw or self._block_closed
        reason = "length" if not complete else "tool_calls" if self._calls else "stop"
        reasoning = "".join(self._reasoning) if self.thinking else None
        return ParsedCompletion(reasoning, "".join(self._content), list(self._calls), reason, self._error, raw)

    def _run(self, final: bool) -> list[Event]:
        """Step the state machine as far as the buffered text allows; collect its events."""
        events: list[Event] = []
        try:
            while self._step(final, events):
                pass
        except _MarkupError as exc:
            self._state, self._buf, self._error = "error", "", exc.message
            events.append(ParseError(exc.message, exc.raw))
        return events

    def _step(self, final: bool, events: list[Event]) -> bool:
        """Advance the state machine once; True if it should be called again."""
        state = self._state
        if state in ("reasoning", "content"):
            return self._step_text(final, events)
        if state == "tools":
            return self._step_tools(final, events)
        if state == "after":
            return self._step_after(final)
        if state == "done" and final and self._buf:
            raise _MarkupError(f"unexpected text after {EOS}", self._buf)
        elif state == "error":
            self._buf = ""
        return False

    def _step_text(self, final: bool, events: list[Event]) -> bool:
        """Reasoning or content: emit plain text up to the next certain marker, then act on it."""
        reasoning = self._state == "reasoning"
        pos, marker = _scan(self._buf, _REASONING_MARKERS if reasoning else _CONTENT_MARKERS, final)
        if pos:
            (self._reasoning if reasoning else self._content).append(self._buf[:pos])
            events.append((ReasoningDelta if reasoning else ContentDelta)(self._buf[:pos]))
        self._buf = self._buf[pos + len(marker or "") :]
        if marker is None:
            return False
        if reasoning and marker == THINK_END:
            self._state = "content"
        elif not reasoning and marker == EOS:
            self._state = "done"
        elif not reasoning and marker == TOOL_CALLS_START:
            self._state, self._scanned = "tools", 0
        elif marker == EOS:
            raise _MarkupError(f"{EOS} before {THINK_END}", marker)
        elif marker == TOOL_CALLS_START or marker in _DSML_OPENERS:
            where = f"before {THINK_END}" if reasoning else "outside a tool_calls block"
            raise _MarkupError(f"DSML markup {where}", marker.lstrip("\n"))
        else:
            raise _MarkupError(f"unexpected {marker} in {'reasoning' if reasoning else 'content'}", marker)
        return True

    def _step_after(self, final: bool) -> bool:
        """After the closed tool-call block only whitespace and EOS may follow."""
        pos, marker = _scan(self._buf, (EOS,), final)
        if marker is None and not final:
            return False
        if self._buf[:pos].strip():
            raise _MarkupError(f"unexpected text after {TOOL_CALLS_CLOSE}", self._buf[:pos])
        if marker is None:
            self._buf = ""
            return False
        self._state, self._buf = "done", self._buf[pos + len(EOS) :]
        return True

    def _step_tools(self, final: bool, events: list[Event]) -> bool:
        """Inside the tool-call block: consume one invoke, the closing tag, or fail."""
        buf = self._buf
        head = "" if self._opened else f"<{DSML}tool_calls"  # raw markup of errors starts at the tag
        pos, marker = _scan(buf, _BLOCK_MARKERS, final, self._scanned)
        if marker is None:
            self._scanned = max(0, len(buf) - max(map(len, _BLOCK_MARKERS)))
            if final:
                what = f"{INVOKE_OPEN}>" if INVOKE_OPEN in buf else f"<{DSML}tool_calls>"
                raise _MarkupError(f"unclosed {what} at end of text", head + buf)
            return False
        end = pos + len(marker)
        segment, body = buf[:end], buf[:pos]
        self._buf, self._scanned = buf[end:], 0
        if not self._opened:
            if not body.startswith(">"):
                raise _MarkupError(f"malformed <{DSML}tool_calls> tag", head + segment)
            self._opened, segment, body = True, segment[1:], body[1:]
        if marker == INVOKE_CLOSE:
            call = _parse_invoke(segment, f"{self.call_id_prefix}{len(self._calls)}")
            self._calls.append(call)
            events.append(ToolCallEvent(call))
            return True
        if INVOKE_OPEN in body:
            raise _MarkupError(f"unclosed {INVOKE_OPEN}> before {marker}", head + segment)
        if marker == EOS:
            raise _MarkupError(f"unclosed <{DSML}tool_calls> block before {EOS}", head + segment)
        if body.strip():
            raise _MarkupError(f"unexpected text in <{DSML}tool_calls> block: {body.strip()[:80]!r}", head + segment)
        if not self._calls:
            raise _MarkupError(f"empty <{DSML}tool_calls> block", head + segment)
        self._state, self._block_closed = "after", True
        return True


def parse_completion(text: str, *, thinking: bool, call_id_prefix: str = "call_") -> ParsedCompletion:
    """Parse a whole completion (decoded with special tokens kept) into reasoning/content/calls.

    Args:
        text: what the model generated after the prompt, EOS string included if it stopped.
        thinking: the prompt opened `<think>` (reasoning runs up to `</think>`).
        call_id_prefix: tool-call ids are `f"{call_id_prefix}{n}"`.
    Returns:
        A ParsedCompletion; malformed markup sets `error` instead of raising.
    """
    parser = StreamingParser(thinking, call_id_prefix)
    parser.feed(text)
    parser.finish()
    return parser.result()
