"""``POST /v1/completions``: text or token-id prompts, n choices each, echo and logprobs.

With ``echo`` and ``logprobs`` the prompt's own logprobs come back first (None for its first
token), which is what lm-eval's loglikelihood reads; ``max_tokens: 0`` with ``echo`` returns the
prompt alone (the engine samples one token from the prompt's last logits and it is dropped).
Choices are numbered ``prompt_index * n + k``; a seeded request gives choice k the seed + k.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..errors import RequestError
from ..text.markup import BOS
from .async_engine import Delta, EngineRequest, Submission
from .errors import APIError, bad_request
from .protocol import CompletionLogprobs, CompletionRequest
from .serving_common import (ServingContext, aclosing_iter, check_request, log_request,
                             sampling_params, sse, stream_usage, structured_outputs, truncate_prompt,
                             until_done_or_disconnect)

MAX_CHOICES = 1024


@dataclass
class _Choice:
    """One choice being built: text, tokens and logprob entries (token id, logprob, top list)."""

    index: int
    prompt_text: str
    prompt_ids: list[int]
    echo: bool
    keep_output: bool
    stop_ids: set[int]
    text: list[str] = field(default_factory=list)
    tokens: int = 0
    entries: list[tuple[int, float | None, list]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0
    started: bool = False


class CompletionServing:
    def __init__(self, ctx: ServingContext):
        self.ctx = ctx

    # ------------------------------------------------------------------ request -> engine
    def _prompts(self, prompt) -> list[tuple[str, list[int]]]:
        """(text to echo, token ids) per prompt."""
        tok = self.ctx.tokenizer
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int) or prompt == []:
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            if isinstance(p, str):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise bad_request(f"prompt[{i}] is not valid Unicode text (lone surrogate at offset {e.start})",
                                      "prompt") from None
                out.append((p, tok.encode(p, add_bos=not p.startswith(BOS))))
            else:
                bad = [t for t in p if not 0 <= t < self.ctx.engine.vocab_size]
                if bad:
                    raise bad_request(f"prompt[{i}]: token ids outside [0, {self.ctx.engine.vocab_size}): {bad[:5]}",
                                      "prompt")
                out.append((tok.decode(p), list(p)))
        if not out:
            raise bad_request("prompt: give at least one prompt", "prompt")
        return out

    def _engine_requests(self, req: CompletionRequest, prompts) -> tuple[list[EngineRequest], list[_Choice]]:
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens: must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
        if len(prompts) * req.n > MAX_CHOICES:
            raise bad_request(f"{len(prompts)} prompts x n={req.n} is over {MAX_CHOICES} choices", "n")
        prompt_lp = req.logprobs if req.echo and req.logprobs is not None else None
        eos = self.ctx.tokenizer.eos_id
        # the ids whose logprob entry is dropped when they end the output (kept with their text under
        # include_stop_str_in_output)
        stop_ids = set() if req.include_stop_str_in_output else \
            set(req.stop_token_ids or []) | (set() if req.ignore_eos else {eos})
        reqs, choices = [], []
        seed = self.ctx.request_seed(req.seed)
        structured = structured_outputs(req)
        for p, (text, ids) in enumerate(prompts):
            for k in range(req.n):
                params = sampling_params(req, max(max_tokens, 1), logprobs=req.logprobs, prompt_logprobs=prompt_lp,
                                         choice=k, seed=seed, structured=structured)
                check_request(self.ctx, ids, params, f"prompt[{p}]" if len(prompts) > 1 else "prompt")
                reqs.append(EngineRequest(ids, params, skip_special_tokens=req.skip_special_tokens,
                                          cache_salt=req.cache_salt))
                choices.append(_Choice(len(choices), text, ids, req.echo, max_tokens > 0, stop_ids))
        return reqs, choices

    def _prepare(self, req: CompletionRequest):
        """The prompts' ids and the engine requests (on a worker thread: :meth:`ServingContext.prepare`)."""
        try:
            prompts = self._prompts(req.prompt)
        except RequestError as e:
            raise bad_request(f"prompt: {e}", "prompt") from None
        if req.truncate_prompt_tokens is not None:
            tok = self.ctx.tokenizer
            cut = [truncate_prompt(self.ctx, req, ids) for _, ids in prompts]
            prompts = [(text if len(c) == len(ids) else tok.decode(c), c) for (text, ids), c in zip(prompts, cut)]
        return (prompts, *self._engine_requests(req, prompts))

    async def create(self, req: CompletionRequest, raw: Request):
        started = time.monotonic()
        model = self.ctx.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (give n instead)", "best_of")
        prompts, reqs, choices = await self.ctx.prepare(self._prepare, req)
        rid = f"cmpl-{uuid.uuid4().hex}"
        sub = self.ctx.engine.submit(rid, reqs)
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        if self.ctx.metrics is not None:
            self.ctx.metrics.admitted(sum(len(r.prompt_ids) for r in reqs))
        head = {"id": rid, "created": int(time.time()), "model": model}
        if req.stream:
            body = self._stream(sub, choices, head, stream_usage(req), req.logprobs, prompt_tokens, started, req.n)
            return StreamingResponse(aclosing_iter(body, sub.abort), media_type="text/event-stream")
        result = await until_done_or_disconnect(raw, self._collect(sub, choices), sub.abort)
        if result is None:
            log_request("completion", rid, "client gone", sub, prompt_tokens, started)
            return None
        error = next((c for c in choices if c.finish_reason == "error"), None)
        log_request("completion", rid, 500 if error else 200, sub, prompt_tokens, started,
                    [c.finish_reason for c in choices], result if error else "")
        if error is not None:
            raise APIError(500, f"the request failed in the engine: {result}", code="engine_error", logged=True)
        usage = _usage(prompt_tokens, choices, sub.cached(req.n))
        return {**head, "object": "text_completion", "system_fingerprint": None, "usage": usage,
                "choices": [{"index": c.index, "text": "".join(c.text), "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason,
                             "logprobs": self._logprobs(c, c.entries) if req.logprobs is not None else None}
                            for c in choices]}

    # ------------------------------------------------------------------ engine -> choices
    def _take(self, c: _Choice, d: Delta) -> tuple[str, list]:
        """Fold one delta into its choice; returns the new text and logprob entries."""
        text, entries = "", []
        if not c.started:
            c.started = True
            if c.echo:
                text = c.prompt_text
                if d.prompt_logprobs is not None:
                    entries += list(zip(c.prompt_ids, d.prompt_logprobs, d.prompt_top_logprobs))
        if c.keep_output:
            c.tokens += len(d.token_ids)
            text += d.text
            if d.logprobs is not None:
                new = list(zip(d.token_ids, d.logprobs, d.top_logprobs))
                if d.finish_reason == "stop" and new and new[-1][0] in c.stop_ids:
                    new = new[:-1]          # the stop token's text is not in the output
                entries += new
        if d.finished:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        c.text.append(text)
        return text, entries

    async def _collect(self, sub: Submission, choices: list[_Choice]) -> str:
        error = ""
        async for i, d in sub:
            c = choices[i]
            _, entries = self._take(c, d)
            c.entries += entries
            if d.error:
                error = d.error
                sub.abort()
        return error

    async def _stream(self, sub: Submission, choices: list[_Choice], head: dict, usages: tuple[bool, bool], logprobs,
                      prompt_tokens: int, started: float, per_prompt: int = 1):
        status = "200"
        usage, continuous = usages
        try:
            async for i, d in sub:
                c = choices[i]
                if d.error:
                    status = "500"
                    sub.abort()
                    yield sse({"error": {"message": f"the request failed in the engine: {d.error}",
                                         "type": "server_error", "param": None, "code": "engine_error"}})
                    break
                text, entries = self._take(c, d)
                if not text and not entries and not d.finished:
                    continue
                choice = {"index": c.index, "text": text, "finish_reason": c.finish_reason if d.finished else None,
                          "stop_reason": c.stop_reason if d.finished else None,
                          "logprobs": self._logprobs(c, entries) if logprobs is not None else None}
                extra = {}
                if usage:   # null in every chunk but the last, or the usage so far (continuous_usage_stats)
                    extra["usage"] = _usage(prompt_tokens, choices, sub.cached(per_prompt)) if continuous else None
                yield sse({**head, "object": "text_completion", "choices": [choice], **extra})
            if usage and status == "200":
                yield sse({**head, "object": "text_completion", "choices": [], "usage": _usage(prompt_tokens, choices,
                                                                                         sub.cached(per_prompt))})
            yield sse("[DONE]")
        finally:
            if not sub.done and status == "200":
                status = "client gone"
            log_request("completion", head["id"], status, sub, prompt_tokens, started,
                        [c.finish_reason for c in choices])

    def _logprobs(self, c: _Choice, entries: list) -> dict:
        out = CompletionLogprobs()
        for token, lp, top in entries:
            s = self.ctx.token_str(token)
            out.tokens.append(s)
            out.token_logprobs.append(lp)
            if lp is None:
                out.top_logprobs.append(None)
            else:
                alts = {self.ctx.token_str(t): v for t, v in top}
                alts.setdefault(s, lp)
                out.top_logprobs.append(alts)
            out.text_offset.append(c.offset)
            c.offset += len(s)
        return out.model_dump()


def _usage(prompt_tokens: int, choices: list[_Choice], cached: int) -> dict:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}
