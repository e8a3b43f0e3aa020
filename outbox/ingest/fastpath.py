"""The receiver's app class, which takes `POST /v1/events` and `POST /v1/webhooks/{source}`
ahead of the framework's request stack, and reading such a request's body within its limit."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from outbox.core.limits import headers_too_large, too_large
from outbox.core.problems import problem_response
from outbox.core.unexpected import unexpected

EVENTS_PATH = "/v1/events"
WEBHOOKS_PREFIX = "/v1/webhooks/"


class Receiver(FastAPI):
    """The receiver's app, with `POST /v1/events` dispatched ahead of the framework.

    Every event takes that one path. Sent through the middleware stack, the router and
    FastAPI's request handling, it cost a third more than the handler's own work (instructions
    counted per request, database left out: docs/explanation/performance.md), and it needs none of
    them: the handler reads the raw request itself and answers with a ready response. So `__call__`
    hands such a request straight to the handler and maps its exceptions with this app's own
    exception handlers, exactly as the stack would. The route is declared as well, for the
    OpenAPI document and for any request this shortcut does not match. The one middleware,
    `limits.RequestLimits`, is applied here too: the header limit below, the body limit by
    `read_body`. Providers' webhooks (`POST /v1/webhooks/{source}`, one path segment) take the
    same shortcut.
    """

    ingest: Callable[[Request], Awaitable[Response]] | None = None
    ingest_webhook: Callable[[str, Request], Awaitable[Response]] | None = None

    def _shortcut(self, scope: Scope) -> Callable[[Request], Awaitable[Response]] | None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        path: str = scope["path"]
        if path == EVENTS_PATH:
            return self.ingest
        source = path.removeprefix(WEBHOOKS_PREFIX)
        if self.ingest_webhook is None or source == path or not source or "/" in source:
            return None
        return partial(self.ingest_webhook, source)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self._shortcut(scope)
        if handler is None:
            await super().__call__(scope, receive, send)
            return
        scope["app"] = self
        request = Request(scope, receive)
        try:
            refused = headers_too_large(scope)
            if refused is not None:
                raise refused
            response = await handler(request)
        except Exception as error:
            handler = self._exception_handler(error)
            # What no handler answers gets the framework path's last answer (a 500 problem
            # and one log line), not the server's plain text and traceback.
            if handler is None:
                problem = unexpected(error)
                if problem is None:
                    return  # the client hung up: no one to answer
                response = problem_response(problem)
            else:
                response = await handler(request, error)
        await response(scope, receive, send)

    def _exception_handler(self, error: Exception) -> Any:
        for kind in type(error).__mro__:
            if kind in self.exception_handlers:
                return self.exception_handlers[kind]
        return None


def event_route(path: str) -> str | None:
    """The route template of a path the shortcut takes (a trace's `http.route`), else None."""
    if path == EVENTS_PATH:
        return EVENTS_PATH
    source = path.removeprefix(WEBHOOKS_PREFIX)
    if source != path and source and "/" not in source:
        return WEBHOOKS_PREFIX + "{source}"
    return None


async def read_body(request: Request, limit: int) -> bytes:
    """Read at most `limit` bytes; refuse early on a declared size, and on a streamed one."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
