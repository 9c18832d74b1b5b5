"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status,
and the same errors in Anthropic's shape for ``/v1/messages``: ``{"type": "error", "error": {"type",
"message"}}``.

Handlers raise :class:`APIError` (or let a project error through: a ``RequestError`` or a chat
``ChatFormatError`` is a 400 naming the field); the app turns it into the JSON body. Streams that
fail after their headers went out send the same body as an SSE ``data:`` event.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
          422: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}


# Anthropic's error types by status (docs.anthropic.com, "Errors"); an unavailable server is its
# "overloaded_error" (Anthropic answers that with 529; the status here stays the server's 503)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


class APIError(Exception):
    """An error response: HTTP ``status``, a message naming what is wrong, and the request
    parameter (``param``) when one is at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, logged: bool = False):
        super().__init__(message)
        self.logged = logged          # the request's log line already says it
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        kind = _ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, headers: dict | None = None, anthropic: bool = False) -> JSONResponse:
        """The JSON response; in Anthropic's shape when ``anthropic`` (the ``/v1/messages`` route)."""
        return JSONResponse(self.anthropic_body() if anthropic else self.body(), status_code=self.status,
                            headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One readable line from pydantic's errors, and the first field at fault (``messages[0].role``)."""
    parts, first = [], None
    for err in errors[:3]:
        if err.get("type") == "json_invalid":
            where = err.get("loc", ("body", "?"))[-1]
            why = (err.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"the body is not valid JSON ({why} at character {where})")
            continue
        loc = [p for p in err.get("loc", ()) if p != "body"]
        # union members add their type name to the location: keep only the field path
        path = "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p))
                       for i, p in enumerate(loc) if not _is_type_tag(p))
        first = first or path or None
        parts.append(f"{path or 'body'}: {err.get('msg', 'invalid')}")
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "; ".join(parts) + more, first


def _is_type_tag(p) -> bool:
    return isinstance(p, str) and (p in ("str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]",
                                         "dict[str,any]", "function-after", "json-or-python")
                                   or p.startswith(("list[", "dict[", "literal[", "function-")))
