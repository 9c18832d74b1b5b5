"""The asyncio front over the engine: one engine thread, one queue per HTTP response.

The :class:`~dsv4.engine.core.Engine` is single-threaded. One engine thread owns it: it applies
the commands the event loop sent (add a request, abort one) in order, runs ``Engine.step()`` while
anything is unfinished, and hands each step's outputs back to the loop in one
``call_soon_threadsafe`` call. It uses only the engine's public API (``check``, ``add_request``,
``abort``, ``step``, ``fail_all``, ``stats`` and its sizes), never its scheduler or internal state. Handlers never touch the engine: they :meth:`AsyncEngine.submit`
tokenized requests (already checked with :meth:`AsyncEngine.check`, so a refused request changes
nothing) and read :class:`Delta` objects from the :class:`Submission`'s queue.

A handler that goes away (a client disconnects, a stream is cancelled) calls
:meth:`Submission.abort`; the engine thread passes it to the scheduler before its next step, so the
slot is free within one step. A step that raises fails the requests it ran, not the server.

States: ``starting`` (no engine yet), ``ready``, ``draining`` (no new requests; running ones
finish or are aborted at the deadline), ``stopped``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from ..cpu_threads import ThreadMonitor
from ..engine.core import Engine, RequestOutput
from ..engine.sampling import SamplingParams

log = logging.getLogger("dsv4.serve")


@dataclass
class Delta:
    """What one engine step produced for one request, copied on the engine thread (the engine keeps
    mutating its own output objects)."""

    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None         # vLLM's: the stop string or stop token id that ended it
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_logprobs: list[float | None] | None = None          # first delta only
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache


@dataclass
class EngineRequest:
    """One engine request of a submission: a tokenized prompt and how to sample it."""

    prompt_ids: list[int]
    params: SamplingParams
    skip_special_tokens: bool = True
    cache_salt: str | None = None


@dataclass
class _Live:
    """Loop-side bookkeeping of one running engine request."""

    submission: "Submission"
    index: int
    arrival: float
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    reason: str | None = None     # the finish reason the client was given, when the handler ended it
    held: Delta | None = None     # --stream-interval: output not handed to the handler yet
    sent: bool = False            # some output (the first token) has been handed over


class Submission:
    """The engine requests of one HTTP response (prompts x choices). Iterate it for
    ``(index, Delta)`` pairs; it ends when every request has finished."""

    def __init__(self, engine: "AsyncEngine", request_ids: list[str]):
        self.engine, self.request_ids = engine, request_ids
        self.queue: asyncio.Queue[tuple[int, Delta]] = asyncio.Queue()
        self.unfinished = set(range(len(request_ids)))
        self.ttft: list[float | None] = [None] * len(request_ids)
        self.completion_tokens = [0] * len(request_ids)
        #: prompt tokens each request took from the prefix cache (known with its first output)
        self.cached_tokens = [0] * len(request_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        while self.unfinished:
            index, delta = await self.queue.get()
            if delta.finished:
                self.unfinished.discard(index)
            yield index, delta

    def cached(self, per_prompt: int = 1) -> int:
        """Prompt tokens served by the prefix cache, counted once per prompt like ``prompt_tokens``
        (the first of each prompt's ``per_prompt`` choices)."""
        return sum(self.cached_tokens[::max(per_prompt, 1)])

    def abort(self, index: int | None = None) -> None:
        """Abort one request (or every unfinished one): its slot frees within one engine step."""
        for i in ([index] if index is not None else list(self.unfinished)):
            if i in self.unfinished:
                self.engine.abort(self.request_ids[i])

    def finish(self, index: int, reason: str) -> None:
        """End request ``index`` early because the handler has its answer (the chat parser cut it
        short): aborted in the engine, counted in the metrics with the ``reason`` the client got."""
        if index in self.unfinished:
            self.engine.finish_as(self.request_ids[index], reason)

    @property
    def done(self) -> bool:
        return not self.unfinished


@dataclass
class EngineStats:
    """Written by the engine thread after each step, read by /health and /metrics: the engine's
    :meth:`Engine.stats` and this thread's step and error counts."""

    running: int = 0
    waiting: int = 0
    slots_used: int = 0
    slots_total: int = 0
    steps: int = 0
    errors: int = 0
    prefix_cache: object = None   # the engine's CacheStats (None: prefix caching off)
    spec_decode: object | None = None    # SpecStats: speculative decoding's acceptance (None: off)


class AsyncEngine:
    """Drives an :class:`Engine` from its own thread for an asyncio server."""

    def __init__(self, engine: Engine, max_model_len: int, metrics=None, threads: int | str | None = None,
                 threads_interval: float = 5.0, stream_interval: int = 1):
        self.engine, self.max_model_len, self.metrics = engine, max_model_len, metrics
        #: vLLM's --stream-interval: after the first token, a request's output goes to its handler
        #: (and so to its client) once it holds this many tokens, or when it ends
        self.stream_interval = stream_interval
        # the CPU-thread policy ("auto" only) is re-evaluated between steps: load comes and goes
        self.thread_monitor = ThreadMonitor(threads, threads_interval)
        self.vocab_size = engine.vocab_size
        self.stats = EngineStats(slots_total=engine.max_num_seqs)
        self.state = "ready"
        self.loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, _Live] = {}
        self._commands: list[tuple] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._fatal: str | None = None

    # ------------------------------------------------------------------ lifecycle (loop thread)
    def start(self) -> None:
        """Start the engine thread; outputs come back to the running event loop."""
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="dsv4-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort everything and end the engine thread (after its current step)."""
        self.state = "stopped"
        for rid in list(self._live):
            self.abort(rid)
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def drain(self, timeout: float) -> None:
        """Stop admitting; let running requests finish for up to ``timeout`` seconds, then abort
        the rest and wait for their final outputs."""
        self.state = "draining"
        deadline = time.monotonic() + timeout
        while self._live and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._live:
            log.warning("shutdown timeout (%.1f s): aborting %d running request(s)", timeout, len(self._live))
            for rid in list(self._live):
                self.abort(rid)
            end = time.monotonic() + 10
            while self._live and time.monotonic() < end:
                await asyncio.sleep(0.05)

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ------------------------------------------------------------------ requests (loop thread)
    def check(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise a :class:`~dsv4.errors.RequestError` naming the problem if this request can never
        run (:meth:`Engine.check`)."""
        self.engine.check(prompt_ids, params)

    def submit(self, request_id: str, requests: Sequence[EngineRequest]) -> Submission:
        """Queue checked requests as ``{request_id}-{i}``; returns the submission to read."""
        if self.state != "ready":
            raise RuntimeError(f"engine is {self.state}")
        ids = [f"{request_id}-{i}" for i in range(len(requests))]
        sub = Submission(self, ids)
        now = time.monotonic()
        for i, (rid, req) in enumerate(zip(ids, requests)):
            self._live[rid] = _Live(sub, i, now, len(req.prompt_ids))
        with self._cond:
            self._commands += [("add", rid, req) for rid, req in zip(ids, requests)]
            self._cond.notify()
        return sub

    def finish_as(self, request_id: str, reason: str) -> None:
        """Abort a request whose client was told ``reason`` (loop thread); the metrics count that."""
        live = self._live.get(request_id)
        if live is not None:
            live.reason = reason
        self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); applied before the engine's next step."""
        with self._cond:
            self._commands.append(("abort", request_id))
            self._cond.notify()

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self.engine.has_unfinished and not self._stop:
                    self._cond.wait()
                if self._stop and not self.engine.has_unfinished:
                    return
                commands, self._commands = self._commands, []
            try:
                changed = self.thread_monitor.poll()   # on this thread: it runs the steps
                if changed is not None:
                    log.info("cpu: now %d thread(s) (other processes' load changed)", changed)
                deltas = self._apply(commands)
                if self.engine.has_unfinished:
                    deltas += self._step()
                self._update_stats()
            except Exception as e:  # a bug outside the step: fail what runs, keep the thread alive
                log.exception("engine loop error; failing the running requests")
                deltas = self._fail_running(f"{type(e).__name__}: {e}")
            if deltas:
                try:
                    self.loop.call_soon_threadsafe(self._dispatch, deltas)
                except RuntimeError:  # the event loop is closed: the server is gone
                    return

    def _apply(self, commands: list[tuple]) -> list[tuple[str, Delta]]:
        failed = []
        for cmd in commands:
            if cmd[0] == "add":
                _, rid, req = cmd
                try:
                    self.engine.add_request(req.prompt_ids, req.params, request_id=rid,
                                            skip_special_tokens=req.skip_special_tokens, cache_salt=req.cache_salt)
                except Exception as e:  # checked before submit; this is a bug, but it fails alone
                    log.exception("request %s could not be added", rid)
                    failed.append((rid, Delta([], "", True, "error", error=f"{type(e).__name__}: {e}")))
            else:
                self.engine.abort(cmd[1])
        return failed

    def _step(self) -> list[tuple[str, Delta]]:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the step as a whole failed: fail what it ran, keep serving
            self.stats.errors += 1
            log.exception("engine step failed; failing the running requests")
            return self._fail_running(f"{type(e).__name__}: {e}")
        self.stats.steps += 1
        return [(out.request_id, _delta(out)) for out in outputs]

    def _fail_running(self, error: str) -> list[tuple[str, Delta]]:
        return [(rid, Delta([], "", True, "error", error=error)) for rid in self.engine.fail_all("error")]

    def _update_stats(self) -> None:
        now, s = self.engine.stats(), self.stats
        s.running, s.waiting, s.slots_used, s.slots_total = now.running, now.waiting, now.slots_used, now.slots_total
        s.prefix_cache = now.prefix_cache
        s.spec_decode = getattr(now, "spec_decode", None)
        if self.metrics is not None:
            self.metrics.engine_state(s)

    # ------------------------------------------------------------------ back on the loop
    def _dispatch(self, deltas: list[tuple[str, Delta]]) -> None:
        now = time.monotonic()
        for rid, delta in deltas:
            live = self._live.get(rid)
            if live is None:
                continue
            if delta.token_ids:
                self._timing(live, now, len(delta.token_ids))
            if delta.finished:
                del self._live[rid]
                if self.metrics is not None:
                    self.metrics.request_done(live.prompt_tokens, live.tokens, now - live.arrival,
                                              live.reason or delta.finish_reason)
            live.submission.completion_tokens[live.index] = live.tokens
            live.submission.cached_tokens[live.index] = delta.num_cached_tokens
            if live.held is not None:
                delta, live.held = _merged(live.held, delta), None
            if self.stream_interval > 1 and live.sent and not delta.finished \
                    and len(delta.token_ids) < self.stream_interval:
                live.held = delta
                continue
            live.sent = live.sent or bool(delta.token_ids)
            live.submission.queue.put_nowait((live.index, delta))

    def _timing(self, live: _Live, now: float, n: int) -> None:
        if live.first is None:
            live.first = now
            live.submission.ttft[live.index] = now - live.arrival
            if self.metrics is not None:
                self.metrics.first_token(now - live.arrival)
        elif self.metrics is not None:
            self.metrics.inter_token((now - live.last) / n)
        live.last = now
        live.tokens += n
        if self.metrics is not None:
            self.metrics.generated(n)


def _merged(a: Delta, b: Delta) -> Delta:
    """Two consecutive deltas of one request as one (``b`` the later)."""
    def both(x, y):
        return None if x is None and y is None else (x or []) + (y or [])
    return Delta(a.token_ids + b.token_ids, a.text + b.text, b.finished, b.finish_reason, b.stop_reason,
                 both(a.logprobs, b.logprobs), both(a.top_logprobs, b.top_logprobs),
                 a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
                 a.prompt_top_logprobs if a.prompt_top_logprobs is not None else b.prompt_top_logprobs,
                 b.error, b.num_cached_tokens)


def _delta(out: RequestOutput) -> Delta:
    """Copy what the loop needs out of a :class:`RequestOutput` (on the engine thread)."""
    o, n = out.output, len(out.new_token_ids)
    d = Delta(list(out.new_token_ids), out.new_text, out.finished, o.finish_reason if out.finished else None,
              o.stop_reason if out.finished else None, error=o.error if out.finished else None,
              num_cached_tokens=o.num_cached_tokens)
    if o.logprobs is not None and n:
        d.logprobs, d.top_logprobs = list(o.logprobs[-n:]), [list(t) for t in o.top_logprobs[-n:]]
    if o.prompt_logprobs is not None and n and len(o.token_ids) == n:   # the first output
        d.prompt_logprobs, d.prompt_top_logprobs = list(o.prompt_logprobs), list(o.prompt_top_logprobs)
    return d
