"""``dsv4 chat``: a multi-turn terminal chat with streaming, dimmed thinking and slash commands.

Commands: ``/think on|off`` switches thinking mode, ``/max N`` sets the token limit of an answer,
``/reset`` clears the history, ``/exit`` leaves. Ctrl-C while an answer streams stops that answer
(what was written so far stays in the history) and returns to the prompt; Ctrl-C or Ctrl-D at the
prompt ends the session. Input that is not a terminal (``dsv4 chat < questions.txt``) is echoed
after the prompt, so the output reads as a transcript. A fixed seed gives answer n seed + n.

Nothing generated is ever invisible. The chat parser holds back markup until it can decide what
it is (a tool-call block is held until it closes); when it has held more than
:data:`RAW_AFTER_CHARS` characters, the held text is streamed as it comes, dimmed after a
``[raw]`` label. At the first malformed block the raw text is shown, the answer stops there and
generation with it, instead of running on silently to the token limit.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import TextIO

from .engine.llm import LLM
from .engine.sampling import SamplingParams
from .errors import Dsv4Error
from .text.chat import (ChatFormatError, ContentDelta, ParseError, ReasoningDelta, StreamingParser, ToolCallEvent,
                        encode_messages)
from .text.tokenizer import IncrementalDetokenizer

DIM, RESET = "\x1b[2m", "\x1b[0m"
# The parser holds at most a marker's prefix (under 32 characters) while reading plain text; more
# than this held means a block (a tool call, or markup it cannot place yet): show it raw.
RAW_AFTER_CHARS = 48


def help_line(max_tokens: int) -> str:
    return (f"commands: /think on|off, /max N (answer token limit, now {max_tokens}), /reset, /exit   "
            "(Ctrl-C stops an answer)")


class ChatSession:
    """History plus settings; :meth:`ask` streams one answer and records it."""

    def __init__(self, llm: LLM, params: SamplingParams, thinking: bool = False, system: str | None = None,
                 out: TextIO | None = None):
        self.llm, self.params, self.thinking, self.system = llm, params, thinking, system
        self.out = out or sys.stdout
        self.color = self.out.isatty()
        self.history: list[dict] = []

    def reset(self) -> None:
        self.history = []

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def command(self, line: str) -> bool:
        """Handle a slash command; False means leave the session."""
        words = line.split()
        if words[0] in ("/exit", "/quit"):
            return False
        if words[0] == "/reset":
            self.reset()
            self._say("(history cleared)")
        elif words[0] == "/think" and len(words) == 2 and words[1] in ("on", "off"):
            self.thinking = words[1] == "on"
            self._say(f"(thinking {'on' if self.thinking else 'off'})")
        elif words[0] == "/max" and len(words) <= 2:
            self._set_max(words[1] if len(words) == 2 else None)
        else:
            self._say(help_line(self.params.max_tokens))
        return True

    def _set_max(self, value: str | None) -> None:
        if value is None:
            self._say(f"(answers stop after {self.params.max_tokens} tokens)")
            return
        if not value.isdigit() or int(value) < 1:
            self._say(f"(/max takes a positive number of tokens, got {value!r})")
            return
        self.params = dataclasses.replace(self.params, max_tokens=int(value))
        self._say(f"(answers stop after {self.params.max_tokens} tokens)")

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def _dim(self, text: str) -> str:
        return f"{DIM}{text}{RESET}" if self.color else text

    def turn_params(self) -> SamplingParams:
        """The sampling params of the answer to the last user message. A fixed ``--seed`` is the
        seed of the first answer; answer n gets seed + n, so answers differ from turn to turn and a
        session replays exactly (a turn that failed or /reset does not advance the count)."""
        if self.params.seed is None:
            return self.params
        turn = sum(m["role"] == "user" for m in self.history) - 1
        return dataclasses.replace(self.params, seed=self.params.seed + turn)

    def _generate(self) -> Iterator[tuple[str, list, str | None]]:
        """``(raw text, parser events, finish reason)`` per generated token of the next answer."""
        prompt = encode_messages(self.messages(), thinking=self.thinking)
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise ChatFormatError(f"{self.llm.path} has no tokenizer.json: chat needs one")
        ids = tokenizer.encode(prompt)
        parser = StreamingParser(thinking=self.thinking)
        detok = IncrementalDetokenizer(tokenizer, ids)  # special tokens kept: the parser reads them
        for event in self.llm.stream(ids, self.turn_params()):
            text = detok.push(event.token_id)
            events = parser.feed(text)
            if event.finished:
                tail = detok.flush()
                text += tail
                events += parser.feed(tail) + parser.finish()
            yield text, events, event.output.finish_reason if event.finished else None

    def ask(self, text: str) -> dict:
        """Stream the answer to ``text``; Ctrl-C stops it early. Returns the assistant message."""
        self.history.append({"role": "user", "content": text})
        view = _AnswerView(self)
        stream = self._generate()
        try:
            for raw, events, finish in stream:
                if not view.show(raw, events):
                    break  # malformed markup: stop generating here
                if finish == "length":
                    view.note(f"[stopped at the {self.params.max_tokens}-token limit; /max N changes it]")
        except KeyboardInterrupt:
            view.note("[stopped]")
        except (Dsv4Error, ChatFormatError) as e:  # e.g. the conversation outgrew the context: keep the session
            stream.close()
            self.history.pop()
            view.end()
            self._say(f"[error: {e}]")
            return {}
        finally:
            stream.close()  # ends generation when the answer stopped early
        view.end()
        message = view.message()
        self.history.append(message)
        return message


class _AnswerView:
    """Writes one answer as it streams: reasoning dimmed, content plain, held markup raw."""

    def __init__(self, session: ChatSession):
        self.s, self.out = session, session.out
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list = []
        self.pending = ""   # raw text the parser has not emitted as text yet (markup, held blocks)
        self.raw = False    # pending text is being shown raw
        self.dim = False    # the terminal is in dim mode (reasoning)
        self.reasoned = False  # reasoning was shown: the content starts on a new line

    def show(self, raw_text: str, events: list) -> bool:
        """Show one token's text; False at the first malformed block."""
        self.pending += raw_text
        if self.raw:
            self._write_raw(raw_text)
        for event in events:
            if isinstance(event, ParseError):
                if not self.raw:
                    self._start_raw()
                self._end_raw()
                self._write(f"[malformed output: {event.message}; answer stopped]")
                return False
            self._end_raw()
            if isinstance(event, (ReasoningDelta, ContentDelta)):
                self._text(event)
            elif isinstance(event, ToolCallEvent):
                self.calls.append(event.call)
                self.pending = ""
                self._write(f"\n[tool call {event.call.name}({event.call.arguments_json})]")
        if not self.raw and len(self.pending) > RAW_AFTER_CHARS:
            self._start_raw()
        self.out.flush()
        return True

    def _text(self, event: ReasoningDelta | ContentDelta) -> None:
        thinking = isinstance(event, ReasoningDelta)
        (self.reasoning if thinking else self.content).append(event.text)
        at = self.pending.find(event.text)  # drop the emitted text and the markup consumed before it
        self.pending = self.pending[at + len(event.text):] if at >= 0 else ""
        if thinking:
            self.reasoned = True
            if self.s.color and not self.dim:
                self._write(DIM)
                self.dim = True
        elif self.reasoned:
            self._write((RESET if self.dim else "") + "\n")
            self.dim = self.reasoned = False
        self._write(event.text)

    def _start_raw(self) -> None:
        self.raw = True
        self._write("\n" + self.s._dim("[raw] "))
        self._write_raw(self.pending.lstrip("\n"))

    def _write_raw(self, text: str) -> None:
        self._write(self.s._dim(text))

    def _end_raw(self) -> None:
        if self.raw:
            self.raw, self.pending = False, ""
            self._write("\n")

    def note(self, text: str) -> None:
        self._write(("" if not self.dim else RESET) + " " + text)
        self.dim = False

    def _write(self, text: str) -> None:
        self.out.write(text)

    def end(self) -> None:
        if self.dim:
            self._write(RESET)
        self._write("\n")
        self.out.flush()

    def message(self) -> dict:
        message: dict = {"role": "assistant", "content": "".join(self.content)}
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json}}
                                     for c in self.calls]
        return message


def run_chat(llm: LLM, params: SamplingParams, thinking: bool = False, system: str | None = None,
             stdin: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    session = ChatSession(llm, params, thinking, system)
    echo = not stdin.isatty()
    session._say(f"dsv4 chat on {llm.path} -- {help_line(params.max_tokens)}")
    while True:
        try:
            session.out.write("> ")
            session.out.flush()
            line = stdin.readline()
        except KeyboardInterrupt:
            session._say("")
            return 0
        if not line:  # Ctrl-D / end of input
            session._say("")
            return 0
        if echo:  # piped input: show the user's turn, so that the output reads as a transcript
            session._say(line.rstrip("\n"))
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        session.ask(line)
