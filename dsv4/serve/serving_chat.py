"""``POST /v1/chat/completions``: the DSV4 chat encoding in, reasoning / content / tool calls out.

The prompt is :func:`dsv4.text.chat.encode_messages` (DSV4_FACTS 6, 6b). The engine streams text
with special tokens kept, and one :class:`~dsv4.text.chat.StreamingParser` per choice splits it:
reasoning goes to ``reasoning_content``, content to ``content``, each complete DSML tool call to
``tool_calls`` (streamed as a delta with the id and name, then one with the arguments). The parser
holds back anything that may still become markup, so markup never reaches ``content`` whatever
the chunking. Markup that does not parse (a malformed tool block, a stray ``</think>``) ends the
choice with ``finish_reason: "stop"``: its raw text goes to ``content``, the log says what was
wrong, and the engine request ends (never a half-parsed call); under ``ignore_eos`` (a request for
exactly ``max_tokens`` tokens) generation goes on and the rest is raw ``content`` too. Special
tokens the parser does not read (``<｜User｜>``, ...) are left out of ``content`` and
``reasoning_content`` unless the request says ``skip_special_tokens: false`` (vLLM's field and
default).

Thinking mode: ``chat_template_kwargs: {"thinking": true}`` (or ``enable_thinking``), DeepSeek's
``thinking: {"type": "enabled"}``, or a ``reasoning_effort`` (``high`` | ``max``), which turns it on
unless thinking is explicitly off. Usage counts reasoning tokens in
``completion_tokens_details.reasoning_tokens``.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..text.chat import (ChatFormatError, ContentDelta, ParseError, ReasoningDelta, StreamingParser, ToolCallEvent,
                         encode_messages)
from ..engine.grammar import StructuredOutputsParams
from ..text.markup import DSML, EOS, THINK_END, THINK_START, SpecialTextFilter
from ..text.tool_grammar import ToolGrammarError, shortest_block, tool_calls_grammar
from .async_engine import Delta, EngineRequest, Submission
from .errors import APIError, bad_request
from .protocol import ChatCompletionRequest, ChatMessage
from .serving_common import (ServingContext, aclosing_iter, check_request, log_request,
                             sampling_params, sse, stream_usage, structured_outputs, truncate_prompt,
                             until_done_or_disconnect)

log = logging.getLogger("dsv4.serve")


@dataclass
class _Choice:
    """One chat choice being parsed and built."""

    index: int
    parser: StreamingParser
    thinking: bool
    stop_ids: set[int]
    tools_allowed: bool
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    tokens: int = 0
    reasoning_tokens: int = 0
    in_reasoning: bool = False
    entries: list[tuple[int, float, list]] = field(default_factory=list)
    pending: list[tuple[int, float, list]] = field(default_factory=list)   # logprobs not yet streamed
    finish_reason: str | None = None
    stop_reason: int | str | None = None    # vLLM's: the stop string or stop token id that ended it
    malformed: bool = False
    error: str | None = None
    strip_reasoning: SpecialTextFilter | None = None      # skip_special_tokens, one filter per channel
    strip_content: SpecialTextFilter | None = None
    ignore_eos: bool = False     # an end token is not the end (vLLM's ignore_eos): the parser never sees it

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class ChatServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        tok = ctx.tokenizer
        self.think_end_id = tok.hf.token_to_id(THINK_END)
        self.dsml_id = tok.hf.token_to_id(DSML)
        # what skip_special_tokens leaves out of the client's text: every special token but the markup
        # the parser reads (a stray one of those is a parse error, reported as such)
        self.specials = SpecialTextFilter(t for t in tok.special_tokens() if t not in (THINK_START, THINK_END, DSML))

    # ------------------------------------------------------------------ request -> prompt
    def _thinking(self, req: ChatCompletionRequest) -> tuple[bool, str | None]:
        kwargs = req.chat_template_kwargs or {}
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
        if req.thinking is not None:
            t = req.thinking
            thinking = t if isinstance(t, bool) else {"enabled": True, "disabled": False}.get(t.get("type"), "?")
            if thinking == "?":
                raise bad_request('thinking: expected {"type": "enabled"} or {"type": "disabled"}', "thinking")
        effort = req.reasoning_effort if req.reasoning_effort is not None else kwargs.get("reasoning_effort")
        if effort not in (None, "high", "max"):
            raise bad_request(f"reasoning_effort: expected 'high' or 'max', got {effort!r}", "reasoning_effort")
        if thinking is None:
            thinking = effort is not None
        if not isinstance(thinking, bool):
            raise bad_request(f"chat_template_kwargs.thinking: expected true or false, got {thinking!r}",
                              "chat_template_kwargs")
        return thinking, effort

    def prompt(self, req_messages: list[ChatMessage], *, thinking: bool, effort: str | None, tools, response_format,
               drop_thinking: bool = True, add_generation_prompt: bool = True,
               continue_final_message: bool = False) -> list[int]:
        """The prompt's token ids (400 naming the field for anything the encoding refuses)."""
        messages = [_message_dict(m, i) for i, m in enumerate(req_messages)]
        try:
            text = encode_messages(messages, thinking=thinking, reasoning_effort=effort, tools=tools,
                                   response_format=response_format, drop_thinking=drop_thinking,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message)
        except ChatFormatError as e:
            raise bad_request(str(e), str(e).split(":")[0].split(".")[0].split("[")[0] or "messages") from None
        return self.ctx.tokenizer.encode(text)

    def forced_tool_calls(self, tools: list[dict] | None, choice, parallel: bool | None
                          ) -> StructuredOutputsParams | None:
        """The constraint of ``tool_choice`` "required" or a named function: the answer is one DSV4
        tool-call block (after the reasoning, in thinking mode) whose arguments match the tools'
        schemas; None for "auto" and "none"."""
        if choice in (None, "auto", "none"):
            return None
        name = None if choice == "required" else choice.function.name
        try:
            grammar = tool_calls_grammar(tools, self.dsml_id, name=name, parallel=name is None and parallel is not False)
        except ToolGrammarError as e:
            raise bad_request(str(e), "tool_choice" if str(e).startswith("tool_choice") else "tools") from None
        reserve = len(self.ctx.tokenizer.encode(shortest_block(tools, name)))
        return StructuredOutputsParams(grammar=grammar, param="tools", min_reserve=reserve)

    def engine_requests(self, req: ChatCompletionRequest) -> tuple[list[int], list[EngineRequest], list[_Choice]]:
        """A chat request's prompt ids, its engine requests (one per choice) and the choices that fold
        their output (400 naming the field for anything wrong; the Responses route builds on it)."""
        if not req.messages:
            raise bad_request("messages: expected a non-empty list of messages", "messages")
        choice = req.tool_choice
        if choice not in (None, "none") and not req.tools:
            raise bad_request(f"tool_choice {_choice_name(choice)} needs tools", "tool_choice")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        thinking, effort = self._thinking(req)
        prefill = req.continue_final_message
        if prefill == req.add_generation_prompt:
            raise bad_request("continue_final_message: true goes with add_generation_prompt: false (vLLM's rule)"
                              if prefill else "add_generation_prompt: false is supported only with "
                              "continue_final_message: true (the answer continues the last assistant message)",
                              "continue_final_message" if prefill else "add_generation_prompt")
        tools_allowed = bool(req.tools) and choice != "none"
        tools = [_tool_dict(t) for t in req.tools] if tools_allowed else None
        fmt = req.response_format
        response_format = fmt.model_dump(exclude_none=True) if fmt is not None and fmt.type != "text" else None
        structured = structured_outputs(req)
        forced = self.forced_tool_calls(tools, choice, req.parallel_tool_calls)
        if forced is not None:
            if structured is not None:
                raise bad_request(f"tool_choice {_choice_name(choice)} and {structured.param}: give one of them",
                                  "tool_choice")
            structured = forced
        if prefill and structured is not None:
            raise bad_request(f"continue_final_message and {structured.param}: a constraint applies to a whole answer, "
                              "not to the rest of a message", "continue_final_message")
        kwargs = req.chat_template_kwargs or {}
        ids = self.prompt(req.messages, thinking=thinking, effort=effort, tools=tools, response_format=response_format,
                          drop_thinking=bool(kwargs.get("drop_thinking", True)), continue_final_message=prefill)
        thinking = thinking and not prefill     # a continued message goes on in its content
        ids = truncate_prompt(self.ctx, req, ids)
        limit = self.ctx.max_model_len
        if len(ids) >= limit:
            raise bad_request(f"messages: the prompt has {len(ids)} tokens, but max_model_len is {limit} (the prompt "
                              "and at least one generated token must fit)", "messages", "context_length_exceeded")
        max_tokens = req.max_completion_tokens or req.max_tokens or limit - len(ids)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        eos = self.ctx.tokenizer.eos_id
        # the ids whose logprob entry is dropped when they end the output (kept with their text under
        # include_stop_str_in_output)
        stop_ids = set() if req.include_stop_str_in_output else \
            set(req.stop_token_ids or []) | (set() if req.ignore_eos else {eos})
        reqs, choices = [], []
        seed = self.ctx.request_seed(req.seed)
        for k in range(req.n):
            params = sampling_params(req, max_tokens, logprobs=logprobs, choice=k, seed=seed, structured=structured)
            check_request(self.ctx, ids, params, "messages")
            reqs.append(EngineRequest(ids, params, skip_special_tokens=False, cache_salt=req.cache_salt))
            parser = StreamingParser(thinking, call_id_prefix=f"call_{secrets.token_hex(8)}_")
            choice = _Choice(k, parser, thinking, stop_ids, tools_allowed, in_reasoning=thinking,
                             ignore_eos=req.ignore_eos)
            if req.skip_special_tokens:
                choice.strip_reasoning, choice.strip_content = self.specials.fresh(), self.specials.fresh()
            choices.append(choice)
        return ids, reqs, choices

    async def create(self, req: ChatCompletionRequest, raw: Request):
        started = time.monotonic()
        model = self.ctx.check_model(req.model)
        ids, reqs, choices = await self.ctx.prepare(self.engine_requests, req)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        sub = self.ctx.engine.submit(rid, reqs)
        if self.ctx.metrics is not None:
            self.ctx.metrics.admitted(len(ids) * len(reqs))
        head = {"id": rid, "created": int(time.time()), "model": model}
        want_logprobs = req.logprobs
        if req.stream:
            body = self._stream(sub, choices, head, stream_usage(req), want_logprobs, len(ids), started)
            return StreamingResponse(aclosing_iter(body, sub.abort), media_type="text/event-stream")
        ok = await until_done_or_disconnect(raw, self._collect(sub, choices), sub.abort)
        if ok is None:
            log_request("chat", rid, "client gone", sub, len(ids), started)
            return None
        failed = next((c for c in choices if c.error), None)
        log_request("chat", rid, 500 if failed else 200, sub, len(ids), started, [c.finish_reason for c in choices],
                    failed.error if failed else "")
        if failed is not None:
            raise APIError(500, f"the request failed in the engine: {failed.error}", code="engine_error", logged=True)
        return {**head, "object": "chat.completion", "system_fingerprint": None,
                "choices": [self._final_choice(c, want_logprobs) for c in choices],
                "usage": _usage(len(ids), choices, sub.cached(len(choices)))}

    def _final_choice(self, c: _Choice, want_logprobs: bool) -> dict:
        content = "".join(c.content)
        message = {"role": "assistant", "content": content if content or not c.calls else None,
                   "reasoning_content": "".join(c.reasoning) if c.thinking else None, "tool_calls": c.calls}
        return {"index": c.index, "message": message, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "logprobs": {"content": self._logprobs(c.entries), "refusal": None} if want_logprobs else None}

    # ------------------------------------------------------------------ engine -> choices
    def _take(self, c: _Choice, d: Delta, sub: Submission) -> list[dict]:
        """Fold one delta into its choice; returns the message deltas to stream (may be [])."""
        if c.done:
            return []
        if d.error:
            c.error, c.finish_reason = d.error, "error"
            return []
        self._count(c, d)
        if c.malformed:          # ignore_eos after markup that did not parse: the rest is raw content
            events: list = [ContentDelta(d.text)]
        else:
            # An end token in the text would make everything after it "stray markup" and end the
            # choice early; under ignore_eos the request asked for max_tokens tokens whatever they are.
            events = c.parser.feed(d.text.replace(EOS, "") if c.ignore_eos else d.text)
            if d.finished:
                events += c.parser.finish()
        out: list[dict] = []
        for ev in events:
            if isinstance(ev, ReasoningDelta):
                out += self._text(c, "reasoning", ev.text)
            elif isinstance(ev, ContentDelta):
                out += self._text(c, "content", ev.text)
            elif isinstance(ev, ToolCallEvent):
                out += self._tool_call(c, ev)
            elif isinstance(ev, ParseError):
                what = "malformed tool-call markup" if "DSML" in ev.message or DSML in ev.raw else "stray markup"
                log.warning("%s choice %d: %s (%s); its raw text returned as content, generation %s",
                            sub.request_ids[c.index].rsplit("-", 1)[0], c.index, what, ev.message,
                            "goes on (ignore_eos)" if c.ignore_eos else "stopped")
                out += self._text(c, "content", ev.raw)
                c.malformed = True
                if not c.ignore_eos:             # ignore_eos asked for max_tokens tokens: they go on as content
                    c.finish_reason = "stop"
                    sub.finish(c.index, "stop")  # the metric counts what the client is told, not an abort
                break
        if d.finished and not c.done:
            reason = d.finish_reason
            c.finish_reason = "tool_calls" if reason == "stop" and c.calls else reason
            c.stop_reason = d.stop_reason
        if c.done:       # text a special-token filter held back is text after all
            out += self._text(c, "reasoning", "", end=True) + self._text(c, "content", "", end=True)
        return out

    def _text(self, c: _Choice, channel: str, text: str, end: bool = False) -> list[dict]:
        """Reasoning or content text for the client (special tokens left out unless asked for)."""
        strip = c.strip_reasoning if channel == "reasoning" else c.strip_content
        if strip is not None:
            text = strip.flush() if end else strip.feed(text)
        if not text:
            return []
        (c.reasoning if channel == "reasoning" else c.content).append(text)
        return [{"reasoning_content" if channel == "reasoning" else "content": text}]

    def _count(self, c: _Choice, d: Delta) -> None:
        c.tokens += len(d.token_ids)
        for t in d.token_ids:
            if c.in_reasoning:
                if t == self.think_end_id:
                    c.in_reasoning = False
                else:
                    c.reasoning_tokens += 1
        if d.logprobs is not None:
            new = list(zip(d.token_ids, d.logprobs, d.top_logprobs))
            if d.finish_reason == "stop" and new and new[-1][0] in c.stop_ids:
                new = new[:-1]
            c.entries += new
            c.pending += new

    def _tool_call(self, c: _Choice, ev: ToolCallEvent) -> list[dict]:
        if not c.tools_allowed:
            log.warning("the model called %r although tool_choice is 'none' or no tools were given; dropped",
                        ev.call.name)
            return []
        k = len(c.calls)
        call = ev.call
        c.calls.append({"id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments_json}})
        return [{"tool_calls": [{"index": k, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}]},
                {"tool_calls": [{"index": k, "function": {"arguments": call.arguments_json}}]}]

    async def choice_deltas(self, c: _Choice, sub: Submission, seen: Callable[[Delta], None] | None = None):
        """One choice's message deltas, a list per engine step, until it is done (the other routes fold
        them into their own shapes); an engine error aborts the request. ``seen`` gets every delta."""
        async for _, d in sub:
            if seen is not None:
                seen(d)
            out = self._take(c, d, sub)
            if c.error:
                sub.abort()
            if out:
                yield out
            if c.done:
                break

    async def _collect(self, sub: Submission, choices: list[_Choice]) -> bool:
        async for i, d in sub:
            c = choices[i]
            self._take(c, d, sub)
            if c.error:
                sub.abort()
            if all(ch.done for ch in choices):
                break
        return True

    async def _stream(self, sub: Submission, choices: list[_Choice], head: dict, usages: tuple[bool, bool],
                      want_logprobs: bool, prompt_tokens: int, started: float):
        status = "200"
        usage, continuous = usages

        def chunk(c: _Choice, delta: dict, finish: str | None = None) -> str:
            choice = {"index": c.index, "delta": delta, "finish_reason": finish, "logprobs": None}
            if finish is not None:
                choice["stop_reason"] = c.stop_reason
            if want_logprobs and c.pending:
                choice["logprobs"] = {"content": self._logprobs(c.pending), "refusal": None}
                c.pending = []
            extra = {}
            if usage:       # null in every chunk but the last, or the usage so far (continuous_usage_stats)
                extra["usage"] = _usage(prompt_tokens, choices, sub.cached(len(choices))) if continuous else None
            return sse({**head, "object": "chat.completion.chunk", "choices": [choice], **extra})

        try:
            for c in choices:
                yield chunk(c, {"role": "assistant", "content": ""})
            async for i, d in sub:
                c = choices[i]
                if c.done:
                    continue
                for delta in self._take(c, d, sub):
                    yield chunk(c, delta)
                if c.error:
                    status = "500"
                    sub.abort()
                    yield sse({"error": {"message": f"the request failed in the engine: {c.error}",
                                         "type": "server_error", "param": None, "code": "engine_error"}})
                    break
                if c.done:
                    yield chunk(c, {}, c.finish_reason)
                if all(ch.done for ch in choices):
                    break
            if usage and status == "200":
                yield sse({**head, "object": "chat.completion.chunk", "choices": [],
                           "usage": _usage(prompt_tokens, choices, sub.cached(len(choices)))})
            yield sse("[DONE]")
        finally:
            if not all(c.done for c in choices) and status == "200":
                status = "client gone"
            log_request("chat", head["id"], status, sub, prompt_tokens, started, [c.finish_reason for c in choices])

    def _logprobs(self, entries: list) -> list[dict]:
        ctx = self.ctx
        out = []
        for token, lp, top in entries:
            out.append({"token": ctx.token_str(token), "logprob": lp, "bytes": list(ctx.token_bytes(token)),
                        "top_logprobs": [{"token": ctx.token_str(t), "logprob": v, "bytes": list(ctx.token_bytes(t))}
                                         for t, v in top]})
        return out


def _usage(prompt_tokens: int, choices: list[_Choice], cached: int) -> dict:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}}


def _choice_name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{'function': {{'name': {choice.function.name!r}}}}}"


def _message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    """A message as the encoder takes it: text parts joined (other parts refused), tool calls as dicts."""
    d: dict[str, Any] = {"role": m.role}
    content = m.content
    if isinstance(content, list):
        for k, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise bad_request(f"messages[{i}].content[{k}]: only text parts are supported, got {part.type!r}",
                                  "messages")
        content = ([{"type": "text", "text": p.text} for p in content] if m.role == "tool"
                   else "\n\n".join(p.text for p in content))
    d["content"] = content
    if m.tool_calls:
        d["tool_calls"] = [{"id": tc.id, "type": tc.type,
                            "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                           for tc in m.tool_calls]
    for key in ("tool_call_id", "reasoning_content"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    extra = m.model_extra or {}
    if m.reasoning_content is None and isinstance(extra.get("reasoning"), str):   # vLLM's newer name
        d["reasoning_content"] = extra["reasoning"]
    for key in ("tools", "response_format"):
        if extra.get(key) is not None:
            d[key] = extra[key]
    return d


def _tool_dict(tool) -> dict:
    fn = tool.function.model_dump(exclude_none=True, exclude={"strict"})
    return {"type": "function", "function": fn}
