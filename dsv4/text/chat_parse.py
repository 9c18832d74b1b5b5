"""Parsing a DSV4 completion back into reasoning, content and tool calls (DSV4_FACTS section 6).

A completion is what the model writes after the prompt, decoded with special tokens kept:

    completion = [reasoning "</think>"] content ["\\n\\n" tool_calls block] EOS
    block      = "<｜DSML｜tool_calls>" invoke* "</｜DSML｜tool_calls>"
    invoke     = '<｜DSML｜invoke name="NAME">' parameter* "</｜DSML｜invoke>"
    parameter  = '<｜DSML｜parameter name="KEY" string="true|false">' VALUE "</｜DSML｜parameter>"

(reasoning only in thinking mode; whitespace between block elements is free). `parse_completion`
reads a whole text, `StreamingParser` the same text fed in pieces; both run one state machine, so
every chunking gives the same result, and no prefix of markup is ever emitted as text.

Lenient where DeepSeek's own parser is: a parameter VALUE is data up to its own
`</｜DSML｜parameter>` (DSML, role markers, other closing tags inside it are text), an empty block
means no calls, and role markers (`<｜User｜>`, ...) in reasoning or content are text. Anything
else that looks like markup and is not well-formed is an error (a `ParseError` event and
`ParsedCompletion.error`, raw text kept), never content and never a half-parsed call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Union

from dsv4.text.markup import (
    BOS,
    DSML,
    EOS,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_START,
    TOOL_CALLS_TAG,
    to_json,
)


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
    """Malformed markup. `raw` is the offending text: the stray marker, or the tool_calls block
    from its opening tag up to where it went wrong. Nothing after it is parsed."""

    message: str
    raw: str


Event = Union[ReasoningDelta, ContentDelta, ToolCallEvent, ParseError]

# Markup that never belongs in reasoning or content. Role markers are not here: the official
# parser keeps them as text, and so do we.
_STRAY = (BOS, THINK_START, f"<{DSML}", f"</{DSML}")
_REASONING_MARKERS = (THINK_END, EOS, TOOL_CALLS_START, *_STRAY)
_CONTENT_MARKERS = (EOS, TOOL_CALLS_START, THINK_END, *_STRAY)
_INVOKE_TAG = re.compile(rf'{INVOKE_OPEN} name="([^"\n]+)">')
_PARAM_TAG = re.compile(rf'{PARAM_OPEN} name="([^"\n]+)" string="(true|false)">')
_SPACE = re.compile(r"\s*")


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
    firsts = {m[0] for m in markers}      # a tail can grow into a marker only from a marker's first character
    for s in range(max(0, len(buf) - longest + 1), len(buf)):
        if buf[s] not in firsts:
            continue
        tail = buf[s:]
        if any(len(m) > len(tail) and m.startswith(tail) for m in markers):
            return (pos, found) if found is not None and pos < s else (min(s, pos), None)
    return pos, found


def _starts(buf: str, options: tuple[str, ...], final: bool) -> str | None:
    """Which of `options` `buf` starts with: that option, "" if none can, or None while
    undecided (`buf` is a proper prefix of an option and more text may come)."""
    for option in options:
        if buf.startswith(option):
            return option
    if not final and any(option.startswith(buf) for option in options):
        return None
    return ""


def _tag_end(buf: str, final: bool) -> int | None:
    """End of the tag `buf` starts with: just past its ">", or at the newline or end of text
    that cuts it short (tags are one line). None while undecided."""
    gt, nl = buf.find(">"), buf.find("\n")
    if gt != -1 and (nl == -1 or gt < nl):
        return gt + 1
    if nl != -1:
        return nl
    return len(buf) if final else None


#: stray text inside a tool block is reported (and the block failed) after at most this many characters
_STRAY_TEXT = 80


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class StreamingParser:
    """Incremental completion parser: `feed` text deltas, then `finish`.

    Never emits a prefix of markup (`</think>`, the tool-call block start, EOS, ...) as text:
    such a suffix is held until it is decided. Events are chunking-independent: any split of
    the same text gives the same events (up to how deltas are cut) as `parse_completion`.

    Args:
        thinking: the prompt opened `<think>`, so the completion starts with reasoning.
        call_id_prefix: tool-call ids are `f"{call_id_prefix}{n}"`, n counting from 0; a server
            passes a per-request prefix to make ids unique.
    """

    def __init__(self, thinking: bool, call_id_prefix: str = "call_") -> None:
        self.thinking = thinking
        self.call_id_prefix = call_id_prefix
        self._state = "reasoning" if thinking else "content"
        self._buf = ""  # text not yet decided
        self._block: list[str] = []  # the tool-call block consumed so far (for error reports)
        self._name = ""  # the open invoke: tool name, arguments so far
        self._args: dict[str, Any] = {}
        self._param: tuple[str, bool] = ("", True)  # the open parameter: (key, string="true")
        self._value: list[str] = []  # its value read so far
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

    # ------------------------------------------------------------------ the state machine

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
        if state == "tag":
            return self._step_tag(final)
        if state == "block":
            return self._step_block(final)
        if state == "invoke":
            return self._step_invoke(final, events)
        if state == "value":
            return self._step_value(final)
        if state == "after":
            return self._step_after(final)
        if state == "done" and final and self._buf:
            raise _MarkupError(f"unexpected text after {EOS}", self._buf)
        if state == "error":
            self._buf = ""
        return False

    def _step_text(self, final: bool, events: list[Event]) -> bool:
        """Reasoning or content: emit plain text up to the next certain marker, then act on it."""
        reasoning = self._state == "reasoning"
        pos, marker = _scan(self._buf, _REASONING_MARKERS if reasoning else _CONTENT_MARKERS, final)
        if pos:
            (self._reasoning if reasoning else self._content).append(self._buf[:pos])
            events.append((ReasoningDelta if reasoning else ContentDelta)(self._buf[:pos]))
        if marker == TOOL_CALLS_START and not reasoning:
            # drop the blank line but keep the tag: errors report the block from its tag on
            self._state, self._buf = "tag", self._buf[pos + TOOL_CALLS_START.index("<") :]
            return True
        self._buf = self._buf[pos + len(marker or "") :]
        if marker is None:
            return False
        if reasoning and marker == THINK_END:
            self._state = "content"
        elif not reasoning and marker == EOS:
            self._state = "done"
        elif marker == EOS:
            raise _MarkupError(f"{EOS} before {THINK_END}", marker)
        elif marker.lstrip("\n").startswith(("<" + DSML, "</" + DSML)):
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

    # ------------------------------------------------------------------ the tool-call block
    # `_buf` starts where parsing stands; what the block has consumed so far is in `_block`, so an
    # error can report the block from its "<｜DSML｜tool_calls" tag up to where it went wrong, and
    # `_buf` stays short however long a value grows. Nothing is emitted but whole calls, so
    # holding the block back can never leak markup.

    def _take(self, n: int) -> str:
        """Consume `_buf[:n]` into the block."""
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._block.append(taken)
        return taken

    def _fail(self, message: str, end: int) -> _MarkupError:
        return _MarkupError(message, "".join(self._block) + self._buf[:end])

    def _unexpected(self, where: str, final: bool, closers: tuple[str, ...] = ()) -> bool:
        """Text that is no element here: fail as soon as the stray text's extent is certain (up to
        a newline, a closing tag in ``closers``, or 80 characters, whichever comes first), so the
        error reads alike in any chunking and comes early; False while that is undecided."""
        pos, found = _scan(self._buf, ("\n",) + closers, final)
        if found is None and pos < _STRAY_TEXT and not final:
            return False
        end = min(pos, _STRAY_TEXT)
        raise self._fail(f"unexpected text {where}: {self._buf[:end]!r}", end)

    def _step_tag(self, final: bool) -> bool:
        """"<｜DSML｜tool_calls" must be closed by ">" at once."""
        n = len(TOOL_CALLS_TAG)
        if len(self._buf) == n:
            if final:
                raise self._fail(f"unclosed {TOOL_CALLS_TAG}> block at end of text", n)
            return False
        if self._buf[n] != ">":
            raise self._fail(f"malformed {TOOL_CALLS_TAG}> tag", n + 1)
        self._take(n + 1)
        self._state = "block"
        return True

    def _step_block(self, final: bool) -> bool:
        """Between invokes: open the next invoke, close the block, or fail."""
        self._take(_SPACE.match(self._buf).end())
        found = _starts(self._buf, (INVOKE_OPEN, TOOL_CALLS_CLOSE, EOS), final)
        if found is None:
            return False
        if found == INVOKE_OPEN:
            end = _tag_end(self._buf, final)
            if end is None:
                return False
            tag = _INVOKE_TAG.fullmatch(self._buf, 0, end)
            if tag is None:
                raise self._fail(f"malformed {INVOKE_OPEN}> tag", end)
            self._take(end)
            self._state, self._name, self._args = "invoke", tag.group(1), {}
            return True
        if found == TOOL_CALLS_CLOSE:
            self._state, self._buf, self._block, self._block_closed = "after", self._buf[len(found) :], [], True
            return True
        if found == EOS:
            raise self._fail(f"unclosed {TOOL_CALLS_TAG}> block before {EOS}", len(EOS))
        if not self._buf:
            raise self._fail(f"unclosed {TOOL_CALLS_TAG}> block at end of text", 0)
        return self._unexpected(f"in {TOOL_CALLS_TAG}> block", final, (TOOL_CALLS_CLOSE,))

    def _step_invoke(self, final: bool, events: list[Event]) -> bool:
        """Inside an invoke: open the next parameter, close the invoke (emitting its call), or fail."""
        self._take(_SPACE.match(self._buf).end())
        found = _starts(self._buf, (PARAM_OPEN, INVOKE_CLOSE, INVOKE_OPEN, TOOL_CALLS_CLOSE, EOS), final)
        if found is None:
            return False
        if found == PARAM_OPEN:
            return self._open_parameter(final)
        if found == INVOKE_CLOSE:
            self._take(len(found))
            call_id = f"{self.call_id_prefix}{len(self._calls)}"
            call = ToolCall(self._name, self._args, to_json(self._args), call_id)
            self._calls.append(call)
            events.append(ToolCallEvent(call))
            self._state = "block"
            return True
        if found:  # another invoke, the block's end or EOS before this invoke closed
            raise self._fail(f"unclosed {INVOKE_OPEN}> before {found}", len(found))
        if not self._buf:
            raise self._fail(f"unclosed {INVOKE_OPEN}> at end of text", 0)
        return self._unexpected(f"in {INVOKE_OPEN}> {self._name!r}", final, (INVOKE_CLOSE, TOOL_CALLS_CLOSE))

    def _open_parameter(self, final: bool) -> bool:
        """`<｜DSML｜parameter name="KEY" string="true|false">`: start reading its value."""
        end = _tag_end(self._buf, final)
        if end is None:
            return False
        tag = _PARAM_TAG.fullmatch(self._buf, 0, end)
        if tag is None:
            raise self._fail(f"tool {self._name!r}: malformed {PARAM_OPEN}> tag", end)
        key, string = tag.groups()
        if key in self._args:
            raise self._fail(f"tool {self._name!r}: duplicate parameter {key!r}", end)
        self._take(end)
        self._state, self._param, self._value = "value", (key, string == "true"), []
        return True

    def _step_value(self, final: bool) -> bool:
        """A parameter value: everything up to its own closing tag is data."""
        key, string = self._param
        close = self._buf.find(PARAM_CLOSE)
        if close == -1:
            if final:
                raise self._fail(f"tool {self._name!r}: parameter {key!r} is not closed", len(self._buf))
            # keep only a tail that may be the start of the closing tag
            self._value.append(self._take(max(0, len(self._buf) - len(PARAM_CLOSE) + 1)))
            return False
        value = "".join(self._value) + self._buf[:close]
        end = close + len(PARAM_CLOSE)
        if string:
            self._args[key] = value
        else:
            try:
                self._args[key] = json.loads(value, parse_constant=_reject_constant)
            except ValueError:
                message = f"tool {self._name!r}: parameter {key!r} is not valid JSON: {value[:80]!r}"
                raise self._fail(message, end) from None
        self._take(end)
        self._state = "invoke"
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
