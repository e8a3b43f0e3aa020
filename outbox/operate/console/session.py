"""Console sessions and CSRF tokens: signed, stateless, bound to the operator token.

A session is `v1.<expires>.<nonce>.<signature>`, the signature an HMAC-SHA256 under a key
derived from OPERATOR_TOKEN. Nothing is stored on the server: rotating the token invalidates
every session at once, and a session ends by itself after SESSION_SECONDS. The CSRF token of a
form is an HMAC of the session value under the same key, so it cannot be computed without the
cookie, which a cross-site page can neither read (HttpOnly) nor send (SameSite=Strict).
Every comparison is in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

COOKIE_NAME = "idem_console"
# A working day: long enough for an incident, short enough that a forgotten laptop closes.
SESSION_SECONDS = 8 * 3600
_VERSION = "v1"
_MAX_COOKIE = 256


@dataclass(frozen=True)
class Session:
    value: str
    expires_at: int
    csrf: str


def _key(operator_token: str) -> bytes:
    return hmac.new(operator_token.encode(), b"console-session", hashlib.sha256).digest()


def _sign(operator_token: str, message: str) -> str:
    return hmac.new(_key(operator_token), message.encode(), hashlib.sha256).hexdigest()


def token_matches(operator_token: str, given: str) -> bool:
    """The sign-in check: the given token equals OPERATOR_TOKEN (constant time)."""
    if not operator_token:
        return False
    return hmac.compare_digest(given.strip().encode(), operator_token.encode())


def issue(operator_token: str, now: float | None = None) -> Session:
    """A new session valid for SESSION_SECONDS."""
    expires = int(now if now is not None else time.time()) + SESSION_SECONDS
    body = f"{_VERSION}.{expires}.{secrets.token_urlsafe(16)}"
    value = f"{body}.{_sign(operator_token, body)}"
    return Session(value, expires, csrf_token(operator_token, value))


def verify(operator_token: str, value: str | None, now: float | None = None) -> Session | None:
    """The session a cookie value carries, or None when it is absent, forged or expired."""
    if not operator_token or not value or len(value) > _MAX_COOKIE:
        return None
    parts = value.split(".")
    if len(parts) != 4 or parts[0] != _VERSION or not (parts[1].isascii() and parts[1].isdigit()):
        return None
    body, signature = value.rsplit(".", 1)
    if not hmac.compare_digest(signature.encode(), _sign(operator_token, body).encode()):
        return None
    expires = int(parts[1])
    if expires <= (now if now is not None else time.time()):
        return None
    return Session(value, expires, csrf_token(operator_token, value))


def csrf_token(operator_token: str, session_value: str) -> str:
    """The CSRF token of every form of this session."""
    return _sign(operator_token, f"csrf:{session_value}")


def csrf_matches(session: Session, given: str | None) -> bool:
    """Whether a form's CSRF token belongs to this session (constant time)."""
    if not given:
        return False
    return hmac.compare_digest(given.encode(), session.csrf.encode())
