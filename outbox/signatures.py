"""Signed webhooks: a source with a secret must sign each request, or nothing is stored.

Scheme (the default; header names can be changed per source in the routes file):

    X-Idem-Timestamp: <unix seconds>
    X-Idem-Signature: sha256=<hex of HMAC-SHA256(secret, "<timestamp>.<raw body>")>

The timestamp is inside the signed text and must be within the tolerance of now, so a captured
request cannot be replayed later; the comparison runs in constant time. The source is the
envelope's (normalized) `source`.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from dataclasses import dataclass

from outbox.problems import Problem

DEFAULT_SIGNATURE_HEADER = "X-Idem-Signature"
DEFAULT_TIMESTAMP_HEADER = "X-Idem-Timestamp"


@dataclass(frozen=True)
class SourceSecret:
    secret: str
    signature_header: str = DEFAULT_SIGNATURE_HEADER
    timestamp_header: str = DEFAULT_TIMESTAMP_HEADER
    tolerance_seconds: int = 300


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(
    source: SourceSecret, headers: Mapping[str, str], body: bytes, now: float | None = None
) -> None:
    """Raise a 401 Problem unless `body` carries a valid, fresh signature."""
    given = headers.get(source.signature_header.lower())
    stamp = headers.get(source.timestamp_header.lower())
    if not given or not stamp:
        raise _unauthorized(
            "missing_signature",
            f"Sign the request: {source.timestamp_header} and "
            f"{source.signature_header} are required for this source.",
        )
    # Unix seconds have 10 digits; a longer value is refused before int() would have to parse
    # thousands of digits (which Python refuses with an error of its own).
    if len(stamp) > 20 or not stamp.strip().isascii() or not stamp.strip().isdigit():
        raise _unauthorized("invalid_signature", f"{source.timestamp_header} is not unix seconds.")
    timestamp = int(stamp.strip())
    if abs((now if now is not None else time.time()) - timestamp) > source.tolerance_seconds:
        raise _unauthorized(
            "stale_signature", f"The timestamp is more than {source.tolerance_seconds} s from now."
        )
    expected = sign(source.secret, timestamp, body)
    candidate = given.strip()
    if not candidate.startswith("sha256="):
        candidate = "sha256=" + candidate
    if not hmac.compare_digest(candidate.encode(), expected.encode()):
        raise _unauthorized("invalid_signature", "The signature does not match the body.")


def parse_secrets(value: str) -> dict[str, str]:
    """`"stripe=whsec_1,shop=s3cr3t"` → {"stripe": "whsec_1", "shop": "s3cr3t"}."""
    found: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in value.split(","))):
        name, sep, secret = item.partition("=")
        if not sep or not name.strip() or not secret:
            raise ValueError("WEBHOOK_SECRETS is a comma-separated list of source=secret")
        found[name.strip().casefold()] = secret
    return found


def _unauthorized(code: str, detail: str) -> Problem:
    return Problem(401, code, detail + " Nothing was stored.")
