"""Continuous batching: which requests run in the next step (DESIGN decision 5).

The scheduler owns the request queues and the slot table; it knows token ids, never tensors. Each
:meth:`Scheduler.schedule` call returns a :class:`StepPlan`: every running request that is past its
prompt decodes one token, and what is left of the per-step token budget goes to prompt chunks
(chunked prefill), oldest request first, so a long prompt delays the others by at most one chunk.

Queues are first come, first served: ``waiting`` (not admitted), ``running`` (holding a slot).
A request is admitted when a slot is free; a request that could never fit (prompt + max_tokens
over ``max_model_len``) is refused with a named error when it is added, before any state is
touched. A finished or aborted request frees its slot in the step it ends; the next waiting one
takes it. :meth:`abort` is safe from any thread: it only records the id; the engine thread applies
it at the start of the next :meth:`schedule`.

This module never reads a tensor: the runner executes the plan, the engine feeds the sampled ids
back with :meth:`Scheduler.append_token`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ..errors import ContextOverflowError, RequestError
from .batch import CachedPrefix
from .prefix_cache import Pending, PrefixCache, block_keys, root_key
from .sampling import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request as the scheduler sees it: ids in, ids out, a slot while it runs."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None    # shares cached prefixes only with requests of the same salt
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_prefilled: int = 0           # prompt tokens already in the slot's state
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    num_cached_tokens: int = 0       # prompt tokens restored from the prefix cache
    cached: CachedPrefix | None = None   # the hit to restore with the first chunk (until it ran)
    save_at: tuple[int, ...] = ()    # block boundaries in the prompt where its state is saved
    saved_blocks: int = 0            # blocks of this request known to be in the cache
    pending: Pending | None = None   # state saved while decoding, entered when the request ends
    keys: list[bytes] | None = None  # the chained ids of the prompt's full blocks (prefix caching)

    @property
    def in_prefill(self) -> bool:
        return self.num_prefilled < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_tokens(self) -> int:
        """Tokens in the slot's state once the pending ones are fed (prompt + outputs so far)."""
        return len(self.prompt_ids) + len(self.output_ids)


@dataclass
class PrefillChunk:
    request: Request
    start: int                       # first prompt position of the chunk
    token_ids: list[int]

    @property
    def last(self) -> bool:
        """True when the chunk ends the prompt (its logits give the first output token)."""
        return self.start + len(self.token_ids) == len(self.request.prompt_ids)

    @property
    def first(self) -> bool:
        """True when the chunk starts the sequence (after its cached prefix, if any)."""
        return self.start == self.request.num_cached_tokens


@dataclass
class StepPlan:
    """What one engine step runs: a decode token for each of ``decode`` (in slot order given) and
    the prompt chunks ``prefill``. ``freed`` are the slots released since the last plan (the
    runner resets them before reuse); ``finished`` the requests that ended (aborted) meanwhile."""

    decode: list[Request] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    """FCFS continuous batching over ``max_num_seqs`` slots of ``max_model_len`` positions.

    ``max_num_batched_tokens`` bounds the tokens of one step (decodes + prompt chunks);
    ``long_prefill_token_threshold`` (when > 0) bounds one prompt's chunk. With ``prefix_cache``, an
    admitted request starts from its longest cached prefix, and the slot's state is saved at the
    prompt's save boundaries (``Request.save_at``): a chunk may cross up to ``snapshots`` of them in
    one step (all chunks together; the forward snapshots the state there), and ends at the next one.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 512,
                 long_prefill_token_threshold: int = 0, prefix_cache: PrefixCache | None = None,
                 snapshots: int = 0):
        if min(max_num_seqs, max_model_len, max_num_batched_tokens) <= 0 or long_prefill_token_threshold < 0:
            raise ValueError("scheduler sizes must be positive")
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_slots: list[int] = list(range(max_num_seqs))
        self._aborts: set[str] = set()
        self._lock = threading.Lock()
        #: tokens a decode row takes of the budget (1 + k with speculative decoding)
        self.decode_tokens = 1
        self.prefix_cache = prefix_cache
        #: save boundaries inside prompt chunks one step may have (the runner's stage slots)
        self.snapshots = snapshots

    # ------------------------------------------------------------------ requests in and out
    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise a :class:`RequestError` naming the problem if this request can never run."""
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise ContextOverflowError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds "
                f"max_model_len ({self.max_model_len})", param="max_tokens")

    def add(self, request: Request) -> None:
        """Queue a request (checked first: a refused request changes nothing)."""
        self.check(request.prompt_ids, request.params)
        with self._lock:
            if request.request_id in self.requests:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self.requests[request.request_id] = request
            self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        """Ask for a request to end (any thread); applied at the next :meth:`schedule`."""
        with self._lock:
            self._aborts.add(request_id)

    def finish(self, request: Request, reason: str) -> None:
        """End a request now (engine thread): free its slot, drop it from the queues."""
        if request.finished:
            return
        request.status, request.finish_reason = Status.FINISHED, reason
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        if request.slot is not None:
            self.free_slots.append(request.slot)
            self.free_slots.sort()
        self.requests.pop(request.request_id, None)
        self._leave_cache(request, reason)

    def _leave_cache(self, request: Request, reason: str) -> None:
        """A restore that never ran frees its nodes; what was saved while decoding is entered (for
        the next turn of a conversation), unless the request failed."""
        cache = self.prefix_cache
        if cache is None:
            return
        if request.cached is not None:
            cache.unref(request.cached)
            request.cached = None
        pend, request.pending = request.pending, None
        if pend is None:
            return
        tokens = request.prompt_ids + request.output_ids
        n = pend.first_block + len(pend.pages)
        if reason == "error" or len(tokens) < n * cache.block:
            cache.release(pend.pages + list(pend.tail))
        else:
            cache.publish(block_keys(tokens, cache.block, n, root_key(request.cache_salt)), pend.first_block,
                          pend.pages, pend.tail)

    def append_token(self, request: Request, token_id: int) -> None:
        """Record a sampled token; a request at ``max_tokens`` finishes with reason ``length``."""
        request.output_ids.append(token_id)
        if len(request.output_ids) >= request.params.max_tokens:
            self.finish(request, "length")

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    # ------------------------------------------------------------------ the step plan
    def schedule(self) -> StepPlan:
        """Plan the next step: apply aborts, admit waiting requests into free slots, give every
        decoding request one token and the rest of the budget to prompt chunks (oldest first)."""
        plan = StepPlan()
        with self._lock:
            aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            req = self.requests.get(rid)
            if req is not None:
                self.finish(req, "abort")
                plan.finished.append(req)
        deferred = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            if self.prefix_cache is not None and self._waits_for_prefix(req):
                deferred.append(req)
                continue
            req.slot, req.status = self.free_slots.pop(0), Status.RUNNING
            self.running.append(req)
            if self.prefix_cache is not None:
                self._start_from_cache(req)
        self.waiting.extendleft(reversed(deferred))      # still first in line, in arrival order
        budget = self.max_num_batched_tokens
        chunk = self.long_prefill_token_threshold or budget       # the most tokens of one prompt in a step
        plan.decode = [r for r in self.running if not r.in_prefill]
        budget -= len(plan.decode) * self.decode_tokens
        inside = 0                                     # save boundaries inside this step's chunks
        for req in self.running:
            if budget <= 0:
                break
            if req.in_prefill:
                n = min(budget, chunk, len(req.prompt_ids) - req.num_prefilled)
                start = req.num_prefilled
                for q in req.save_at:
                    if start < q < start + n:
                        if inside < self.snapshots:
                            inside += 1              # the forward snapshots the state there
                        else:
                            n = q - start            # end at the boundary, whose state is saved
                            break
                plan.prefill.append(PrefillChunk(req, start, req.prompt_ids[start:start + n]))
                req.num_prefilled += n
                budget -= n
        return plan

    def _keys(self, req: Request) -> list[bytes]:
        """The chained block ids of ``req``'s prompt (its full blocks), computed once."""
        if req.keys is None:
            b = self.prefix_cache.block
            req.keys = block_keys(req.prompt_ids, b, len(req.prompt_ids) // b, root_key(req.cache_salt))
        return req.keys

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether ``req`` waits (keeping its place in line, holding no slot) for a running request
        to save a longer prefix of its prompt than the cache holds: one whose prompt shares more
        blocks with ``req``'s than ``req`` would restore, and that has not computed them yet. That
        request gets a save point where the two part (its chunk ends there, its state is saved), so
        ``req`` is admitted a step or so later from the cache instead of computing the same prefix
        beside it. It waits no longer than that request takes to reach the point: one that ends,
        passes the point unsaved (no pages) or is aborted stops holding it."""
        if req.params.prompt_logprobs is not None:
            return False                     # such a request reuses nothing
        b, keys = self.prefix_cache.block, self._keys(req)
        usable = (len(req.prompt_ids) - 1) // b
        have = self.prefix_cache.tail_blocks(keys[:usable])
        for other in self.running:
            if other.cache_salt != req.cache_salt or other.num_prefilled >= len(other.prompt_ids):
                continue
            theirs = self._keys(other)
            n = 0
            while n < min(usable, len(theirs)) and theirs[n] == keys[n]:
                n += 1
            if n > have and other.num_prefilled < n * b:
                if n * b not in other.save_at:
                    other.save_at = tuple(sorted(other.save_at + (n * b,)))
                return True
        return False

    def _start_from_cache(self, req: Request) -> None:
        cache = self.prefix_cache
        # prompt logprobs need every prompt position's logits: such a request reuses nothing
        keys = self._keys(req)
        hit = cache.match(req.prompt_ids, req.cache_salt, keys) if req.params.prompt_logprobs is None else None
        if hit is not None:
            req.cached = hit
            req.num_prefilled = req.num_cached_tokens = hit.length
        req.saved_blocks = req.num_cached_tokens // cache.block
        # the prompt's last boundary (where the next turn of a conversation continues) and the last
        # one before its final token (all that the same prompt sent again can reuse: one token runs)
        # and where it parts from the blocks other requests saved (a shared system prompt)
        L, b = len(req.prompt_ids), cache.block
        points = {(L - 1) // b * b, L // b * b, cache.shared_length(req.prompt_ids, req.cache_salt, keys)}
        req.save_at = tuple(sorted(q for q in points if q > req.num_cached_tokens))
