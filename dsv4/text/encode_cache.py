"""Tokenizing only what is new: an agent resends its whole conversation every turn.

A chat prompt is rendered text with special tokens between the messages (``<｜User｜>``,
``<｜Assistant｜>``, ...), and turn k+1's text starts with most of turn k's. A fast tokenizer splits
its input at special-token strings first and tokenizes each piece between them on its own, so the
ids of a text are the ids of its first part up to just after such a token, followed by the ids of the
rest. :class:`EncodeCache` keeps the last texts encoded with those cut points (character offset ->
id offset) and encodes a new text as the longest cached part it starts with plus the rest: a 36K-token
conversation costs the tokens of its new turn, not ~35 ms of tokenizing it all again.

The cut is exact only after a token the tokenizer always isolates the same way: an added token
matched on the raw text (not normalized), that strips no whitespace around it, need not stand alone,
and lies inside no other added token (so no longer match can span the cut). Other added tokens are
never cut after; a tokenizer with a normalizer, or a pre-tokenizer that adds something to the
start of a text (a prefix space, Metaspace), gets no cuts at all. ``tests/test_text_tokenizer.py``
checks the ids equal a plain encode on random texts.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import tokenizers


@dataclass
class _Entry:
    key: int
    text: str
    ids: list[int]
    cuts: list[int]        # character offsets right after a cut token, increasing
    at: list[int]          # the id offset at each cut


class EncodeCache:
    """The last ``size`` texts encoded by ``hf``, with their cut points; thread-safe."""

    def __init__(self, hf: tokenizers.Tokenizer, size: int = 32, min_chars: int = 2048):
        self.hf, self.size, self.min_chars = hf, size, min_chars
        self.cut_ids = _cut_ids(hf)
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self._keys = itertools.count()
        self.reused_chars = 0          # characters served from the cache (a counter for benchmarks)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` (no special tokens added), as ``hf.encode(text).ids``."""
        if len(text) < self.min_chars or not self.cut_ids:
            return list(self.hf.encode(text, add_special_tokens=False).ids)
        with self._lock:
            entry, k = self._longest(text)
        start = entry.cuts[k - 1] if entry else 0
        head = entry.ids[:entry.at[k - 1]] if entry else []
        enc = self.hf.encode(text[start:], add_special_tokens=False)
        new = enc.ids                               # (a new list at every access: read once)
        ids = head + new
        cuts, at = self._cuts(text, start, len(head), enc, new)
        if entry:
            cuts, at = entry.cuts[:k] + cuts, entry.at[:k] + at
        with self._lock:
            self.reused_chars += start
            key = next(self._keys)
            self._entries[key] = _Entry(key, text, ids, cuts, at)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        return list(ids)

    def _longest(self, text: str) -> tuple[_Entry | None, int]:
        """The cached text sharing the longest cut with ``text`` (a cut before its last character:
        at least one character is encoded afresh), and how many of its cuts ``text`` starts with."""
        best, best_k = None, 0
        for entry in reversed(self._entries.values()):
            lo, hi = 0, len(entry.cuts)          # entry.cuts[:lo] all match: binary search
            while lo < hi:
                mid = (lo + hi) // 2
                c = entry.cuts[mid]
                if c < len(text) and text.startswith(entry.text[:c]):
                    lo = mid + 1
                else:
                    hi = mid
            if lo and (best is None or entry.cuts[lo - 1] > best.cuts[best_k - 1]):
                best, best_k = entry, lo
        if best is not None:
            self._entries.move_to_end(best.key)
        return best, best_k

    def _cuts(self, text: str, start: int, first: int, enc: tokenizers.Encoding, ids: list[int]
              ) -> tuple[list[int], list[int]]:
        """Cut points of the part of ``text`` from ``start`` that ``enc`` encodes (its ``ids`` begin
        at id offset ``first``): after each cut token, where the text really holds that token there."""
        cuts, at, table = [], [], self.cut_ids
        for i in [i for i, token in enumerate(ids) if token in table]:
            end = start + enc.token_to_chars(i)[1]
            if text.endswith(table[ids[i]], 0, end):
                cuts.append(end)
                at.append(first + i + 1)
        return cuts, at


def _per_piece(node: object) -> bool:
    """Whether a pre-tokenizer (its JSON) treats every piece alike: nothing added at the start of
    the first piece only (a prefix space, Metaspace's prepend scheme)."""
    if isinstance(node, dict):
        if node.get("add_prefix_space") or node.get("type") == "Metaspace" or "prepend_scheme" in node:
            return False
        return all(_per_piece(v) for v in node.values())
    if isinstance(node, list):
        return all(_per_piece(v) for v in node)
    return True


def _cut_ids(hf: tokenizers.Tokenizer) -> dict[int, str]:
    """The added tokens a text may be cut after (module docstring): id -> string."""
    if hf.normalizer is not None or not _per_piece(json.loads(hf.to_str()).get("pre_tokenizer")):
        return {}
    added = hf.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    out = {}
    for i, t in added.items():
        if t.lstrip or t.rstrip or t.single_word or t.normalized or not t.content:
            continue
        if any(t.content in other and other != t.content for other in contents):
            continue
        out[i] = t.content
    return out
