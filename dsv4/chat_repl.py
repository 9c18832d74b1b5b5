"""``dsv4 chat``: a multi-turn terminal chat with streaming, dimmed thinking and slash commands.

Commands: ``/think on|off`` switches thinking mode, ``/reset`` clears the history, ``/exit``
leaves. Ctrl-C while an answer streams stops that answer (what was written so far stays in the
history) and returns to the prompt; Ctrl-C or Ctrl-D at the prompt ends the session.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .engine.llm import LLM
from .engine.sampler import SamplingParams
from .errors import Dsv4Error
from .text.chat import ChatFormatError, ContentDelta, ParseError, ReasoningDelta, ToolCallEvent

DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = "commands: /think on|off, /reset, /exit   (Ctrl-C stops an answer)"


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
        else:
            self._say(HELP)
        return True

    def _say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def ask(self, text: str) -> dict:
        """Stream the answer to ``text``; Ctrl-C stops it early. Returns the assistant message."""
        self.history.append({"role": "user", "content": text})
        reasoning, content, calls = [], [], []
        dim = False
        try:
            for event in self.llm.chat_stream(self.messages(), self.params, thinking=self.thinking):
                if isinstance(event, ReasoningDelta):
                    if self.color and not dim:
                        self.out.write(DIM)
                        dim = True
                    reasoning.append(event.text)
                    self.out.write(event.text)
                elif isinstance(event, ContentDelta):
                    if dim:
                        self.out.write(RESET + "\n")
                        dim = False
                    content.append(event.text)
                    self.out.write(event.text)
                elif isinstance(event, ToolCallEvent):
                    calls.append(event.call)
                    self.out.write(f"\n[tool call {event.call.name}({event.call.arguments_json})]")
                elif isinstance(event, ParseError):
                    self.out.write(f"\n[malformed output: {event.message}]")
                self.out.flush()
        except KeyboardInterrupt:
            self.out.write(" [stopped]")
        except (Dsv4Error, ChatFormatError) as e:  # e.g. the conversation outgrew the context: keep the session
            self.history.pop()
            self._say(f"{RESET if dim else ''}\n[error: {e}]")
            return {}
        if dim:
            self.out.write(RESET)
        self.out.write("\n")
        message: dict = {"role": "assistant", "content": "".join(content)}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json}} for c in calls]
        self.history.append(message)
        return message


def run_chat(llm: LLM, params: SamplingParams, thinking: bool = False, system: str | None = None,
             stdin: TextIO | None = None) -> int:
    stdin = stdin or sys.stdin
    session = ChatSession(llm, params, thinking, system)
    session._say(f"dsv4 chat on {llm.path} -- {HELP}")
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
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not session.command(line):
                return 0
            continue
        session.ask(line)
