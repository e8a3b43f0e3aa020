"""`http`: send the payload to a URL with the key in `Idempotency-Key`.

2xx is success; the external reference is read from the JSON answer by the route's pointer.
Any other answer or transport error becomes an ActionError or is left to the classifier.

On a route with `signing_secret` every request (the action's and the reconcile lookup's) is
signed as Standard Webhooks ask (`outbox.core.standard_webhooks`): `webhook-id` is the key, the
same on every attempt, so the downstream can deduplicate by it; `webhook-timestamp` is the send
time, new on every attempt; `webhook-signature` covers exactly the bytes sent, since the
request is built first and its built body is what is signed. The trace's `traceparent`
(tracing on) is added after signing, as a header the signature does not cover.

An answer is streamed and read up to the route's `max_response_bytes` (1 MiB by default: a
CRM's answer is a few KiB), then the connection is cut, so a hostile or broken downstream
sending 300 MB costs a worker at most that much per attempt in flight. A 2xx cut short is a
success: the request acted, and acting again would make a second effect; its body is dropped
(no result stored, no external reference read) and the result says why
(`"body_dropped": "response_too_large"`). Any other status cut short is judged by its status,
as a short answer with that status would be.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import httpx

from outbox.core import standard_webhooks, tracing
from outbox.core.actions import ActionSettings
from outbox.core.jsonbody import resolve_pointer
from worker.actions import ActionContext, ActionResult
from worker.actions.transport import KeepAlive
from worker.errors import ActionError, RequestInvalid, TransientError, error_for_response

# A stored result is returned to every later duplicate; large bodies are not worth keeping.
MAX_STORED_BODY_BYTES = 65_536

# What httpx's client sent on every request, sent still (a route's own headers win).
DEFAULT_HEADERS = {
    "Accept": "*/*",
    "Accept-Encoding": "gzip, deflate",
    "Connection": "keep-alive",
    "User-Agent": f"python-httpx/{httpx.__version__}",
}

_transport: tuple[int, httpx.BaseTransport] | None = None
_transport_lock = threading.Lock()


def transport() -> httpx.BaseTransport:
    """The process's connections (`worker.actions.transport`), shared by its threads, wrapped
    in the client span when tracing is on. Made anew in a forked child: connections must not
    be shared between processes."""
    global _transport
    made = _transport
    if made is None or made[0] != os.getpid():
        with _transport_lock:  # threads asking at once share one
            made = _transport
            if made is None or made[0] != os.getpid():
                made = _transport = (os.getpid(), tracing.traced_transport(KeepAlive()))
    return made[1]


def _forget_after_fork() -> None:
    """A forked child starts with a lock no thread of the parent may hold."""
    global _transport_lock
    _transport_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def run(route: ActionSettings, ctx: ActionContext) -> ActionResult:
    assert route.url is not None  # the routes file was validated
    request = _build(
        route.method,
        lambda: httpx.Request(
            route.method,
            route.url or "",
            json=ctx.payload,
            headers=_headers(route, ctx),
            extensions={"timeout": _timeout(route)},
        ),
    )
    tracing.set_resend_count(ctx.attempt - 1)
    response = _send(ctx, _signed(route, ctx, request), route.max_response_bytes)
    error = _error(route, response)
    if error is not None:
        raise error
    body = _json_body(response)
    external_ref = None
    if route.external_ref_pointer is not None and body is not None:
        found = resolve_pointer(body, route.external_ref_pointer)
        external_ref = None if found is None else str(found)
    return ActionResult(
        result=_result(route, response, body),
        external_ref=external_ref,
    )


def reconcile(route: ActionSettings, ctx: ActionContext) -> ActionResult | None:
    """Ask the downstream whether the effect exists: 200 found, 404 not found.

    Any other answer is an error like any other (a 503 here is transient, and the attempt is
    retried later rather than risking a second effect now).
    """
    assert route.reconcile_url is not None
    url = route.reconcile_url.format(
        key=quote(ctx.key, safe=""), external_id=quote(ctx.external_id, safe="")
    )
    request = _build(
        "GET",
        lambda: httpx.Request(
            "GET", url, headers=_headers(route, ctx), extensions={"timeout": _timeout(route)}
        ),
    )
    response = _send(ctx, _signed(route, ctx, request), route.max_response_bytes)
    if response.status_code == 404:
        return None
    error = _error(route, response)
    if error is not None:
        raise error
    body = _json_body(response)
    pointer = route.reconcile_external_ref_pointer or route.external_ref_pointer
    found = resolve_pointer(body, pointer) if pointer is not None and body is not None else None
    return ActionResult(
        result={**_result(route, response, body), "reconciled": True},
        external_ref=None if found is None else str(found),
    )


class CutResponse(httpx.Response):
    """An answer whose body was cut at the route's `max_response_bytes`: its status and
    headers as sent, the bytes read so far as its content."""

    too_large = True


def _send(ctx: ActionContext, request: httpx.Request, max_bytes: int) -> httpx.Response:
    """Send, unless the lease stopped being ours: the last look before a request leaves, for
    the action and the lookup alike (a lookup made after another worker took the key could
    answer "not found" for an effect that worker is making). The answer's body is read up to
    `max_bytes` (decoded: one read of a compressed answer may expand past it once), then the
    connection is closed; a longer one comes back as a CutResponse."""
    if not ctx.lease_held():
        raise TransientError("lease_lost", "the lease was lost before the request was sent")
    response = transport().handle_request(request)
    content = bytearray()
    try:
        for chunk in response.iter_bytes():
            content += chunk
            if len(content) > max_bytes:
                # Held no longer than this frame; a connection cut short is reset.
                return CutResponse(
                    response.status_code,
                    headers=_plain(response.headers),
                    content=bytes(content[:max_bytes]),
                    request=request,
                )
    finally:
        response.close()
    return httpx.Response(
        response.status_code,
        headers=_plain(response.headers),
        content=bytes(content),
        request=request,
    )


def _plain(headers: httpx.Headers) -> httpx.Headers:
    """The answer's headers for its decoded content: no encoding or length of the wire's."""
    kept = httpx.Headers(headers)
    for name in ("content-encoding", "content-length", "transfer-encoding"):
        kept.pop(name, None)
    return kept


def _result(route: ActionSettings, response: httpx.Response, body: Any) -> dict[str, Any]:
    """What is stored of a successful answer: its status and, when small enough, its body."""
    if isinstance(response, CutResponse):
        return {
            "status_code": response.status_code,
            "body": None,
            "body_dropped": "response_too_large",
            "max_response_bytes": route.max_response_bytes,
        }
    return {"status_code": response.status_code, "body": _storable(response, body)}


def _headers(route: ActionSettings, ctx: ActionContext) -> dict[str, str]:
    """A plain dict: httpx encodes its values as ASCII when it builds the request, so a value
    that is not ASCII fails there (`_build`), before anything is sent."""
    own = {**route.headers, "Idempotency-Key": ctx.key, "X-Correlation-ID": ctx.correlation_id}
    named = {name.lower() for name in own}
    defaults = {name: v for name, v in DEFAULT_HEADERS.items() if name.lower() not in named}
    return {**defaults, **own}


def _signed(
    route: ActionSettings, ctx: ActionContext, request: httpx.Request, now: float | None = None
) -> httpx.Request:
    """The built request with the route's Standard Webhooks headers over its exact body."""
    keys = route.signing_keys
    if not keys:
        return request
    timestamp = int(time.time() if now is None else now)
    request.headers["webhook-id"] = ctx.key
    request.headers["webhook-timestamp"] = str(timestamp)
    request.headers["webhook-signature"] = standard_webhooks.signature_header(
        keys, ctx.key, timestamp, request.content
    )
    return request


def _error(route: ActionSettings, response: httpx.Response) -> ActionError | None:
    return error_for_response(
        response, kind=route.kind, n8n_grace_seconds=route.n8n_unregistered_grace_seconds
    )


def _timeout(route: ActionSettings) -> dict[str, float | None]:
    """httpx's timeouts as a transport reads them (writing and a pool wait: the read's)."""
    return httpx.Timeout(
        route.read_timeout_seconds, connect=route.connect_timeout_seconds
    ).as_dict()


def _build(method: str, build: Callable[[], httpx.Request]) -> httpx.Request:
    """Build the request on our side first: what cannot be built (a header value that is not
    ASCII, a body that is not JSON, a URL that does not parse) is the key's own permanent
    failure, raised before anything is sent, and never counted against the route."""
    try:
        request = build()
    except (UnicodeError, ValueError, TypeError, httpx.InvalidURL) as error:
        raise RequestInvalid(
            f"the {method} request for this event could not be built: {type(error).__name__}"
        ) from error
    for name, value in request.headers.raw:
        if any(byte in value for byte in b"\r\n\0"):
            # h11 would refuse it only after connecting; refuse it before.
            header = name.decode("ascii", "replace")
            raise RequestInvalid(f"the {method} request's {header} header holds a line break")
    return request


def _storable(response: httpx.Response, body: Any) -> Any:
    return body if len(response.content) <= MAX_STORED_BODY_BYTES else None


def _json_body(response: httpx.Response) -> Any:
    if not response.content or isinstance(response, CutResponse):
        return None
    try:
        return json.loads(response.content)
    except ValueError:
        return None
