"""Error answers as RFC 9457 problem details, each with a machine-readable `error` code.

Codes are stable API: callers (n8n IF nodes, scripts) branch on them. Status codes follow the
IETF Idempotency-Key header draft: 400 for a bad key, 422 for a key reused with another payload,
409 for a request still in flight.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import Message, Send

PROBLEM_JSON = "application/problem+json"

TITLES: dict[str, str] = {
    "invalid_json": "The body is not JSON",
    "invalid_unicode": "A string in the body is not Unicode text",
    "invalid_envelope": "The event envelope is malformed",
    "invalid_idempotency_key": "The Idempotency-Key header is not a valid key",
    "idempotency_key_reused": "This key was used with a different payload",
    "no_route": "No route accepts this event type",
    "payload_too_large": "The body is larger than the configured limit",
    "key_not_found": "No event is stored under this key",
    "database_unavailable": "The database is unreachable; nothing was stored",
    "not_found": "No such resource",
    "method_not_allowed": "Method not allowed",
    "invalid_request": "The request is malformed",
    "missing_signature": "The request is not signed; nothing was stored",
    "invalid_signature": "The signature does not match; nothing was stored",
    "stale_signature": "The signed timestamp is too far from now; nothing was stored",
    "unknown_source": "The source has no signing secret; nothing was stored",
    "unsigned_idempotency_key": "The signature does not cover the Idempotency-Key",
    "source_not_allowed": "This source may not send events of this type",
    "missing_event_id": "No event id where the source says it is",
    "missing_event_type": "No event type where the source says it is",
    "invalid_event_type": "The event type is not printable text",
    "headers_too_large": "The request's headers are larger than the limit",
    "headers_timeout": "The request's headers did not arrive in time",
    "server_busy": "The receiver is serving all the connections it takes at once",
    "unauthorized": "A valid bearer token is required",
    "too_many_failures": "Too many failed credentials from this address",
    "metrics_forbidden": "Metrics are for loopback clients or the metrics token",
    "internal_error": "The request failed unexpectedly",
}


class Problem(Exception):
    """Raised anywhere in a request to answer with a problem document."""

    def __init__(
        self,
        status: int,
        error: str,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra


def problem_response(problem: Problem) -> JSONResponse:
    """Render a Problem as `application/problem+json`."""
    body: dict[str, Any] = {
        "type": f"urn:idem:error:{problem.error}",
        "title": TITLES.get(problem.error, problem.error.replace("_", " ")),
        "status": problem.status,
        "detail": problem.detail,
        "error": problem.error,
        **problem.extra,
    }
    return JSONResponse(
        body, status_code=problem.status, headers=problem.headers, media_type=PROBLEM_JSON
    )


PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["type", "title", "status", "detail", "error"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "detail": {"type": "string"},
        "error": {"type": "string", "description": "machine-readable error code"},
    },
}

_DESCRIPTIONS = {
    400: "Bad request (not JSON, a string that is not Unicode, an invalid or unsigned "
    "Idempotency-Key, no event id or type)",
    401: "Missing or invalid credentials or signature; nothing was stored",
    403: "Forbidden (the source may not send events of this type); nothing was stored",
    404: "Not found",
    409: "Conflict with the resource's current state",
    413: "Body too large (MAX_BODY_BYTES)",
    422: "Invalid input, or a key reused with another payload; nothing changed",
    429: "Too many failed credentials from this address; retry after Retry-After",
    431: "Request headers too large",
    503: "A dependency is unavailable (or the feature is disabled); retry after Retry-After",
}


def problem_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries for error answers rendered as problem documents."""
    return {
        code: {
            "description": _DESCRIPTIONS.get(code, "Error"),
            "content": {PROBLEM_JSON: {"schema": PROBLEM_SCHEMA}},
        }
        for code in codes
    }


def json_response(description: str) -> dict[str, Any]:
    """An OpenAPI `responses` entry for a plain JSON answer."""
    return {"description": description, "content": {"application/json": {"schema": {}}}}


def field_errors(error: ValidationError | RequestValidationError) -> list[dict[str, str]]:
    """Field-level detail without echoing the caller's values (they may hold personal data)."""
    return [
        {
            "field": ".".join(str(part) for part in err["loc"]) or "(body)",
            "message": err["msg"],
            "type": err["type"],
        }
        for err in error.errors()
    ]


class TrackedSend:
    """An ASGI `send` that remembers whether the response has begun: until then a middleware
    may still answer with a problem; after it, only the connection can be cut."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)
