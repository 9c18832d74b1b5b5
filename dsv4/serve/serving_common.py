"""What the completion and chat handlers share: the model table, sampling parameters from a
request, token strings for logprobs, SSE framing, disconnect handling and the per-request log line."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ..engine.grammar import StructuredOutputsParams
from ..engine.sampling import SamplingParams
from ..errors import RequestError
from ..text.tokenizer import Tokenizer
from .async_engine import AsyncEngine, Submission
from .errors import APIError, bad_request
from .protocol import _Sampling

log = logging.getLogger("dsv4.serve")

MAX_STOP = 16


@dataclass
class ServingContext:
    """Everything a handler needs: the engine front, the tokenizer, the names it answers to."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_names: list[str]
    max_model_len: int
    root: str = ""
    metrics: Any = None
    seeds: random.Random | None = None      # --seed: where requests without a seed take theirs
    _bytes: dict[int, bytes] = field(default_factory=dict)
    _prepare_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="dsv4-prepare"))

    async def prepare(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread: a request's preparation (chat template, tokenization,
        grammar checks). The event loop streams every running request's tokens, and a long prompt's
        tokenization takes milliseconds (~10 ms for 10K tokens; the tokenizer releases the GIL): 64
        agents sending 4K-token prompts at once held first tokens back by ~0.9 s when it ran on the
        loop. Errors (a 400 naming the field) propagate as if called here."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn, *args)

    def request_seed(self, seed: int | None) -> int | None:
        """A request's seed: its own, else the next of the server's ``--seed`` stream, else None
        (a random one). With ``--seed`` a fresh server answers the same requests the same way."""
        if seed is not None or self.seeds is None:
            return seed
        return self.seeds.getrandbits(63)

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (404 for an unknown one); the first when omitted."""
        if name is None or name in self.model_names:
            return self.model_names[0] if name is None else name
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                       f"{', '.join(map(repr, self.model_names))}", "model", "model_not_found")

    # ------------------------------------------------------------------ token strings
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a byte-level token may be part of a UTF-8 character)."""
        b = self._bytes.get(token_id)
        if b is None:
            b = self._bytes[token_id] = _token_bytes(self.tokenizer, token_id)
        return b

    def token_str(self, token_id: int) -> str:
        """A token as text; a partial UTF-8 character reads ``bytes:\\xe2\\x80`` (OpenAI's way)."""
        b = self.token_bytes(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{c:02x}" for c in b)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTE_DECODER = _byte_decoder()


def _token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    piece = tokenizer.hf.id_to_token(token_id)
    if piece is None:
        return b""
    added = tokenizer.hf.get_added_tokens_decoder() if hasattr(tokenizer.hf, "get_added_tokens_decoder") else {}
    if token_id not in added and all(c in _BYTE_DECODER for c in piece):
        return bytes(_BYTE_DECODER[c] for c in piece)
    return tokenizer.decode([token_id]).encode("utf-8")


# ------------------------------------------------------------------ sampling parameters
def stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop: stop strings must not be empty", "stop")
    return stops


def structured_outputs(req: _Sampling) -> StructuredOutputsParams | None:
    """The constraint a request's ``response_format`` (json_object, json_schema) or vLLM's
    ``structured_outputs`` asks for (None for none); a 400 naming the field for a malformed one (an
    invalid schema or grammar is found by the engine's check, still before anything runs)."""
    fmt, so = req.response_format, req.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise bad_request("response_format and structured_outputs: give one of them", "structured_outputs")
    try:
        if so is not None:
            return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                           json_object=bool(so.json_object))
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True, param="response_format")
        schema = (fmt.json_schema or {}).get("schema")
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema: expected a JSON schema object", "response_format")
        return StructuredOutputsParams(json=schema if isinstance(schema, dict) else {}, param="response_format")
    except RequestError as e:
        raise bad_request(str(e), e.param) from None


def sampling_params(req: _Sampling, max_tokens: int, *, logprobs: int | None, prompt_logprobs: int | None = None,
                    choice: int = 0, seed: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The engine's parameters for choice ``choice`` of a request (seeded choices differ by index);
    ``seed`` is the request's (:meth:`ServingContext.request_seed`); ``structured`` its constraint."""
    bad = [t for t in req.logit_bias or {} if not (t.isascii() and t.strip().isdigit())]
    if bad:
        raise bad_request(f"logit_bias: keys must be token ids (integers >= 0, as strings), got {bad[:5]}",
                          "logit_bias")
    bias = {int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=max(req.top_k or 0, 0), top_p=1.0 if req.top_p is None else req.top_p,
            min_p=req.min_p or 0.0, repetition_penalty=req.repetition_penalty or 1.0,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            seed=None if seed is None else seed + choice, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            stop=stop_list(req.stop), stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos,
            structured_outputs=structured, thinking_token_budget=req.thinking_token_budget,
            min_tokens=req.min_tokens, logit_bias=bias, include_stop_str_in_output=req.include_stop_str_in_output,
            allowed_token_ids=req.allowed_token_ids)
    except RequestError as e:   # most ranges are checked by the protocol; this names the field of any other
        message = str(e).replace("SamplingParams.", "")
        raise bad_request(message, e.param or message.split(" ")[0]) from None


def truncate_prompt(ctx: ServingContext, req: _Sampling, ids: list[int]) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last N of the prompt's ids (-1: ``max_model_len``)."""
    n = req.truncate_prompt_tokens
    if n is None:
        return ids
    if n == 0:
        raise bad_request("truncate_prompt_tokens: must be -1 (max_model_len) or at least 1", "truncate_prompt_tokens")
    n = ctx.max_model_len if n == -1 else n
    return ids[-n:]


def stream_usage(req: _Sampling) -> tuple[bool, bool]:
    """(a final usage chunk, usage in every chunk): ``stream_options`` ``include_usage`` and vLLM's
    ``continuous_usage_stats`` (which needs ``include_usage``, as in vLLM)."""
    opts = req.stream_options
    usage = bool(opts and opts.include_usage)
    return usage, usage and bool(opts.continuous_usage_stats)


def check_request(ctx: ServingContext, prompt_ids: list[int], params: SamplingParams, what: str = "prompt") -> None:
    """400 naming the problem (lengths included) when the engine could never run this request."""
    try:
        ctx.engine.check(prompt_ids, params)
    except RequestError as e:   # the error names the field at fault (param) and the OpenAI code
        field = what.split("[")[0]
        message = str(e) if str(e).startswith(e.param or field) else f"{what}: {e}"
        raise bad_request(message, e.param or field, e.code) from None


# ------------------------------------------------------------------ responses
#: characters that JSON may carry raw but Python's ``str.splitlines`` (and so httpx's ``iter_lines``,
#: which many streaming clients read events with) takes for line ends: escaped in every event
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def event_json(data: dict) -> str:
    """``data`` as one line of JSON for an event stream: UTF-8 text kept as it is, except the
    characters a line-splitting client would break the event at (model output can hold any)."""
    return json.dumps(data, ensure_ascii=False).translate(_LINE_BREAKS)


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else event_json(data)}\n\n"


async def until_done_or_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Run ``work``; if the client disconnects first, cancel it, call ``on_disconnect`` (abort the
    engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        on_disconnect()
        return None
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            on_disconnect()


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def log_request(kind: str, rid: str, status: int | str, sub: Submission | None, prompt_tokens: int,
                started: float, finish: list | None = None, note: str = "") -> None:
    """The one log line of a request: id, status, tokens, time to first token, total time."""
    done = time.monotonic() - started
    if sub is None:
        log.info("%s %s: %s %s", kind, rid, status, note)
        return
    ttfts = [t for t in sub.ttft if t is not None]
    ttft = f"{min(ttfts) * 1000:.1f} ms" if ttfts else "-"
    reasons = ",".join(sorted({str(r) for r in finish or [] if r}))
    log.info("%s %s: %s, prompt %d tokens, completion %d tokens, ttft %s, total %.3f s, finish %s%s", kind, rid,
             status, prompt_tokens, sum(sub.completion_tokens), ttft, done, reasons or "-",
             f", {note}" if note else "")


async def aclosing_iter(gen: AsyncIterator[str], on_close: Callable[[], None]) -> AsyncIterator[str]:
    """Yield from ``gen``; whatever ends the stream (done, error, client gone), call ``on_close``."""
    try:
        async for item in gen:
            yield item
    finally:
        on_close()
