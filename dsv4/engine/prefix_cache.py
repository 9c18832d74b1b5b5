"""Automatic prefix caching: the host-side index of cached slot states (DESIGN decision 7).

A prompt is cut into blocks of ``block`` tokens (:func:`dsv4.model.cache.block_size`: 128 on Flash
and Pro). Each block's id chains the hash of its tokens with its parent's id, so equal prefixes get
equal ids whatever follows them. A :class:`Node` per cached block holds the page with that block's
compressed entries and indexer keys (append-only state, shared by every longer prefix); a node may
also hold a *tail*: the window ring and the overlapping compressors' last windows at its end, which
is what lets a request start there. Tails are saved where a request's prompt reaches its last block
boundaries, where it parts from cached blocks other requests saved (so the second user of a shared
system prompt saves a tail at its end, and the third one hits it), and where a request's decoding
last crossed a boundary (kept when the request ends), so turn k+1 of a conversation hits
everything up to turn k's last full block. A save point inside a prompt chunk does not end the
chunk: the forward snapshots the state there (up to ``SNAPSHOTS`` a step, see
:mod:`~dsv4.engine.prefix_store`; a chunk ends at any further one), so caching adds no step. Requests that arrive together with a common prefix
nobody has cached (many users of one system prompt at once) do not all compute it: the scheduler
runs the first one, gives it a save point where the others part from it, and admits the others
once that state is saved, from the cache (:meth:`Scheduler._waits_for_prefix`).

A new request starts from its longest cached boundary at most ``len(prompt) - 1`` tokens in (at
least one token is run, for the logits of the first output token); only the rest is prefilled.

Memory: the pages of :class:`~dsv4.engine.prefix_store.PrefixStore`, a byte budget fixed at start.
When pages run out the least recently used tails and leaf blocks go first; nodes a scheduled
request will read (``refs``) and a running request's not yet published pages are never evicted.
The index is plain host data; every device copy it plans travels in the step's
:class:`~dsv4.engine.batch.ScheduledBatch` (``NewSequence.cached`` restores, ``saves``), so the
runner of every tensor-parallel rank executes it. Nothing outlives the process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from .batch import CachedPrefix, Save

_ROOT = b"dsv4-prefix-cache-v1"


@dataclass
class Node:
    """One cached block: its id, parent, entry page and (optional) tail pages."""

    key: bytes
    parent: "Node | None"
    depth: int                        # blocks from the start, this one included
    page: int
    tail: tuple[int, ...] = ()
    children: int = 0
    refs: int = 0                     # scheduled restores that will read this node


@dataclass
class CacheStats:
    """Counters for the metrics (cumulative) and the bytes in use now."""

    queries: int = 0                  # prompt tokens looked up
    hits: int = 0                     # prompt tokens served from the cache
    evictions: int = 0                # tails and blocks evicted
    used_bytes: int = 0
    capacity_bytes: int = 0


@dataclass
class Pending:
    """A running request's saved but not yet published state: entry pages of blocks
    ``first_block ..`` and the tail at the end of the last one (at decode-time boundaries the
    tokens are hashed only when the request ends: the host may not know the newest token yet)."""

    first_block: int
    pages: list[int] = field(default_factory=list)
    tail: tuple[int, ...] = ()


def root_key(salt: str | None) -> bytes:
    """The id every chain starts from: one per cache salt."""
    return _ROOT if salt is None else hashlib.sha256(_ROOT + b"/salt/" + salt.encode()).digest()


def block_keys(tokens: Sequence[int], block: int, n_blocks: int, parent: bytes = _ROOT) -> list[bytes]:
    """The chained ids of the first ``n_blocks`` full blocks of ``tokens``."""
    keys = []
    for i in range(n_blocks):
        h = hashlib.sha256(parent)
        h.update(array("q", tokens[i * block:(i + 1) * block]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """The index over ``num_pages`` pages: ``tail_pages`` make one tail, one page one block."""

    def __init__(self, block: int, num_pages: int, tail_pages: int, page_bytes: int):
        self.block, self.tail_pages, self.page_bytes = block, tail_pages, page_bytes
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.nodes: OrderedDict[bytes, Node] = OrderedDict()     # least recently used first
        self.stats = CacheStats(capacity_bytes=num_pages * page_bytes)

    # ------------------------------------------------------------------ pages
    def _account(self) -> None:
        self.stats.used_bytes = (self.stats.capacity_bytes // self.page_bytes - len(self.free)) * self.page_bytes

    def reserve(self, n: int) -> list[int] | None:
        """``n`` free pages, evicting least recently used unreferenced tails and leaf blocks as
        needed; None when even that cannot make room."""
        while len(self.free) < n and self._evict_one():
            pass
        if len(self.free) < n:
            return None
        pages = [self.free.pop() for _ in range(n)]
        self._account()
        return pages

    def _evict_one(self) -> bool:
        """Free the least recently used unreferenced tail or leaf block; False when there is none."""
        for nd in self.nodes.values():
            if nd.refs:
                continue
            if nd.tail:
                self.free += nd.tail
                nd.tail = ()
            elif nd.children == 0:
                self._drop(nd)
            else:
                continue
            self.stats.evictions += 1
            return True
        return False

    def _drop(self, nd: Node) -> None:
        del self.nodes[nd.key]
        self.free.append(nd.page)
        self.free += nd.tail
        if nd.parent is not None:
            nd.parent.children -= 1

    def release(self, pages: Sequence[int]) -> None:
        """Give back pages that were never published (a request that ended unsaved)."""
        self.free += pages
        self._account()

    # ------------------------------------------------------------------ lookups
    def match(self, tokens: Sequence[int], salt: str | None = None, keys: Sequence[bytes] | None = None
              ) -> CachedPrefix | None:
        """The longest cached boundary at most ``len(tokens) - 1`` in, referenced (evictions spare it)
        until :meth:`unref`; None on a miss. Counts the query in the stats. ``keys``: the tokens'
        block ids when the caller has them (at least the usable ones)."""
        self.stats.queries += len(tokens)
        usable = (len(tokens) - 1) // self.block
        chain, hit = [], None
        for key in self._keys(tokens, usable, salt, keys):
            nd = self.nodes.get(key)
            if nd is None:
                break
            chain.append(nd)
            if nd.tail:
                hit = len(chain)
        if hit is None:
            return None
        chain = chain[:hit]
        for nd in chain:
            nd.refs += 1
            self.nodes.move_to_end(nd.key)
        self.stats.hits += hit * self.block
        return CachedPrefix(hit * self.block, tuple(nd.page for nd in chain), chain[-1].tail,
                            tuple(nd.key for nd in chain))

    def tail_blocks(self, keys: Sequence[bytes]) -> int:
        """Blocks of the longest cached chain prefix of ``keys`` that ends in a tail (what
        :meth:`match` would restore), without referencing or counting anything."""
        hit = 0
        for i, key in enumerate(keys):
            nd = self.nodes.get(key)
            if nd is None:
                break
            if nd.tail:
                hit = i + 1
        return hit

    def shared_length(self, tokens: Sequence[int], salt: str | None = None,
                      keys: Sequence[bytes] | None = None) -> int:
        """Tokens of the longest chain of cached blocks ``tokens`` starts with (tails or not), up to
        ``len(tokens) - 1``: where this prompt parts from what other requests sent. A tail saved
        there serves every later prompt with the same beginning (a shared system prompt)."""
        n = 0
        for key in self._keys(tokens, (len(tokens) - 1) // self.block, salt, keys):
            if key not in self.nodes:
                break
            n += 1
        return n * self.block

    def _keys(self, tokens: Sequence[int], n: int, salt: str | None, keys: Sequence[bytes] | None) -> Sequence[bytes]:
        """The first ``n`` block ids of ``tokens``: from ``keys`` when given (hashing a 36K-token
        prompt takes ~1 ms), else computed."""
        if keys is not None and len(keys) >= n:
            return keys[:n]
        return block_keys(tokens, self.block, n, root_key(salt))

    def has_tail(self, tokens: Sequence[int], n_blocks: int, salt: str | None = None) -> bool:
        """Whether the first ``n_blocks`` blocks of ``tokens`` are cached with a tail at their end."""
        keys = block_keys(tokens, self.block, n_blocks, root_key(salt))
        return all(k in self.nodes for k in keys) and bool(keys) and bool(self.nodes[keys[-1]].tail)

    def unref(self, cached: CachedPrefix) -> None:
        """The restore of ``cached`` has run (or will never run)."""
        for key in cached.keys:
            nd = self.nodes.get(key)
            if nd is not None:
                nd.refs -= 1

    # ------------------------------------------------------------------ saving
    def plan_save(self, slot: int, tokens: Sequence[int], n_blocks: int, salt: str | None = None
                  ) -> tuple[Save, tuple] | None:
        """Plan saving ``slot``'s first ``n_blocks`` blocks of ``tokens`` and its tail at their end
        (the slot holds exactly that many tokens when the save runs). Blocks already cached are
        kept, not copied. Returns the runner's :class:`Save` and what :meth:`publish` takes after
        the step ran, or None when nothing is to be saved or the pages do not fit."""
        keys = block_keys(tokens, self.block, n_blocks, root_key(salt))
        have = []
        for key in keys:
            nd = self.nodes.get(key)
            if nd is None:
                break
            have.append(nd)
        for nd in have:
            self.nodes.move_to_end(nd.key)
        if len(have) == n_blocks and have[-1].tail:
            return None
        for nd in have:                      # spared while pages are found for the rest
            nd.refs += 1
        pages = self.reserve(n_blocks - len(have) + self.tail_pages)
        for nd in have:
            nd.refs -= 1
        if pages is None:
            return None
        m = n_blocks - len(have)
        blocks, tail = pages[:m], tuple(pages[m:])
        return Save(slot, len(have), tuple(blocks), tail), (keys, len(have), blocks, tail)

    def publish(self, keys: Sequence[bytes], first: int, blocks: Sequence[int], tail: Sequence[int]) -> None:
        """Enter saved state after the step that copied it ran: ``blocks`` hold the entries of blocks
        ``first ..`` of the chain ``keys`` (the ones before must be cached), ``tail`` the tail at
        its end. Pages that turn out not to be needed (another request entered the same blocks
        first, or an ancestor was evicted meanwhile) go back to the free list."""
        if first + len(blocks) != len(keys):
            raise ValueError(f"publish: {first} + {len(blocks)} blocks for a chain of {len(keys)}")
        parent = None
        for i, key in enumerate(keys):
            nd = self.nodes.get(key)
            if i < first:
                if nd is None:            # an ancestor evicted meanwhile: nothing after it can be entered
                    self.release(list(blocks) + list(tail))
                    return
            elif nd is None:
                nd = Node(key, parent, i + 1, blocks[i - first])
                self.nodes[key] = nd
                if parent is not None:
                    parent.children += 1
            else:                         # another request entered the same block first
                self.free.append(blocks[i - first])
            self.nodes.move_to_end(key)
            parent = nd
        if tail:
            if parent is None or parent.tail:
                self.free += tail
            else:
                parent.tail = tuple(tail)
        self._account()
