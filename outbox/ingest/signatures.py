"""Signed requests: a source with a secret must sign each request, or nothing is stored.

Every scheme (this module's `hmac`, and the providers' in `outbox.ingest.provider_signatures`) is
checked over the exact bytes received, before the body is parsed, against every secret the
source has (several during a rotation) and every signature the header carries; comparisons run
in constant time. Where a scheme signs a timestamp, it must be within the tolerance of now, so a
captured request cannot be replayed later.

The `hmac` scheme (the gateway's own; header names can be changed per source):

    X-Idem-Timestamp: <unix seconds>
    X-Idem-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>.<raw body>")>          (v1)
    X-Idem-Signature: v2=<hex HMAC-SHA256(secret, "<timestamp>.<key>.<raw body>")>        (v2)

v2 also signs the `Idempotency-Key` header (empty when there is none): without it a captured
request re-sent with another key would become a new event and run its action again. So an
`Idempotency-Key` on a request that only a v1 signature covers is refused (400
`unsigned_idempotency_key`). A header may carry several signatures separated by commas or
spaces (a sender in the middle of a rotation signs with both secrets).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from outbox.core.problems import Problem

DEFAULT_SIGNATURE_HEADER = "X-Idem-Signature"
DEFAULT_TIMESTAMP_HEADER = "X-Idem-Timestamp"
# Unix seconds fit in 11 digits until the year 5138; a longer value is not a timestamp (and
# converting thousands of digits to an int is slow, then refused by Python).
_MAX_TIMESTAMP_DIGITS = 12
_SEPARATORS = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class Verified:
    """A valid signature, and whether it also covers the request's `Idempotency-Key`."""

    covers_key: bool = False


class Signer(Protocol):
    """One source's signature check (a scheme with that source's secrets)."""

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Verified:
        """Raise a 401 Problem unless the request carries a valid signature."""
        ...


def unauthorized(code: str, detail: str) -> Problem:
    """The 401 every scheme answers; nothing was stored."""
    return Problem(401, code, detail + " Nothing was stored.")


def missing(*names: str) -> Problem:
    return unauthorized(
        "missing_signature", f"Sign the request: {', '.join(names)} required for this source."
    )


def fresh_timestamp(value: str, header: str, tolerance_seconds: int, now: float | None) -> int:
    """The signed unix-seconds timestamp, if it is one and within the tolerance of now."""
    stamp = value.strip()
    if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= _MAX_TIMESTAMP_DIGITS):
        raise unauthorized("invalid_signature", f"{header} is not unix seconds.")
    timestamp = int(stamp)
    if abs((time.time() if now is None else now) - timestamp) > tolerance_seconds:
        raise unauthorized(
            "stale_signature", f"The timestamp is more than {tolerance_seconds} s from now."
        )
    return timestamp


def any_equal(expected: Iterable[bytes], given: Iterable[bytes]) -> bool:
    """Whether some given signature equals some expected one; every pair is compared in
    constant time (no early exit), so timing tells nothing about which or how close."""
    wanted = list(expected)
    found = False
    for candidate in given:
        for value in wanted:
            found |= hmac.compare_digest(candidate, value)
    return found


def hmac_sha256(secret: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(part)
    return mac.digest()


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The v1 signature header's value for `body` sent at `timestamp`."""
    return "sha256=" + hmac_sha256(secret.encode(), f"{timestamp}.".encode(), body).hex()


def sign_v2(secret: str, timestamp: int, key: str, body: bytes) -> str:
    """The v2 signature header's value: also covers the `Idempotency-Key` sent (or "")."""
    base = f"{timestamp}.{key}.".encode()
    return "v2=" + hmac_sha256(secret.encode(), base, body).hex()


@dataclass(frozen=True)
class HmacSigner:
    """The gateway's own scheme (module docstring), v1 and v2."""

    secrets: tuple[str, ...]
    signature_header: str = DEFAULT_SIGNATURE_HEADER
    timestamp_header: str = DEFAULT_TIMESTAMP_HEADER
    tolerance_seconds: int = 300

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Verified:
        given = headers.get(self.signature_header.lower())
        stamp = headers.get(self.timestamp_header.lower())
        if not given or not stamp:
            raise missing(self.timestamp_header, self.signature_header)
        timestamp = fresh_timestamp(stamp, self.timestamp_header, self.tolerance_seconds, now)
        v1: list[bytes] = []
        v2: list[bytes] = []
        for item in filter(None, _SEPARATORS.split(given)):
            version, sep, value = item.partition("=")
            if not sep:  # bare hex: v1, as before versions existed
                version, value = "sha256", item
            if version == "sha256":
                v1.append(value.lower().encode())
            elif version == "v2":
                v2.append(value.lower().encode())
        secrets = [secret.encode() for secret in self.secrets]
        key = "" if idempotency_key is None else idempotency_key
        v2_base = f"{timestamp}.{key}.".encode()
        if v2 and any_equal((hmac_sha256(s, v2_base, body).hex().encode() for s in secrets), v2):
            return Verified(covers_key=True)
        v1_base = f"{timestamp}.".encode()
        if v1 and any_equal((hmac_sha256(s, v1_base, body).hex().encode() for s in secrets), v1):
            return Verified(covers_key=False)
        raise unauthorized("invalid_signature", "The signature does not match the body.")
