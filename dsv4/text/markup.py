"""The special strings of the DSV4 chat format (DSV4_FACTS section 6), shared by the encoder
(`dsv4.text.chat`) and the completion parser (`dsv4.text.chat_parse`).

Role and sentence markers are single tokens of the released tokenizer; DSML markup is ordinary
text around the special piece `｜DSML｜`. Bars are full-width (U+FF5C), `▁` is U+2581.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"

TOOL_CALLS_TAG = f"<{DSML}tool_calls"  # the opening tag, without its ">"
TOOL_CALLS_START = f"\n\n{TOOL_CALLS_TAG}"  # content ends where this begins
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_OPEN = f"<{DSML}parameter"
PARAM_CLOSE = f"</{DSML}parameter>"


def to_json(value: Any) -> str:
    """JSON the way the format writes it everywhere: `json.dumps` defaults, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


class SpecialTextFilter:
    """Leaves whole special-token strings out of streamed text: ``skip_special_tokens`` for text that
    was decoded with them kept (the chat parser needs ``</think>`` and DSML to read the answer; the
    client should not see a stray ``<｜User｜>``). A tail that may be the start of one is held back
    until the next piece shows what it is; :meth:`flush` releases it at the end."""

    def __init__(self, strings: Iterable[str]):
        strings = sorted({s for s in strings if s}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None
        self._prefixes = {s[:i] for s in strings for i in range(1, len(s))}
        self._longest = len(strings[0]) if strings else 0
        self._held = ""

    def fresh(self) -> "SpecialTextFilter":
        """A filter for another stream, sharing the compiled strings."""
        other = object.__new__(SpecialTextFilter)
        other._pattern, other._prefixes, other._longest, other._held = (self._pattern, self._prefixes,
                                                                         self._longest, "")
        return other

    def feed(self, text: str) -> str:
        text, self._held = self._held + text, ""
        if self._pattern is None:
            return text
        text = self._pattern.sub("", text)
        for n in range(min(len(text), self._longest - 1), 0, -1):
            if text[-n:] in self._prefixes:
                text, self._held = text[:-n], text[-n:]
                break
        return text

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held
