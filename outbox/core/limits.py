"""Request size limits for every endpoint: one body limit (MAX_BODY_BYTES) and one header limit.

A body is refused with 413 as soon as it is known to be too large: at once when Content-Length
says so, otherwise (a chunked upload) on the first chunk past the limit, so no endpoint ever
holds more than the limit in memory. Headers larger than MAX_HEADER_BYTES in total get 431
before any endpoint looks at them; a header block that passes twice that before it ends is
answered 431 by the server itself, as it arrives (`connections.BoundedHttpToolsProtocol`), so
the parser holds at most that plus one read of the socket.

`RequestLimits` applies both to every request that goes through the framework; the events
path, which is taken ahead of it (`fastpath.Receiver`), checks the headers with
`headers_too_large` and reads its body with `fastpath.read_body`, under the same limit.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.core.problems import Problem, TrackedSend, problem_response

# All header names and values of one request together: the size of h11's limit, room for
# any real client's cookies and signatures, and far below what would cost memory.
MAX_HEADER_BYTES = 16 * 1024


def too_large(limit: int) -> Problem:
    """The 413 answer for a body over `limit` bytes."""
    return Problem(413, "payload_too_large", f"The body exceeds {limit} bytes.", limit=limit)


def headers_too_large(scope: Scope) -> Problem | None:
    """The 431 answer when the request's headers exceed MAX_HEADER_BYTES, else None."""
    size = 0
    for name, value in scope["headers"]:
        size += len(name) + len(value)
    if size <= MAX_HEADER_BYTES:
        return None
    return Problem(
        431,
        "headers_too_large",
        f"The request's headers exceed {MAX_HEADER_BYTES} bytes.",
        limit=MAX_HEADER_BYTES,
    )


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive` when a streamed body passes the limit.

    An HTTPException, so FastAPI's body parsing lets it through (it turns other errors into
    400) and the app's handler answers it with `too_large`."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"The body exceeds {limit} bytes.")
        self.limit = limit


def declared_length(scope: Scope) -> int | None:
    """The Content-Length header as a number, or None when absent or not plain digits."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() and len(text) < 20 else None
    return None


class RequestLimits:
    """ASGI middleware: the header limit and the body limit for every request it sees."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.limit = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = headers_too_large(scope)
        declared = declared_length(scope)
        if refused is None and declared is not None and declared > self.limit:
            refused = too_large(self.limit)
        if refused is not None:
            await problem_response(refused)(scope, receive, send)
            return

        limit = self.limit
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        tracked = TrackedSend(send)
        try:
            await self.app(scope, bounded_receive, tracked)
        except BodyTooLarge:
            # Normally the app's handler has answered already; this covers a reader outside
            # the framework's exception handling.
            if tracked.started:
                raise
            await problem_response(too_large(limit))(scope, receive, send)
