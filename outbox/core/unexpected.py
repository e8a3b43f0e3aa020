"""The last answer: an exception no handler answers becomes a problem document, not a traceback.

Without it, Starlette's outermost middleware answers such an exception with a plain-text 500
and re-raises it, so the server writes the whole traceback (kilobytes, with the request's
values in its frames' text) to the log. Here the answer is `500 internal_error` as
problem+json, and the log gets one line: the exception's type and where it was raised, and for
a failed statement its text, which the engines keep to the SQL and the database's primary
message (outbox/store/engines.py: no bound parameters, no quoted row), so the failing
constraint is named without the data. Every expected failure (bad input, an outage) has its
own handler and never gets this far.

A client that hangs up before its body is read is no defect of the gateway: it is logged at
info (`request.client_gone`) and answered nothing (there is no one to answer), so the trace's
server span gets no 500 and no client can fill the error log by hanging up.
"""

from __future__ import annotations

import traceback

from sqlalchemy.exc import StatementError
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from outbox.core.logs import get_logger
from outbox.core.problems import Problem, TrackedSend, problem_response

log = get_logger(__name__)


def unexpected(error: BaseException) -> Problem | None:
    """Log `error` in one line and return the 500 to answer it with; None for a client that
    hung up (logged at info: nothing to answer)."""
    if isinstance(error, ClientDisconnect):
        log.info("request.client_gone")
        return None
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
    fields = {"error": type(error).__name__, "at": where}
    if isinstance(error, StatementError):
        fields["detail"] = str(error)
    log.error("request.failed", **fields)
    return Problem(
        500, "internal_error", "The request failed unexpectedly; it was logged. Retry later."
    )


class UnexpectedErrors:
    """ASGI middleware, innermost to Starlette's own error middleware: answers what escapes
    the app's exception handlers (module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tracked = TrackedSend(send)
        try:
            await self.app(scope, receive, tracked)
        except Exception as error:
            problem = unexpected(error)
            # Once the answer has begun, the server can only cut the connection.
            if problem is not None and not tracked.started:
                await problem_response(problem)(scope, receive, send)
