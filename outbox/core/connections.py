"""The receiver's HTTP connections, bounded before the app sees them.

uvicorn's httptools parser keeps a request's line and headers in memory until the header block
ends, however long that takes and however large it grows, and uvicorn waits for that end
without a deadline: one connection sending a header value that never ends, or many sending a
line now and then, cost memory and connections without ever reaching the app, where
`limits.RequestLimits` would have answered 431. `BoundedHttpToolsProtocol` (the same parser,
uvicorn's own protocol underneath) enforces three bounds as bytes arrive:

- **size**: a request whose line and headers pass MAX_HEAD_BYTES before they end is answered
  431 `headers_too_large` and the connection closed, so a connection holds at most that plus
  one read of the socket;
- **time**: a request's headers must be complete within HEADER_READ_TIMEOUT_SECONDS of its
  first byte (of the connection's opening, for its first request, so a connection that sends
  nothing is bounded too); past it the connection is answered 408 `headers_timeout` and closed;
- **body**: a request must have sent its whole body within REQUEST_TIMEOUT_SECONDS of its
  first byte, and while it sends it, at least MIN_BODY_RATE_BYTES a second over each
  BODY_RATE_WINDOW_SECONDS (the first window is its grace); past either the connection is
  answered 408 (`request_timeout`, `body_too_slow`) and closed, so a body sent a byte every
  five seconds holds its connection a window, not for ever (the app, waiting on that body,
  sees the client gone);
- **count**: a request on a connection beyond MAX_CONNECTIONS open ones is answered 503
  `server_busy` with Retry-After and its connection closed (uvicorn's `limit_concurrency`,
  answered as a problem document).

Idle keep-alive connections are closed after KEEP_ALIVE_SECONDS (uvicorn's own timer).
Limits per client (connections per address, request rates) belong to the proxy in front.

`server_options` gives `idem serve` (and the benchmark's ceiling, so it stays a like-for-like
comparison) the uvicorn options carrying these bounds and the trusted proxies, refusing to
trust every address.
"""

from __future__ import annotations

import asyncio
import http
import ipaddress
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

from starlette.types import Receive, Scope, Send
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from outbox.core.limits import MAX_HEADER_BYTES
from outbox.core.problems import Problem, problem_response
from outbox.core.settings import Settings

# A request's line and header block together, as sent: twice the app's header limit, so a
# long URL and the framing never trip it before the app's own, exact 431; far below what
# costs memory.
MAX_HEAD_BYTES = 2 * MAX_HEADER_BYTES
# Told to a client refused for the connection cap: by then most connections have turned over.
BUSY_RETRY_AFTER_SECONDS = 1


class ProxyTrustError(ValueError):
    """FORWARDED_ALLOW_IPS trusts every address."""


def trusted_proxies(settings: Settings) -> str:
    """FORWARDED_ALLOW_IPS, refused when it trusts every address (`*`, or networks that
    together hold every IPv4 or every IPv6 address: `0.0.0.0/0`, `::/0`, `0/0`, two halves):
    then any client can write `X-Forwarded-For: 127.0.0.1` and be served as this machine
    (loopback-only endpoints, its own throttle count)."""
    value = settings.forwarded_allow_ips
    if trusts_everyone(value):
        raise ProxyTrustError(
            f"FORWARDED_ALLOW_IPS={value!r} trusts every address, so any client could claim "
            "to be 127.0.0.1; set it to the addresses of the proxies in front of the receiver "
            "(e.g. FORWARDED_ALLOW_IPS=10.0.0.5 or 172.18.0.0/16)"
        )
    return value


def trusts_everyone(value: str) -> bool:
    """Whether the comma-separated addresses and networks of FORWARDED_ALLOW_IPS hold every
    IPv4 or every IPv6 address (a prefix length of 0 in any spelling counts as all)."""
    v4: list[ipaddress.IPv4Network] = []
    v6: list[ipaddress.IPv6Network] = []
    for entry in filter(None, (part.strip() for part in value.split(","))):
        prefix = entry.partition("/")[2].strip()
        if "*" in entry or (prefix.isdigit() and int(prefix) == 0):
            return True
        try:
            network = ipaddress.ip_network(entry, strict=False)
        except ValueError:
            continue  # a host name or a socket path: uvicorn matches it literally
        if isinstance(network, ipaddress.IPv4Network):
            v4.append(network)
        else:
            v6.append(network)
    every_v4, every_v6 = ipaddress.IPv4Network("0.0.0.0/0"), ipaddress.IPv6Network("::/0")
    return list(ipaddress.collapse_addresses(v4)) == [every_v4] or list(
        ipaddress.collapse_addresses(v6)
    ) == [every_v6]


def server_options(settings: Settings) -> dict[str, Any]:
    """The uvicorn options that bound connections and name the trusted proxies (raises
    ProxyTrustError when they would trust every address)."""
    protocol = partial(
        BoundedHttpToolsProtocol,
        max_head_bytes=MAX_HEAD_BYTES,
        header_read_timeout=settings.header_read_timeout_seconds,
        max_connections=settings.max_connections,
        body=BodyBounds(
            settings.request_timeout_seconds,
            settings.min_body_rate_bytes,
            settings.body_rate_window_seconds,
        ),
    )
    return {
        # uvicorn calls the class with its own arguments; a partial adds ours and pickles
        # (for workers > 1) like the class itself.
        "http": cast(type[asyncio.Protocol], protocol),
        "timeout_keep_alive": settings.keep_alive_seconds,
        "forwarded_allow_ips": trusted_proxies(settings),
    }


def _raw_problem(problem: Problem) -> bytes:
    """A problem document as a whole HTTP/1.1 response that closes its connection."""
    response = problem_response(problem)
    head = [f"HTTP/1.1 {problem.status} {http.HTTPStatus(problem.status).phrase}".encode()]
    head += [name + b": " + value for name, value in response.raw_headers]
    head += [b"connection: close", b"", b""]
    return b"\r\n".join(head) + bytes(response.body)


HEADERS_TOO_LARGE = _raw_problem(
    Problem(
        431,
        "headers_too_large",
        f"The request's line and headers exceed {MAX_HEAD_BYTES} bytes.",
        limit=MAX_HEAD_BYTES,
    )
)
HEADERS_TIMEOUT = _raw_problem(
    Problem(408, "headers_timeout", "The request's headers did not arrive in time.")
)
REQUEST_TIMEOUT = _raw_problem(
    Problem(408, "request_timeout", "The request did not arrive whole in time.")
)
BODY_TOO_SLOW = _raw_problem(
    Problem(408, "body_too_slow", "The request's body arrived too slowly.")
)


@dataclass(frozen=True)
class BodyBounds:
    """How long a whole request may take, and how slowly its body may come (the settings
    REQUEST_TIMEOUT_SECONDS, MIN_BODY_RATE_BYTES, BODY_RATE_WINDOW_SECONDS)."""

    request_timeout: float
    min_rate: int
    window: float


async def server_busy(scope: Scope, receive: Receive, send: Send) -> None:
    """The answer to a request beyond the connection cap."""
    await problem_response(
        Problem(
            503,
            "server_busy",
            "The receiver has all the connections it serves at once; try again shortly.",
            headers={"Retry-After": str(BUSY_RETRY_AFTER_SECONDS), "Connection": "close"},
        )
    )(scope, receive, send)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a size and a time bound on each request's head and a
    cap on the connections served at once (see the module's docstring)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        max_head_bytes: int,
        header_read_timeout: float,
        max_connections: int,
        body: BodyBounds,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.max_head_bytes = max_head_bytes
        self.header_read_timeout = header_read_timeout
        self.max_connections = max_connections
        self.body = body
        # Between the end of a request's headers and the end of its body: the whole-request
        # deadline and the rate check, and the body bytes of the current window.
        self._body_timers: list[asyncio.TimerHandle] = []
        self._window_bytes = 0
        self._request_began = 0.0
        self._served_app = self.app
        # Between a request's first byte and the end of its headers; bytes counted meanwhile.
        self._reading_head = False
        self._head_bytes = 0
        # Between a request's first byte and the end of its body.
        self._in_request = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_body_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        # A read that arrives while a body is being received may end that body and start the
        # next request's head: it is not counted, so the bound is MAX_HEAD_BYTES plus one read.
        counted = self._reading_head or not self._in_request
        super().data_received(data)
        if counted and self._reading_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(HEADERS_TOO_LARGE)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._request_began = self.loop.time()
        self._in_request = True
        self._reading_head = True
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._disarm_head_timer()
        # uvicorn starts the request with `self.app`; beyond the cap, with the 503 instead.
        busy = len(self.connections) > self.max_connections
        self.app = server_busy if busy else self._served_app
        super().on_headers_complete()
        if self._in_request and not self.transport.is_closing():
            left = self._request_began + self.body.request_timeout - self.loop.time()
            self._window_bytes = 0
            self._body_timers = [
                self.loop.call_later(max(left, 0), self._refuse_body, REQUEST_TIMEOUT),
                self.loop.call_later(self.body.window, self._check_rate),
            ]

    def on_body(self, body: bytes) -> None:
        self._window_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_request = False
        self._disarm_body_timers()
        super().on_message_complete()

    def _check_rate(self) -> None:
        """Each window: the body must have grown by the minimum rate, or the request goes. A
        window in which the server itself stopped reading (the app has not taken what came,
        uvicorn's flow control) judges nothing."""
        slow = self._window_bytes < self.body.min_rate * self.body.window
        if slow and not self.flow.read_paused:
            self._refuse_body(BODY_TOO_SLOW)
            return
        self._window_bytes = 0
        self._body_timers[1:] = [self.loop.call_later(self.body.window, self._check_rate)]

    def _refuse_body(self, answer: bytes) -> None:
        """Answer 408 and close, or only close once the app has begun its own answer; the
        app, waiting on the body, then sees the client gone."""
        self._disarm_body_timers()
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(answer)
        self.transport.close()

    def _disarm_body_timers(self) -> None:
        for timer in self._body_timers:
            timer.cancel()
        self._body_timers = []

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.header_read_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._reading_head:
            self._refuse(HEADERS_TIMEOUT)
        elif not self._in_request:
            # Opened and never used: nothing to answer.
            self.transport.close()

    def _refuse(self, answer: bytes) -> None:
        self._reading_head = False
        self._disarm_head_timer()
        self.transport.write(answer)
        self.transport.close()
