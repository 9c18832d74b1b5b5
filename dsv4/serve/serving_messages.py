"""``POST /v1/messages``: Anthropic's Messages API on the same engine and chat encoding.

A request becomes the chat route's prompt (:meth:`ChatServing.prompt`): ``system``, ``user`` and
``assistant`` turns with ``text``, ``tool_use`` and ``tool_result`` blocks (and ``thinking`` blocks of
earlier turns) map to DSV4 messages and tool calls; ``tools`` (``input_schema``) to DSV4 tools;
``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` to ``auto`` / ``required`` / a named function /
``none`` (``any`` and ``tool`` force a tool-call block whose arguments follow the schemas, as in chat;
``disable_parallel_tool_use`` gives one call); ``thinking: {"type": "enabled", "budget_tokens": N}``
to thinking mode with ``thinking_token_budget`` N; ``stop_sequences``, ``max_tokens``, ``temperature``,
``top_p``, ``top_k`` to the sampling parameters; a final ``assistant`` message is a prefill the answer
continues (not with thinking). The output goes through the chat route's parser, so
reasoning, text and tool calls come back as ``thinking``, ``text`` and ``tool_use`` blocks; streamed
as Anthropic's events (``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``,
``message_delta`` with the stop reason and usage, ``message_stop``). Errors use Anthropic's shape
(``{"type": "error", "error": {"type", "message"}}``; the app does that for this path).
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import SamplingParams
from ..errors import RequestError
from ..text.chat import StreamingParser
from .async_engine import EngineRequest, Submission
from .errors import APIError, bad_request
from .protocol import ChatMessage, FunctionCall, NamedFunction, NamedToolChoice, ToolCallIn
from .serving_chat import ChatServing, _Choice
from .serving_common import (ServingContext, aclosing_iter, check_request, event_json, log_request,
                             until_done_or_disconnect)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class Block(_Request):
    """A content block of any type (only the fields of the types used here are read)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None


class Message(_Request):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class AnthropicTool(_Request):
    name: str = Field(..., min_length=1, max_length=256)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Request):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class MessagesRequest(_Request):
    model: str
    max_tokens: int = Field(..., ge=1)
    messages: list[Message]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = Field(None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None
    metadata: dict[str, Any] | None = None


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


class MessagesServing:
    def __init__(self, ctx: ServingContext, chat: ChatServing):
        self.ctx, self.chat = ctx, chat

    # ------------------------------------------------------------------ request -> engine
    def _messages(self, req: MessagesRequest) -> list[ChatMessage]:
        out: list[ChatMessage] = []
        if req.system:
            system = req.system if isinstance(req.system, str) else "\n\n".join(
                _text_block(b, f"system[{k}]") for k, b in enumerate(req.system))
            out.append(ChatMessage(role="system", content=system))
        if not req.messages:
            raise bad_request("messages: expected at least one message", "messages")
        for i, m in enumerate(req.messages):
            blocks = [Block(type="text", text=m.content)] if isinstance(m.content, str) else m.content
            where = f"messages[{i}].content"
            if m.role == "user":
                texts = []
                for k, b in enumerate(blocks):
                    if b.type == "tool_result":
                        if not b.tool_use_id:
                            raise bad_request(f"{where}[{k}].tool_use_id: required in a tool_result block", "messages")
                        out.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id,
                                               content=_result_text(b, f"{where}[{k}]")))
                    else:
                        texts.append(_text_block(b, f"{where}[{k}]"))
                if texts:
                    out.append(ChatMessage(role="user", content="\n\n".join(texts)))
                continue
            reasoning, texts, calls = [], [], []
            for k, b in enumerate(blocks):
                if b.type == "thinking":
                    reasoning.append(b.thinking or "")
                elif b.type == "redacted_thinking":
                    continue
                elif b.type == "tool_use":
                    if not b.id or not b.name:
                        raise bad_request(f"{where}[{k}]: a tool_use block needs id and name", "messages")
                    calls.append(ToolCallIn(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(
                        b.input if b.input is not None else {}, ensure_ascii=False))))
                else:
                    texts.append(_text_block(b, f"{where}[{k}]"))
            out.append(ChatMessage(role="assistant", content="".join(texts) or None, tool_calls=calls or None,
                                   reasoning_content="".join(reasoning) or None))
        return out

    def _request(self, req: MessagesRequest) -> tuple[list[int], EngineRequest, _Choice]:
        thinking = req.thinking is not None and req.thinking.type == "enabled"
        budget = req.thinking.budget_tokens if thinking else None
        choice = req.tool_choice
        if choice is not None and choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice.name: required with type 'tool'", "tool_choice")
        if choice is not None and choice.type in ("any", "tool") and not req.tools:
            raise bad_request(f"tool_choice: type {choice.type!r} needs tools", "tool_choice")
        tools_allowed = bool(req.tools) and (choice is None or choice.type != "none")
        tools = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                   **({"description": t.description} if t.description else {})}}
                 for t in req.tools] if tools_allowed else None
        forced = None
        if tools and choice is not None and choice.type in ("any", "tool"):
            named = "required" if choice.type == "any" else NamedToolChoice(function=NamedFunction(name=choice.name))
            forced = self.chat.forced_tool_calls(tools, named, not choice.disable_parallel_tool_use)
        # a final assistant message is a prefill: the answer goes on from it (Anthropic's rules: not with
        # thinking, no trailing white space; and here no forced tool call, which is a whole answer)
        messages = self._messages(req)
        prefill = messages[-1].role == "assistant"
        if prefill:
            last = messages[-1]
            if thinking:
                raise bad_request("messages: a final assistant message (a prefill) cannot be continued with "
                                  "thinking enabled", "messages")
            if forced is not None:
                raise bad_request("tool_choice: a forced tool call is a whole answer; it cannot continue a final "
                                  "assistant message", "tool_choice")
            if last.tool_calls:
                raise bad_request("messages: a final assistant message (a prefill) cannot end in tool_use", "messages")
            if (last.content or "") != (last.content or "").rstrip():
                raise bad_request("messages: final assistant content cannot end with trailing whitespace", "messages")
        ids = self.chat.prompt(messages, thinking=thinking, effort=None, tools=tools, response_format=None,
                               continue_final_message=prefill)
        limit = self.ctx.max_model_len
        if len(ids) >= limit:
            raise bad_request(f"messages: the prompt has {len(ids)} tokens, but the context is {limit} tokens",
                              "messages")
        stops = list(req.stop_sequences or [])
        if any(s == "" for s in stops):
            raise bad_request("stop_sequences: must not be empty strings", "stop_sequences")
        try:
            params = SamplingParams(
                max_tokens=req.max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, stop=stops,
                seed=self.ctx.request_seed(None), structured_outputs=forced, thinking_token_budget=budget)
        except RequestError as e:
            raise bad_request(str(e).replace("SamplingParams.", ""), e.param) from None
        check_request(self.ctx, ids, params, "messages")
        parser = StreamingParser(thinking, call_id_prefix=f"toolu_{secrets.token_hex(8)}_")
        c = _Choice(0, parser, thinking, {self.ctx.tokenizer.eos_id}, tools_allowed, in_reasoning=thinking)
        c.strip_reasoning, c.strip_content = self.chat.specials.fresh(), self.chat.specials.fresh()
        return ids, EngineRequest(ids, params, skip_special_tokens=False), c

    # ------------------------------------------------------------------ engine -> message
    async def create(self, req: MessagesRequest, raw: Request):
        started = time.monotonic()
        model = self.ctx.check_model(req.model)
        ids, ereq, c = await self.ctx.prepare(self._request, req)
        rid = f"msg_{uuid.uuid4().hex}"
        sub = self.ctx.engine.submit(rid, [ereq])
        if self.ctx.metrics is not None:
            self.ctx.metrics.admitted(len(ids))
        run = _Run(self, c, sub, req.stop_sequences or [])
        if req.stream:
            body = self._stream(run, rid, model, len(ids), started)
            return StreamingResponse(aclosing_iter(body, sub.abort), media_type="text/event-stream")
        ok = await until_done_or_disconnect(raw, run.collect(), sub.abort)
        if ok is None:
            log_request("messages", rid, "client gone", sub, len(ids), started)
            return None
        log_request("messages", rid, 500 if c.error else 200, sub, len(ids), started, [c.finish_reason], c.error or "")
        if c.error:
            raise APIError(500, f"the request failed in the engine: {c.error}", code="engine_error", logged=True)
        content = []
        if c.thinking and c.reasoning:
            content.append({"type": "thinking", "thinking": "".join(c.reasoning), "signature": ""})
        if c.content:
            content.append({"type": "text", "text": "".join(c.content)})
        for call in c.calls:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": json.loads(call["function"]["arguments"])})
        reason, sequence = run.stop_reason()
        return {"id": rid, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(ids), "output_tokens": c.tokens}}

    async def _stream(self, run: "_Run", rid: str, model: str, prompt_tokens: int, started: float):
        c, status = run.choice, "200"
        blocks = _Blocks()
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})
            async for deltas in run.deltas():
                for name, data in blocks.events(deltas):
                    yield _event(name, data)
            if c.error:
                status = "500"
                yield _event("error", {"type": "error", "error": {
                    "type": "api_error", "message": f"the request failed in the engine: {c.error}"}})
                return
            for name, data in blocks.close():
                yield _event(name, data)
            reason, sequence = run.stop_reason()
            yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                              "stop_sequence": sequence},
                                           "usage": {"output_tokens": c.tokens}})
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            if not c.done and status == "200":
                status = "client gone"
            log_request("messages", rid, status, run.sub, prompt_tokens, started, [c.finish_reason])


class _Run:
    """One request's engine output folded by the chat route's parser; the tokens kept to tell a stop
    sequence from the end of the turn."""

    def __init__(self, serving: MessagesServing, choice: _Choice, sub: Submission, stops: list[str]):
        self.serving, self.choice, self.sub, self.stops = serving, choice, sub, stops
        self.tokens: list[int] = []

    def deltas(self):
        return self.serving.chat.choice_deltas(self.choice, self.sub, lambda d: self.tokens.extend(d.token_ids))

    async def collect(self) -> bool:
        async for _ in self.deltas():
            pass
        return True

    def stop_reason(self) -> tuple[str, str | None]:
        reason = self.choice.finish_reason
        if reason == "stop" and self.stops and (not self.tokens or self.tokens[-1] != self.serving.ctx.tokenizer.eos_id):
            text = self.serving.ctx.tokenizer.decode(self.tokens)
            found = [(text.find(s), s) for s in self.stops if s in text]
            if found:
                return "stop_sequence", min(found)[1]
        return _STOP_REASONS.get(reason, "end_turn"), None


class _Blocks:
    """Chat deltas (reasoning, content, tool calls) -> Anthropic content-block events."""

    def __init__(self):
        self.index, self.kind = -1, None

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.kind = None
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def events(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        out = []
        for d in deltas:
            if "reasoning_content" in d:
                if self.kind != "thinking":
                    out += self._start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
            elif "content" in d:
                if self.kind != "text":
                    out += self._start("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": d["content"]}))
            elif "tool_calls" in d:
                tc = d["tool_calls"][0]
                if "id" in tc:
                    out += self._start("tool_use", {"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                                                    "input": {}})
                else:
                    out.append(self._delta({"type": "input_json_delta", "partial_json": tc["function"]["arguments"]}))
        return out


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {event_json(data)}\n\n"


def _text_block(b: Block, where: str) -> str:
    if b.type != "text" or b.text is None:
        raise bad_request(f"{where}: only text, tool_use, tool_result and thinking blocks are supported here, got "
                          f"{b.type!r}", "messages")
    return b.text


def _result_text(b: Block, where: str) -> str:
    content = b.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{k}]: only text parts are supported in a tool result", "messages")
            parts.append(part["text"])
        text = "\n\n".join(parts)
    return f"Error: {text}" if b.is_error else text
