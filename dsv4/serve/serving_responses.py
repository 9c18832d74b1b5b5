"""``POST /v1/responses``: OpenAI's Responses API on the same engine and chat encoding.

A request becomes a chat request that the chat route prepares (:meth:`ChatServing.engine_requests`: the
prompt, tools, the JSON constraint, sampling): ``instructions`` is the first (system) message;
``input`` is a string (one user message) or a list of items -- messages (``role`` and ``content``, a
string or ``input_text`` / ``output_text`` parts), ``function_call`` items (an assistant's tool calls),
``function_call_output`` items (tool results) and ``reasoning`` items (an assistant's reasoning);
function ``tools`` (OpenAI's flat form), ``tool_choice``, ``parallel_tool_calls``;
``max_output_tokens``, ``temperature``, ``top_p``; ``reasoning.effort`` turns thinking mode on (``high``
stays high, ``xhigh`` is DeepSeek's ``max``; ``minimal`` / ``none`` leave it off); ``text.format``
``json_object`` / ``json_schema`` is enforced as the chat route's ``response_format`` is.

The answer comes back as output items: ``reasoning`` (thinking mode), one assistant ``message`` with
an ``output_text`` part, and one ``function_call`` item per tool call; ``status`` is ``completed``,
or ``incomplete`` with ``incomplete_details.reason`` ``max_output_tokens``. Streamed, it is
OpenAI's typed events (``response.created``, ``response.output_item.added``,
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...,
``response.completed`` -- also for an incomplete response, whose ``status`` says so, as vLLM sends
it and agents wait for it), each with its ``sequence_number``.

With ``store`` (OpenAI's default) the server keeps a finished response -- its conversation, without
the ``instructions``, which OpenAI does not carry over -- so ``previous_response_id`` continues it and
``GET`` / ``DELETE /v1/responses/{id}`` read or drop it. The store is in memory and keeps the last
:data:`STORED_RESPONSES` responses (a restart forgets them).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import Field, ValidationError

from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, ChatMessage, _Request
from .serving_chat import ChatServing, _Choice
from .serving_common import ServingContext, aclosing_iter, event_json, log_request, until_done_or_disconnect

#: finished responses kept for previous_response_id and GET (the oldest go first)
STORED_RESPONSES = 1024


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: Literal["disabled", "auto"] | None = None


_EFFORT = {"minimal": None, "none": None, "low": "", "medium": "", "high": "high", "xhigh": "max", "max": "max"}


class ResponsesServing:
    def __init__(self, ctx: ServingContext, chat: ChatServing):
        self.ctx, self.chat = ctx, chat
        self._stored: OrderedDict[str, tuple[list[ChatMessage], dict]] = OrderedDict()
        self._lock = threading.Lock()       # the store is read on the prepare threads

    # ------------------------------------------------------------------ the store
    def get(self, response_id: str) -> dict:
        return self._find(response_id, "response_id")[1]

    def delete(self, response_id: str) -> dict:
        self._find(response_id, "response_id", drop=True)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _find(self, response_id: str, param: str, drop: bool = False) -> tuple[list[ChatMessage], dict]:
        """A stored response's (conversation, response), dropped from the store with ``drop``; a 404
        naming ``param`` when there is none."""
        with self._lock:
            found = self._stored.pop(response_id, None) if drop else self._stored.get(response_id)
        if found is None:
            where = "" if param == "response_id" else f"{param}: "
            raise APIError(404, f"{where}no stored response with id {response_id!r}", param, "not_found")
        return found

    def _keep(self, response: dict, conversation: list[ChatMessage]) -> None:
        with self._lock:
            self._stored[response["id"]] = (conversation, response)
            while len(self._stored) > STORED_RESPONSES:
                self._stored.popitem(last=False)

    # ------------------------------------------------------------------ request -> chat request
    def _conversation(self, req: ResponsesRequest) -> list[ChatMessage]:
        """The conversation before this answer, without the instructions: a stored response's, then
        this request's input items."""
        out: list[ChatMessage] = []
        if req.previous_response_id is not None:
            out += self._find(req.previous_response_id, "previous_response_id")[0]
        if isinstance(req.input, str):
            return out + [ChatMessage(role="user", content=req.input)]
        if not req.input:
            raise bad_request("input: expected a string or at least one item", "input")
        reasoning: str | None = None
        for i, item in enumerate(req.input):
            kind = item.get("type", "message" if "role" in item else None)
            where = f"input[{i}]"
            if kind == "message":
                role = item.get("role")
                if role not in ("user", "assistant", "system", "developer"):
                    raise bad_request(f"{where}.role: expected user, assistant, system or developer, got {role!r}",
                                      "input")
                text = _content_text(item.get("content"), where)
                if role == "assistant":
                    out.append(ChatMessage(role="assistant", content=text, reasoning_content=reasoning))
                    reasoning = None
                else:
                    out.append(ChatMessage(role=role, content=text))
            elif kind == "function_call":
                call_id, name = item.get("call_id"), item.get("name")
                if not isinstance(call_id, str) or not call_id or not isinstance(name, str) or not name:
                    raise bad_request(f"{where}: a function_call item needs call_id and name", "input")
                call = {"id": call_id, "type": "function",
                        "function": {"name": name, "arguments": item.get("arguments") or "{}"}}
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and reasoning is None:
                    # one assistant turn, several calls (a new message: a stored one is never changed)
                    calls = [tc.model_dump(exclude_none=True) for tc in last.tool_calls or []] + [call]
                    out[-1] = ChatMessage.model_validate({**last.model_dump(exclude_none=True), "tool_calls": calls})
                    continue
                out.append(ChatMessage.model_validate({"role": "assistant", "content": None,
                                                       "reasoning_content": reasoning, "tool_calls": [call]}))
                reasoning = None
            elif kind == "function_call_output":
                call_id = item.get("call_id")
                if not isinstance(call_id, str) or not call_id:
                    raise bad_request(f"{where}: a function_call_output item needs call_id", "input")
                output = item.get("output")
                out.append(ChatMessage(role="tool", tool_call_id=call_id,
                                       content=output if isinstance(output, str) else _content_text(output, where)))
            elif kind == "reasoning":
                parts = item.get("content") or item.get("summary") or []
                reasoning = (reasoning or "") + "".join(p.get("text", "") for p in parts if isinstance(p, dict))
            else:
                raise bad_request(f"{where}.type: {kind!r} items are not supported (messages, function_call, "
                                  "function_call_output and reasoning are)", "input")
        return out

    def _chat_request(self, req: ResponsesRequest, conversation: list[ChatMessage]) -> ChatCompletionRequest:
        body: dict[str, Any] = {"model": req.model, "messages": conversation, "n": 1, "stream": False,
                                "temperature": req.temperature, "top_p": req.top_p,
                                "max_completion_tokens": req.max_output_tokens,
                                "parallel_tool_calls": req.parallel_tool_calls}
        if req.instructions:
            body["messages"] = [ChatMessage(role="system", content=req.instructions)] + conversation
        if req.tools:
            tools = []
            for k, t in enumerate(req.tools):
                if t.get("type") != "function":
                    raise bad_request(f"tools[{k}].type: only function tools are supported, got {t.get('type')!r}",
                                      "tools")
                tools.append({"type": "function", "function": {key: t[key] for key in
                                                               ("name", "description", "parameters", "strict")
                                                               if t.get(key) is not None}})
            body["tools"] = tools
        choice = req.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not choice.get("name"):
                raise bad_request("tool_choice: expected none, auto, required or {\"type\": \"function\", "
                                  "\"name\": ...}", "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
        effort = (req.reasoning or {}).get("effort")
        if req.reasoning is not None and effort not in _EFFORT and effort is not None:
            raise bad_request(f"reasoning.effort: expected one of {', '.join(_EFFORT)}, got {effort!r}", "reasoning")
        thinking = req.reasoning is not None and (effort is None or _EFFORT[effort] is not None)
        body["chat_template_kwargs"] = {"thinking": thinking}
        if thinking and effort is not None and _EFFORT[effort]:
            body["reasoning_effort"] = _EFFORT[effort]
        fmt = (req.text or {}).get("format")
        if fmt is not None and fmt.get("type") != "text":
            if fmt.get("type") == "json_object":
                body["response_format"] = {"type": "json_object"}
            elif fmt.get("type") == "json_schema":
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}}
            else:
                raise bad_request(f"text.format.type: expected text, json_object or json_schema, got "
                                  f"{fmt.get('type')!r}", "text")
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise bad_request(f"the request does not map to a chat request: {e.errors()[0]['msg']}", "input") from None

    def _prepare(self, req: ResponsesRequest):
        if req.background:
            raise bad_request("background: not supported (the answer streams or comes back when it is done)",
                              "background")
        if req.truncation == "auto":
            raise bad_request("truncation: 'auto' is not supported (a prompt over the context is refused)",
                              "truncation")
        conversation = self._conversation(req)
        chat_req = self._chat_request(req, conversation)
        try:
            ids, reqs, choices = self.chat.engine_requests(chat_req)
        except APIError as e:       # name the Responses fields, not the chat route's
            param = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text",
                     "reasoning_effort": "reasoning", "chat_template_kwargs": "reasoning"}.get(e.param, e.param)
            raise APIError(e.status, e.message, param, e.code) from None
        return conversation, ids, reqs[0], choices[0]

    # ------------------------------------------------------------------ engine -> response
    async def create(self, req: ResponsesRequest, raw: Request):
        started = time.monotonic()
        model = self.ctx.check_model(req.model)
        conversation, ids, ereq, c = await self.ctx.prepare(self._prepare, req)
        rid = f"resp_{secrets.token_hex(24)}"
        sub = self.ctx.engine.submit(rid, [ereq])
        if self.ctx.metrics is not None:
            self.ctx.metrics.admitted(len(ids))
        run = _Run(self, req, rid, model, c, sub, len(ids), conversation)
        if req.stream:
            return StreamingResponse(aclosing_iter(self._stream(run, started), sub.abort),
                                     media_type="text/event-stream")
        ok = await until_done_or_disconnect(raw, run.collect(), sub.abort)
        if ok is None:
            log_request("responses", rid, "client gone", sub, len(ids), started)
            return None
        log_request("responses", rid, 500 if c.error else 200, sub, len(ids), started, [c.finish_reason],
                    c.error or "")
        if c.error:
            raise APIError(500, f"the request failed in the engine: {c.error}", code="engine_error", logged=True)
        return run.finish()

    async def _stream(self, run: "_Run", started: float):
        c, status = run.choice, "200"
        try:
            yield run.event("response.created", {"response": run.response("in_progress")})
            yield run.event("response.in_progress", {"response": run.response("in_progress")})
            async for deltas in run.deltas():
                for name, data in run.items.events(deltas):
                    yield run.event(name, data)
            if c.error:
                status = "500"
                yield run.event("error", {"code": "engine_error", "message": f"the request failed in the engine: "
                                                                             f"{c.error}", "param": None})
                return
            for name, data in run.items.close():
                yield run.event(name, data)
            # always response.completed (its status may be "incomplete"): the SDKs' stream helpers and agents
            # such as Codex wait for that event, as vLLM's server sends it
            yield run.event("response.completed", {"response": run.finish()})
        finally:
            if not c.done and status == "200":
                status = "client gone"
            log_request("responses", run.rid, status, run.sub, run.prompt_tokens, started, [c.finish_reason])


class _Run:
    """One response being made: the chat parser's deltas folded into output items."""

    def __init__(self, serving: ResponsesServing, req: ResponsesRequest, rid: str, model: str, choice: _Choice,
                 sub, prompt_tokens: int, conversation: list[ChatMessage]):
        self.serving, self.req, self.rid, self.model, self.choice = serving, req, rid, model, choice
        self.sub, self.prompt_tokens, self.conversation = sub, prompt_tokens, conversation
        self.created = int(time.time())
        self.items = _Items()
        self.sequence = 0

    def deltas(self):
        return self.serving.chat.choice_deltas(self.choice, self.sub)

    async def collect(self) -> bool:
        async for deltas in self.deltas():
            self.items.events(deltas)
        self.items.close()
        return True

    def event(self, name: str, data: dict) -> str:
        self.sequence += 1
        return f"event: {name}\ndata: {event_json({'type': name, 'sequence_number': self.sequence - 1, **data})}\n\n"

    def response(self, status: str, output: list | None = None) -> dict:
        r, c = self.req, self.choice
        done = status != "in_progress"
        return {
            "id": self.rid, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output or [], "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
            "parallel_tool_calls": r.parallel_tool_calls is not False, "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning, "text": r.text or {"format": {"type": "text"}}, "store": r.store,
            "metadata": r.metadata or {}, "user": r.user, "truncation": r.truncation or "disabled",
            "usage": {"input_tokens": self.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": self.sub.cached(1)},
                      "output_tokens": c.tokens, "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                      "total_tokens": self.prompt_tokens + c.tokens} if done else None,
        }

    def finish(self) -> dict:
        """The finished response (kept in the store when asked)."""
        c = self.choice
        response = self.response("incomplete" if c.finish_reason == "length" else "completed", self.items.done)
        if self.req.store:
            answer = ChatMessage.model_validate({
                "role": "assistant", "content": "".join(c.content) or None, "tool_calls": c.calls or None,
                "reasoning_content": "".join(c.reasoning) if c.thinking else None})
            self.serving._keep(response, self.conversation + [answer])
        return response


class _Items:
    """Chat deltas (reasoning, content, tool calls) -> Responses output items and their stream events."""

    def __init__(self):
        self.done: list[dict] = []          # finished items, in order
        self.open: dict | None = None       # the item being written
        self.text: list[str] = []

    def _added(self, item: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self.open, self.text = item, []
        out.append(("response.output_item.added", {"output_index": len(self.done), "item": dict(item)}))
        if item["type"] == "message":
            out.append(("response.content_part.added", {"item_id": item["id"], "output_index": len(self.done),
                                                        "content_index": 0, "part": _text_part("")}))
        return out

    def close(self) -> list[tuple[str, dict]]:
        item = self.open
        if item is None:
            return []
        self.open, text, at = None, "".join(self.text), len(self.done)
        out = []
        if item["type"] == "message":
            item["content"], item["status"] = [_text_part(text)], "completed"
            out += [("response.output_text.done", {"item_id": item["id"], "output_index": at, "content_index": 0,
                                                    "text": text, "logprobs": []}),
                    ("response.content_part.done", {"item_id": item["id"], "output_index": at, "content_index": 0,
                                                    "part": _text_part(text)})]
        elif item["type"] == "reasoning":
            item["content"], item["status"] = [{"type": "reasoning_text", "text": text}], "completed"
            out.append(("response.reasoning_text.done", {"item_id": item["id"], "output_index": at,
                                                         "content_index": 0, "text": text}))
        else:
            item["arguments"], item["status"] = text, "completed"
            out.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": at,
                                                                  "arguments": text}))
        self.done.append(item)
        return out + [("response.output_item.done", {"output_index": at, "item": item})]

    def events(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        out = []
        for d in deltas:
            if "reasoning_content" in d:
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._added({"id": f"rs_{secrets.token_hex(12)}", "type": "reasoning", "summary": [],
                                        "content": [], "status": "in_progress"})
                self.text.append(d["reasoning_content"])
                out.append(("response.reasoning_text.delta", {
                    "item_id": self.open["id"], "output_index": len(self.done), "content_index": 0,
                    "delta": d["reasoning_content"]}))
            elif "content" in d:
                if self.open is None or self.open["type"] != "message":
                    out += self._added({"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
                                        "status": "in_progress", "content": []})
                self.text.append(d["content"])
                out.append(("response.output_text.delta", {"item_id": self.open["id"], "output_index": len(self.done),
                                                           "content_index": 0, "delta": d["content"], "logprobs": []}))
            elif "tool_calls" in d:
                tc = d["tool_calls"][0]
                if "id" in tc:
                    out += self._added({"id": f"fc_{secrets.token_hex(12)}", "type": "function_call",
                                        "call_id": tc["id"], "name": tc["function"]["name"], "arguments": "",
                                        "status": "in_progress"})
                else:
                    self.text.append(tc["function"]["arguments"])
                    out.append(("response.function_call_arguments.delta", {
                        "item_id": self.open["id"], "output_index": len(self.done),
                        "delta": tc["function"]["arguments"]}))
        return out


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _content_text(content: Any, where: str) -> str:
    """A message's text: a string, or text parts (``input_text``, ``output_text``, ``text``) joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content: expected a string or a list of text parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}.content[{k}]: only text parts are supported, got {kind!r}", "input")
        texts.append(part["text"])
    return "".join(texts)

