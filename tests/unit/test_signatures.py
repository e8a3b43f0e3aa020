"""Webhook signatures: HMAC-SHA256 over "<timestamp>.<raw body>", fresh, compared safely."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from outbox.problems import Problem
from outbox.signatures import SourceSecret, parse_secrets, sign, verify

SECRET = SourceSecret("whsec_0123456789abcdef", tolerance_seconds=300)
BODY = b'{"source":"stripe","event_type":"invoice.paid","external_id":"in_1","payload":{}}'
NOW = 1_800_000_000


def headers(signature: str | None, timestamp: int | str | None) -> dict[str, str]:
    found = {}
    if signature is not None:
        found["x-idem-signature"] = signature
    if timestamp is not None:
        found["x-idem-timestamp"] = str(timestamp)
    return found


def test_sign_is_hmac_sha256_of_timestamp_dot_body() -> None:
    """The documented scheme, computed independently, gives the same header value."""
    expected = hmac.new(
        b"whsec_0123456789abcdef", f"{NOW}.".encode() + BODY, hashlib.sha256
    ).hexdigest()
    assert sign(SECRET.secret, NOW, BODY) == f"sha256={expected}"


def test_a_good_signature_passes_with_or_without_the_prefix() -> None:
    """A correct signature is accepted, as `sha256=<hex>` or bare hex."""
    good = sign(SECRET.secret, NOW, BODY)
    verify(SECRET, headers(good, NOW), BODY, now=NOW + 10)
    verify(SECRET, headers(good.removeprefix("sha256="), NOW), BODY, now=NOW - 10)


@pytest.mark.parametrize(
    ("signature", "timestamp", "body", "now", "code"),
    [
        (None, NOW, BODY, NOW, "missing_signature"),
        ("sha256=00", None, BODY, NOW, "missing_signature"),
        ("sha256=" + "0" * 64, NOW, BODY, NOW, "invalid_signature"),
        ("SIGNED", NOW, BODY + b" ", NOW, "invalid_signature"),
        ("SIGNED", NOW, BODY.replace(b"in_1", b"in_2"), NOW, "invalid_signature"),
        ("SIGNED", NOW, BODY, NOW + 301, "stale_signature"),
        ("SIGNED", NOW, BODY, NOW - 301, "stale_signature"),
        ("SIGNED", "soon", BODY, NOW, "invalid_signature"),
        ("OTHER-SECRET", NOW, BODY, NOW, "invalid_signature"),
    ],
    ids=[
        "no-signature",
        "no-timestamp",
        "wrong",
        "body-padded",
        "body-altered",
        "too-old",
        "from-the-future",
        "timestamp-not-a-number",
        "other-secret",
    ],
)
def test_bad_missing_or_stale_signatures_are_401(
    signature: str | None, timestamp: int | str | None, body: bytes, now: int, code: str
) -> None:
    """Every way a signature can be wrong is a 401 with its own code."""
    if signature == "SIGNED":
        signature = sign(SECRET.secret, NOW, BODY)
    elif signature == "OTHER-SECRET":
        signature = sign("another-secret-entirely", NOW, BODY)
    with pytest.raises(Problem) as raised:
        verify(SECRET, headers(signature, timestamp), body, now=now)
    assert raised.value.status == 401 and raised.value.error == code


def test_header_names_are_configurable() -> None:
    """A source may name its own headers (as many providers do)."""
    custom = SourceSecret(SECRET.secret, "X-Shop-Hmac", "X-Shop-Time", 60)
    verify(
        custom,
        {"x-shop-hmac": sign(SECRET.secret, NOW, BODY), "x-shop-time": str(NOW)},
        BODY,
        now=NOW,
    )
    with pytest.raises(Problem):
        verify(custom, headers(sign(SECRET.secret, NOW, BODY), NOW), BODY, now=NOW)


def test_parse_secrets_reads_source_equals_secret_pairs() -> None:
    """WEBHOOK_SECRETS is a comma-separated list; source names are case-insensitive."""
    assert parse_secrets("Stripe=whsec_1, shop=a=b,") == {"stripe": "whsec_1", "shop": "a=b"}
    assert parse_secrets("") == {}
    with pytest.raises(ValueError):
        parse_secrets("stripe")
