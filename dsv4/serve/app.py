"""The FastAPI app: routes, the API-key and availability gate, errors in OpenAI's shape.

``create_app(load, model_names=..., api_key=...)`` returns an app whose lifespan starts loading the
model (``load`` returns an :class:`~dsv4.engine.llm.LLM`, or is one) on a thread: until it is
ready every API route answers 503 (``/health`` says ``starting``), so a load balancer or a test
can wait on ``/health``. Whatever fails on the way to ``ready`` (the load, or starting the engine
on what it returned) sets ``failed`` and calls ``on_load_error``: ``dsv4 serve`` then exits with
the error instead of answering 503 forever. :meth:`ServerState.drain` (SIGTERM) turns new requests away with 503
while the running ones finish.

Routes: ``GET /health``, ``GET /metrics``, ``GET /version``, ``GET /v1/models[/{id}]``,
``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /tokenize``, ``POST /detokenize``,
``GET /tokenizer_info``. The serving logic lives in :mod:`.serving_completions` and
:mod:`.serving_chat`, the wire format in :mod:`.protocol`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import Dsv4Error, RequestError
from ..text.tokenizer import TokenizerNotFoundError
from .async_engine import AsyncEngine
from .errors import ANTHROPIC_PATHS, APIError, bad_request, validation_message
from .metrics import Metrics
from .protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
                       DetokenizeRequest, DetokenizeResponse, ErrorResponse, Health, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse, TokenizerInfo)
from .serving_chat import ChatServing
from .serving_messages import AnthropicError, MessagesRequest, MessagesServing
from .serving_responses import ResponsesRequest, ResponsesServing
from .serving_common import ServingContext, log_request
from .serving_completions import CompletionServing

log = logging.getLogger("dsv4.serve")

OPEN_PATHS = ("/health", "/metrics", "/version", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")
KEYED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")


def _errors(*codes: int) -> dict:
    return {c: {"model": ErrorResponse} for c in codes}


_GEN_ERRORS = _errors(400, 401, 404, 500, 503)


class ServerState:
    """What the app serves and its lifecycle: ``starting`` -> ``ready`` -> ``draining`` -> ``stopped``
    (``failed`` when the model could not be loaded)."""

    def __init__(self, load, model_names: list[str], api_key: str | None = None, default_seed: int | None = None,
                 stream_interval: int = 1):
        self.load, self.model_names, self.api_key, self.default_seed = load, model_names, api_key, default_seed
        self.stream_interval = stream_interval
        self.status = "starting"
        self.metrics = Metrics(model_names[0])
        self.ctx: ServingContext | None = None
        self.completions: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.messages: MessagesServing | None = None
        self.responses: ResponsesServing | None = None
        self.llm = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[BaseException], None] | None = None
        self.ready_event = threading.Event()

    async def start(self) -> None:
        """Load the model on a thread (the server answers 503 meanwhile), then start the engine."""
        loop = asyncio.get_running_loop()
        if not callable(self.load):
            self._ready(self.load)
            return

        def work():
            try:
                llm = self.load()
            except BaseException as e:  # noqa: BLE001  (reported by the server, which then exits)
                loop.call_soon_threadsafe(self._failed, e)
                return
            loop.call_soon_threadsafe(self._ready, llm)

        threading.Thread(target=work, name="dsv4-load", daemon=True).start()

    def _failed(self, e: BaseException) -> None:
        self.load_error, self.status = e, "failed"
        if self.on_load_error is not None:   # the server stops and its caller reports the error, once
            self.on_load_error(e)
        else:
            log.error("the model could not be loaded: %s", e, exc_info=not isinstance(e, Dsv4Error))
        self.ready_event.set()

    def _ready(self, llm) -> None:
        """Start serving ``llm``; on the CPU its ``threads="auto"`` policy is re-evaluated while serving."""
        if self.status not in ("starting",):
            return
        try:
            self._start_serving(llm)
        except Exception as e:  # noqa: BLE001  (never left "starting" with a traceback in a callback)
            self._failed(e)

    def _start_serving(self, llm) -> None:
        if llm.tokenizer is None:
            raise TokenizerNotFoundError(f"{llm.path} has no tokenizer.json: the server needs one")
        self.llm = llm
        on_cpu = getattr(getattr(llm, "device", None), "type", None) == "cpu"
        engine = AsyncEngine(llm.engine, llm.max_model_len, self.metrics,
                             threads=getattr(llm, "threads", None) if on_cpu else None,
                             stream_interval=self.stream_interval)
        engine.start()
        if hasattr(llm.engine, "prepare_grammars"):     # test stand-ins offer only the request API
            llm.engine.prepare_grammars()
        seeds = None if self.default_seed is None else random.Random(self.default_seed)
        self.ctx = ServingContext(engine, llm.tokenizer, self.model_names, llm.max_model_len, str(llm.path),
                                  self.metrics, seeds)
        self.completions, self.chat = CompletionServing(self.ctx), ChatServing(self.ctx)
        self.messages = MessagesServing(self.ctx, self.chat)
        self.responses = ResponsesServing(self.ctx, self.chat)
        self.status = "ready"
        self.ready_event.set()
        log.info("ready: serving %s (max_model_len %d, max_num_seqs %d)", ", ".join(self.model_names),
                 llm.max_model_len, llm.max_num_seqs)

    async def drain(self, timeout: float) -> None:
        """Turn new requests away (503); let running ones finish for ``timeout`` s, abort the rest."""
        if self.status == "ready" and self.ctx is not None:
            self.status = "draining"
            log.info("draining: %d request(s) running, up to %.1f s", self.ctx.engine.num_live, timeout)
            await self.ctx.engine.drain(timeout)
        self.status = "draining" if self.status == "ready" else self.status

    def stop(self) -> None:
        if self.ctx is not None:
            self.ctx.engine.stop()
        close = getattr(self.llm, "close", None)   # a tensor-parallel group's other ranks
        if close is not None:
            close()
        self.status = "stopped"


class _Gate:
    """Pure ASGI middleware (it keeps ``http.disconnect`` visible to streaming handlers): 503 unless
    ready, 401 without the API key, and the HTTP counter by endpoint and status."""

    def __init__(self, app, state: ServerState, routes: set[str]):
        self.app, self.state, self.routes = app, state, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.routes else "other"
        status_box = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope, path)
            if refusal is None and scope.get("method") == "POST" and path in self.routes:
                receive, refusal = await _checked_body(scope, receive, path)
            if refusal is not None:
                return await refusal(scope, receive, counted_send)
            await self.app(scope, receive, counted_send)
        finally:
            self.state.metrics.http(endpoint, status_box[0])

    def _refusal(self, scope, path: str) -> Response | None:
        state = self.state
        if path in OPEN_PATHS:
            return None
        if state.status != "ready":
            why = {"starting": "the model is still loading", "draining": "the server is shutting down",
                   "failed": "the model failed to load", "stopped": "the server has stopped"}.get(state.status,
                                                                                               state.status)
            return APIError(503, f"unavailable: {why}; retry later", code=state.status).response(
                headers={"Retry-After": "5"}, anthropic=path in ANTHROPIC_PATHS)
        if state.api_key and path.startswith(KEYED_PREFIXES):
            headers = dict(scope.get("headers") or [])
            auth = headers.get(b"authorization", b"").decode("latin-1")
            given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode(
                "latin-1")
            if not secrets.compare_digest(given.encode("utf-8", "replace"), state.api_key.encode()):
                return APIError(401, "invalid or missing API key (send the header 'Authorization: Bearer KEY' or "
                                "'x-api-key: KEY')", code="invalid_api_key").response(
                    headers={"WWW-Authenticate": "Bearer"}, anthropic=path in ANTHROPIC_PATHS)
        return None


async def _checked_body(scope, receive, path: str):
    """Read a POST body ahead of the route: 400 in OpenAI's shape for a body that is not declared
    as JSON or is not UTF-8 (what the JSON routes take), else a ``receive`` that replays it."""
    messages, chunks = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":         # the client left: the route sees that as usual
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break

    async def replay():
        return messages.pop(0) if messages else await receive()

    headers = dict(scope.get("headers") or [])
    ctype = headers.get(b"content-type")
    media = ctype.decode("latin-1").split(";")[0].strip().lower() if ctype is not None else None
    body = b"".join(chunks)
    if media is None:
        error = APIError(400, f"POST {path} has no Content-Type header: send the body as JSON with "
                              "'Content-Type: application/json'", code="missing_content_type")
    elif media != "application/json":
        error = APIError(400, f"POST {path} takes a JSON body ('Content-Type: application/json'), got Content-Type "
                              f"{media!r}", code="unsupported_content_type")
    elif not body.strip():
        error = APIError(400, f"POST {path} has an empty body: send a JSON object", code="empty_body")
    else:
        try:
            body.decode("utf-8")
            return replay, None
        except UnicodeDecodeError as e:
            error = APIError(400, f"the body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start}); "
                                  "send JSON encoded as UTF-8", code="invalid_encoding")
    return replay, error.response(anthropic=path in ANTHROPIC_PATHS)


def create_app(load: Callable[[], Any] | Any, *, model_names: list[str], api_key: str | None = None,
               default_seed: int | None = None, stream_interval: int = 1) -> FastAPI:
    """The server app for ``load`` (an ``LLM``, or a function that builds one on a thread).
    ``default_seed``: requests without a ``seed`` draw theirs from a stream seeded with it (``--seed``);
    ``stream_interval``: streamed output goes out every that many tokens (``--stream-interval``)."""
    state = ServerState(load, model_names, api_key, default_seed, stream_interval)

    async def lifespan(app: FastAPI):
        await state.start()
        try:
            yield
        finally:
            state.stop()

    app = FastAPI(title="dsv4", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible server of the dsv4 DeepSeek-V4 engine")
    app.state.dsv4 = state
    _add_exception_handlers(app)
    _add_routes(app, state)
    routes = {getattr(r, "path", "") for r in app.routes}
    app.add_middleware(_Gate, state=state, routes=routes)
    return app


def _add_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if not exc.logged and request.url.path.startswith("/v1/"):
            kind = "chat" if request.url.path.endswith("chat/completions") else request.url.path.rsplit("/", 1)[-1]
            log_request(kind, "-", exc.status, None, 0, 0.0, note=exc.message)
        return exc.response(anthropic=_anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return APIError(400, message, param).response(anthropic=_anthropic(request))

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError):
        return APIError(400, str(exc)).response(anthropic=_anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                          str(exc.detail))
        return APIError(exc.status_code, message).response(headers=getattr(exc, "headers", None),
                                                           anthropic=_anthropic(request))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response(anthropic=_anthropic(request))


def _anthropic(request: Request) -> bool:
    """Errors of Anthropic's routes come in Anthropic's shape."""
    return request.url.path in ANTHROPIC_PATHS


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        ctx = state.ctx
        ready = state.status == "ready"
        stats = ctx.engine.stats if ctx is not None else None
        body = Health(status="ok" if ready else state.status,
                      **({} if stats is None else dict(running=stats.running, waiting=stats.waiting,
                                                       slots_used=stats.slots_used, slots_total=stats.slots_total)))
        return JSONResponse(body.model_dump(), status_code=200 if ready else 503)

    @app.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList, responses=_errors(401, 503))
    async def models():
        ctx = state.ctx
        return ModelList(data=[ModelCard(id=n, root=ctx.root, max_model_len=ctx.max_model_len)
                               for n in state.model_names])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_errors(401, 404, 503))
    async def model(model: str):
        ctx = state.ctx
        ctx.check_model(model)
        return ModelCard(id=model, root=ctx.root, max_model_len=ctx.max_model_len)

    @app.post("/v1/completions", responses={
        200: {"model": CompletionResponse, "content": {"text/event-stream": {}}}, **_GEN_ERRORS})
    async def completions(body: CompletionRequest, request: Request):
        _check_extra(body, "/v1/completions")
        return _json(await state.completions.create(body, request))

    @app.post("/v1/chat/completions", responses={
        200: {"model": ChatCompletionResponse, "content": {"text/event-stream": {}}}, **_GEN_ERRORS})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_extra(body, "/v1/chat/completions")
        return _json(await state.chat.create(body, request))

    @app.post("/v1/responses", responses={200: {"content": {"application/json": {}, "text/event-stream": {}}},
                                          **_GEN_ERRORS})
    async def responses(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API (function tools, reasoning, stored responses)."""
        _check_extra(body, "/v1/responses")
        return _json(await state.responses.create(body, request))

    @app.get("/v1/responses/{response_id}", responses=_errors(401, 404, 503))
    async def get_response(response_id: str):
        return state.responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses=_errors(401, 404, 503))
    async def delete_response(response_id: str):
        return state.responses.delete(response_id)

    @app.post("/v1/messages", responses={200: {"content": {"application/json": {}, "text/event-stream": {}}},
                                         **{c: {"model": AnthropicError} for c in (400, 401, 404, 500, 503)}})
    async def messages(body: MessagesRequest, request: Request):
        """Anthropic's Messages API (errors in Anthropic's shape)."""
        _check_extra(body, "/v1/messages")
        return _json(await state.messages.create(body, request))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_errors(400, 401, 404, 503))
    async def tokenize(body: TokenizeRequest):
        ctx = state.ctx
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt")
        if body.prompt is not None:
            try:
                body.prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(400, "prompt is not valid Unicode text (lone surrogate)", "prompt") from None
            ids = ctx.tokenizer.encode(body.prompt, add_bos=body.add_special_tokens)
        else:
            kwargs = body.chat_template_kwargs or {}
            thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
            ids = state.chat.prompt(body.messages, thinking=thinking, effort=kwargs.get("reasoning_effort"),
                                    tools=None, response_format=None,
                                    add_generation_prompt=body.add_generation_prompt)
        strs = [ctx.token_str(t) for t in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_errors(400, 401, 404, 503))
    async def detokenize(body: DetokenizeRequest):
        ctx = state.ctx
        ctx.check_model(body.model)
        vocab = ctx.engine.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: ids outside [0, {vocab}): {bad[:5]}", "tokens")
        return DetokenizeResponse(prompt=ctx.tokenizer.decode(body.tokens))

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=_errors(401, 503))
    async def tokenizer_info():
        ctx = state.ctx
        tok = ctx.tokenizer
        return TokenizerInfo(bos_token=tok.bos_token, eos_token=tok.eos_token, model_max_length=ctx.max_model_len,
                             vocab_size=ctx.engine.vocab_size)


def _json(result):
    """A handler's result: a streaming response as is, a dict as JSON, None (client gone) as 499."""
    if result is None:
        return Response(status_code=499)
    if isinstance(result, dict):
        return JSONResponse(result)
    return result


#: vLLM's request fields this server does not implement -> (what counts as asking for it, what to do
#: instead): a request that asks is refused by name rather than answered as if it had not asked
_UNSUPPORTED = {
    "use_beam_search": (bool, "beam search is not supported"),
    "length_penalty": (lambda v: v is not None and v != 1, "it applies to beam search, which is not supported"),
    "bad_words": (bool, "not supported (logit_bias bans single tokens)"),
    "logits_processors": (bool, "not supported"),
    "return_tokens_as_token_ids": (bool, "not supported"),
    "prompt_logprobs": (lambda v: v is not None, "not supported as a field (/v1/completions gives the prompt's "
                                                 "logprobs with echo and logprobs)"),
    **{f"guided_{k}": (lambda v: v is not None, "vLLM's old name: give structured_outputs (or response_format)")
       for k in ("json", "regex", "choice", "grammar", "decoding_backend", "whitespace_pattern")},
}
_UNSUPPORTED_CHAT = {
    "echo": (bool, "not supported in chat (/v1/completions has echo)"),
}
#: the same for OpenAI's Responses API fields
_UNSUPPORTED_RESPONSES = {
    "conversation": (lambda v: v is not None, "the Conversations API is not supported (previous_response_id "
                                              "continues a stored response)"),
    "prompt": (lambda v: v is not None, "stored prompt templates are not supported"),
    "top_logprobs": (bool, "not supported on /v1/responses (/v1/chat/completions gives logprobs)"),
}


def _check_extra(body, route: str) -> None:
    """Refuse a vLLM field this server does not implement when the request asks for it (a 400 naming
    it); log the other unknown fields (SDKs send fields nobody uses)."""
    extra = body.model_extra or {}
    known = {"/v1/completions": _UNSUPPORTED, "/v1/chat/completions": {**_UNSUPPORTED, **_UNSUPPORTED_CHAT},
             "/v1/responses": _UNSUPPORTED_RESPONSES}.get(route, {})
    for name, value in extra.items():
        if name in known:
            asks, instead = known[name]
            if asks(value):
                raise bad_request(f"{name}: {instead}", name)
    if extra:
        log.info("%s: ignoring unknown field(s) %s", route, ", ".join(sorted(extra)[:10]))
