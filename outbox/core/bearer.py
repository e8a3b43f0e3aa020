"""Bearer tokens: reading one from a header and comparing it with the configured ones.

Apart from `outbox.core.access` so that a process serving no HTTP API (the worker's metrics
endpoint) checks a token without importing the web framework.
"""

from __future__ import annotations

import hmac


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    return given.strip()


Tokens = str | tuple[str, ...]


def configured(expected: Tokens) -> tuple[str, ...]:
    """The tokens set (an unset one is empty and never matches)."""
    return tuple(t for t in ((expected,) if isinstance(expected, str) else expected) if t)


def same_token(expected: Tokens, given: str) -> bool:
    """Whether `given` is one of the configured tokens, compared in constant time (every one
    is compared); never for an unset one."""
    matched = False
    for token in configured(expected):
        matched |= hmac.compare_digest(given.strip().encode(), token.encode())
    return matched
