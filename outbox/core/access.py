"""Who may call: the client's address, bearer tokens, and a throttle on wrong credentials.

A presented credential is compared first, in constant time, and a right one is always let
through: a throttle that refused the right token would let anyone who can reach the receiver
lock workflows and operators out with a few wrong guesses from behind the same proxy. Guessing
is bounded by the tokens' entropy instead (at least 32 characters, checked at start-up: far
beyond any online guessing, throttled or not).

The throttle bounds the noise and slows guessing per address: after AUTH_FAILURE_LIMIT wrong
bearer tokens or console sign-ins from one client address within AUTH_FAILURE_WINDOW_SECONDS,
that address's wrong credentials are answered 429 with Retry-After (clients that honour it
stop) until fewer than the limit remain in the window; every wrong one is counted, so an
address that keeps guessing stays limited. A missing credential is not counted. The count is
kept in the receiver process (each process counts its own, so N processes allow N times the
limit), for at most MAX_TRACKED_ADDRESSES addresses.

The client's address is the connection's, or the one a trusted proxy forwarded (uvicorn's
FORWARDED_ALLOW_IPS, named proxies only: outbox/core/connections.py), so a lockout is per
client behind the proxy, not per proxy; refusals are logged with it, never with the token.
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from fastapi import Request

from outbox.core.logs import get_logger
from outbox.core.problems import Problem

log = get_logger(__name__)

# Enough for every client a receiver meets in a window; the oldest are forgotten first.
MAX_TRACKED_ADDRESSES = 10_000


def client_address(request: Request) -> str:
    """The caller's IP address as uvicorn resolved it ("unknown" without a connection)."""
    return request.client.host if request.client else "unknown"


def is_loopback(address: str) -> bool:
    """Whether the address is this machine's own (127.0.0.0/8, ::1)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return given.strip()


Tokens = str | tuple[str, ...]


def _configured(expected: Tokens) -> tuple[str, ...]:
    return tuple(t for t in ((expected,) if isinstance(expected, str) else expected) if t)


def same_token(expected: Tokens, given: str) -> bool:
    """Whether `given` is one of the configured tokens, compared in constant time (every one
    is compared); never for an unset one."""
    matched = False
    for token in _configured(expected):
        matched |= hmac.compare_digest(given.strip().encode(), token.encode())
    return matched


class FailureThrottle:
    """Failed credentials per client address within a sliding window."""

    def __init__(
        self,
        limit: int,
        window_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_addresses: int = MAX_TRACKED_ADDRESSES,
    ) -> None:
        self.limit = limit
        self.window = window_seconds
        self._clock = clock
        self._max_addresses = max_addresses
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def _recent(self, address: str, now: float) -> deque[float] | None:
        failures = self._failures.get(address)
        if failures is None:
            return None
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[address]
            return None
        return failures

    def retry_after(self, address: str) -> int | None:
        """Seconds until this address may try again, or None when it may now."""
        now = self._clock()
        failures = self._recent(address, now)
        if failures is None or len(failures) < self.limit:
            return None
        return max(1, math.ceil(failures[0] + self.window - now))

    def failed(self, address: str) -> int | None:
        """Count one wrong credential from this address; the seconds until it may try again
        when that makes it one too many (past `limit` within the window), else None."""
        over = self.retry_after(address) is not None
        now = self._clock()
        failures = self._recent(address, now)
        if failures is None:
            failures = self._failures[address] = deque(maxlen=self.limit)
            while len(self._failures) > self._max_addresses:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(address)
        failures.append(now)
        return self.retry_after(address) if over else None


def too_many_failures(retry_after: int) -> Problem:
    """The 429 answer to an address that failed too often."""
    return Problem(
        429,
        "too_many_failures",
        "Too many failed credentials from this address; try again after Retry-After seconds.",
        headers={"Retry-After": str(retry_after)},
    )


def require_bearer(
    request: Request, expected: Tokens, throttle: FailureThrottle, realm: str
) -> None:
    """Let the request through only with `Authorization: Bearer <one of expected>`, whatever
    the throttle says; a wrong token is counted and answered 401, or 429 once its address is
    past the limit; a missing one is 401 and not counted."""
    given = bearer_token(request.headers.get("authorization"))
    if given is not None and same_token(expected, given):
        return
    address = client_address(request)
    if given is not None:
        wait = throttle.failed(address)
        if wait is not None:
            log.warning("auth.throttled", client=address, realm=realm, retry_after=wait)
            raise too_many_failures(wait)
    log.warning("auth.refused", client=address, realm=realm, token_given=given is not None)
    raise Problem(
        401,
        "unauthorized",
        f"A valid {realm} bearer token is required.",
        headers={"WWW-Authenticate": f'Bearer realm="idem-{realm}"'},
    )


def require_token_or_loopback(
    request: Request, expected: Tokens, throttle: FailureThrottle, realm: str
) -> None:
    """With a token configured, `require_bearer`; without one, loopback clients only (403
    `<realm>_forbidden` for others), so an unconfigured deployment exposes nothing. Behind a
    reverse proxy on the same host every client looks local unless the proxy's headers are
    trusted (FORWARDED_ALLOW_IPS): configure a token there."""
    if _configured(expected):
        require_bearer(request, expected, throttle, realm)
        return
    address = client_address(request)
    if not is_loopback(address):
        log.warning("auth.not_loopback", client=address, realm=realm)
        raise Problem(
            403,
            f"{realm}_forbidden",
            f"Set {realm.upper()}_TOKEN to call this from another machine; without it only "
            "this machine may.",
        )
