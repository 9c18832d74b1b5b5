"""Where ``dsv4 generate`` gets its prompt: the argument, stdin, or ``--prompt-ids``.

Text is decoded leniently: bytes that are not UTF-8 (in ``argv``, which Python hands over with
lone surrogates, or on stdin) become U+FFFD with a warning, never a traceback from the tokenizer.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TextIO

REPLACEMENT = "\ufffd"


def clean_text(text: str) -> tuple[str, bool]:
    """``text`` with undecodable bytes as U+FFFD, and whether any were replaced.

    Python decodes ``argv`` with ``surrogateescape``: a byte that is not UTF-8 arrives as a lone
    surrogate, which no tokenizer accepts. Encoding back restores the bytes; decoding with
    ``replace`` turns them into U+FFFD. Other lone surrogates become U+FFFD too.
    """
    try:
        text.encode("utf-8")
        return text, False
    except UnicodeEncodeError:
        pass
    raw = text.encode("utf-8", "surrogateescape" if _escaped_only(text) else "replace")
    return raw.decode("utf-8", "replace"), True


def _escaped_only(text: str) -> bool:
    """True when every lone surrogate in ``text`` is a ``surrogateescape``d byte (U+DC80..U+DCFF)."""
    return all(not 0xD800 <= ord(c) <= 0xDFFF or 0xDC80 <= ord(c) <= 0xDCFF for c in text)


def read_stdin(stream: TextIO | None = None) -> tuple[str, bool]:
    """All of stdin as text (invalid UTF-8 replaced), and whether anything was replaced."""
    stream = stream or sys.stdin
    buffer = getattr(stream, "buffer", None)
    if buffer is not None:  # read bytes: the text layer would raise on invalid UTF-8
        data = buffer.read()
        text = data.decode("utf-8", "replace")
        return text, text.encode("utf-8", "surrogatepass") != data
    return clean_text(stream.read())


def prompt_ids(text: str) -> list[int]:
    """argparse type of ``--prompt-ids``: token ids separated by commas and/or spaces."""
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    if not items:
        raise argparse.ArgumentTypeError("needs at least one token id, e.g. --prompt-ids 0,15,27")
    try:
        ids = [int(t) for t in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes integers separated by commas or spaces, got {text!r}") from None
    if any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {text!r}")
    return ids
