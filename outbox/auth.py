"""Bearer tokens for the endpoints a workflow calls (claims, event look-ups).

With a token configured, every caller must present it (compared in constant time). With none,
only loopback clients are served: a gateway started on a laptop works without set-up, and one
that faces a network refuses strangers instead of serving them. Behind a reverse proxy on the
same host every request comes from loopback unless the proxy's headers are trusted
(FORWARDED_ALLOW_IPS): set a token there.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import Request

from outbox.problems import Problem


def is_loopback(host: str | None) -> bool:
    """Whether a client address is this machine's own (127.0.0.0/8, ::1)."""
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer …` header, or None."""
    scheme, _, given = (authorization or "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def token_matches(given: str | None, *expected: str) -> bool:
    """Whether `given` equals one of the configured (non-empty) tokens, in constant time."""
    if given is None:
        return False
    matched = False
    for token in expected:
        if token:
            matched |= hmac.compare_digest(given.encode(), token.encode())
    return matched


def require_token(request: Request, *tokens: str, realm: str) -> None:
    """Let the request through, or raise 401: a configured token, or a loopback client when
    none is configured."""
    configured = [t for t in tokens if t]
    if configured:
        if token_matches(bearer(request.headers.get("authorization")), *configured):
            return
    elif is_loopback(request.client.host if request.client else None):
        return
    raise Problem(
        401,
        "unauthorized",
        "A valid bearer token is required."
        if configured
        else "No token is configured, so only clients on this machine are served.",
        headers={"WWW-Authenticate": f'Bearer realm="{realm}"'},
    )
