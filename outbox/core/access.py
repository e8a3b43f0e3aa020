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
address that keeps guessing stays limited. A missing credential is counted as a wrong one: a
flood of tokenless requests is a flood of refusals like any other. The count is kept in the
receiver process (each process counts its own, so N processes allow N times the limit), for at
most MAX_TRACKED_ADDRESSES addresses.

Refusals are logged sampled: one `auth.refused` (and one `auth.throttled`) line per address
per window, carrying how many refusals it stands for (`refusals`), so no client can fill the
log however fast it knocks.

The client's address is the connection's, or the one a trusted proxy forwarded (uvicorn's
FORWARDED_ALLOW_IPS, named proxies only: outbox/core/connections.py), so a lockout is per
client behind the proxy, not per proxy; refusals are logged with it, never with the token.
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from fastapi import Request

from outbox.core.bearer import Tokens, bearer_token, configured, same_token
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
        # (address, line) -> when its last line was written and the refusals since.
        self._told: OrderedDict[tuple[str, str], tuple[float, int]] = OrderedDict()

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

    def sampled(self, address: str, line: str) -> int | None:
        """The refusals a log `line` about `address` stands for when it is due (one line per
        address and kind per window), or None while it is not: count this one and say
        nothing."""
        now = self._clock()
        last, since = self._told.pop((address, line), (-math.inf, 0))
        if now - last < self.window:
            self._told[(address, line)] = (last, since + 1)
            return None
        self._told[(address, line)] = (now, 0)
        while len(self._told) > self._max_addresses:
            self._told.popitem(last=False)
        return since + 1


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
    the throttle says; a wrong or missing token is counted and answered 401, or 429 once its
    address is past the limit; the log lines are sampled per address (module docstring)."""
    given = bearer_token(request.headers.get("authorization"))
    if given is not None and same_token(expected, given):
        return
    address = client_address(request)
    wait = throttle.failed(address)
    if wait is not None:
        refusals = throttle.sampled(address, "auth.throttled")
        if refusals is not None:
            log.warning(
                "auth.throttled", client=address, realm=realm, retry_after=wait, refusals=refusals
            )
        raise too_many_failures(wait)
    refusals = throttle.sampled(address, "auth.refused")
    if refusals is not None:
        log.warning(
            "auth.refused",
            client=address,
            realm=realm,
            token_given=given is not None,
            refusals=refusals,
        )
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
    if configured(expected):
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
