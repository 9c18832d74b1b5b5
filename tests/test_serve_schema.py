"""schemathesis against the server's own OpenAPI schema: generated requests, valid and invalid,
to every route. No 5xx; every error is OpenAI's error body; responses match the documented status
codes, content types and schemas. Generation lengths are capped so the tiny model answers fast."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")   # a test dependency (scripts/install.sh test)

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

MAX_NEW = 3


@schemathesis.check
def openai_error_shape(ctx, response, case):
    """Every 4xx/5xx body is {"error": {"message", "type", "param", "code"}} with a message (Anthropic's
    {"type": "error", "error": {"type", "message"}} on its /v1/messages)."""
    if response.status_code >= 400 and case.path == "/v1/messages":
        body = response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    elif response.status_code >= 400:
        body = response.json()
        err = body.get("error") if isinstance(body, dict) else None
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), body
    return None


def _tame(body) -> None:
    """Keep generated work small: a few new tokens, few choices, few prompts (invalid values stay)."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and not isinstance(body.get(key), bool) and body[key] > MAX_NEW:
            body[key] = MAX_NEW
    if "messages" in body and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_NEW
    if isinstance(body.get("n"), int) and not isinstance(body.get("n"), bool) and body["n"] > 2:
        body["n"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) > 3 and not all(isinstance(t, int) for t in prompt):
        body["prompt"] = prompt[:3]


VALID = {
    "/v1/completions": [{"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2, "logprobs": 2, "echo": True}],
    "/v1/chat/completions": [{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "logprobs": True, "top_logprobs": 1, "n": 2,
                              "chat_template_kwargs": {"thinking": True}}],
}
CHECKS = [not_a_server_error, openai_error_shape, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def test_openapi(served):
    # schemathesis' pytest plugin does not load under this pytest, so each operation runs under
    # hypothesis here (derandomized: CI sees the same cases every run)
    schema = schemathesis.openapi.from_url(served.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/health"}
    seen: dict[tuple[str, int], int] = {}
    for op in operations:
        @given(case=op.as_strategy(generation_mode=GenerationMode.POSITIVE) |
               op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
        @settings(max_examples=25, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        def run(case):
            _tame(case.body)
            response = case.call_and_validate(checks=CHECKS, timeout=120)
            key = (op.path, response.status_code)
            seen[key] = seen.get(key, 0) + 1

        run()
        if op.path in VALID:   # and known-valid requests, streamed and not, against the same checks
            for body in VALID[op.path]:
                for stream in (False, True):
                    response = op.Case(body={**body, "stream": stream}).call_and_validate(checks=CHECKS, timeout=120)
                    assert response.status_code == 200
    print(sorted(seen.items()))
    for path in VALID:
        assert sum(n for (p, code), n in seen.items() if p == path and code == 400) > 5
