"""The gateway's own scheme: HMAC-SHA256 over "<timestamp>.<raw body>" (v1) or
"<timestamp>.<idempotency-key>.<raw body>" (v2), fresh, compared safely, several secrets."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from outbox.core.problems import Problem
from outbox.core.tokens import parse_secrets
from outbox.ingest.signatures import HmacSigner, sign, sign_v2

SECRET = "whsec_0123456789abcdef"
NEW_SECRET = "whsec_fedcba9876543210"
SIGNER = HmacSigner((SECRET,), tolerance_seconds=300)
BODY = b'{"source":"stripe","event_type":"invoice.paid","external_id":"in_1","payload":{}}'
NOW = 1_800_000_000
KEY = "stripe:in_1"


def headers(signature: str | None, timestamp: int | str | None) -> dict[str, str]:
    found = {}
    if signature is not None:
        found["x-idem-signature"] = signature
    if timestamp is not None:
        found["x-idem-timestamp"] = str(timestamp)
    return found


def test_sign_is_hmac_sha256_of_timestamp_dot_body() -> None:
    """The documented v1 scheme, computed independently, gives the same header value."""
    expected = hmac.new(SECRET.encode(), f"{NOW}.".encode() + BODY, hashlib.sha256).hexdigest()
    assert sign(SECRET, NOW, BODY) == f"sha256={expected}"


def test_sign_v2_covers_the_key_between_timestamp_and_body() -> None:
    """The documented v2 scheme, computed independently, gives the same header value."""
    base = f"{NOW}.{KEY}.".encode() + BODY
    expected = hmac.new(SECRET.encode(), base, hashlib.sha256).hexdigest()
    assert sign_v2(SECRET, NOW, KEY, BODY) == f"v2={expected}"


def test_a_good_signature_passes_with_or_without_the_prefix() -> None:
    """A correct v1 signature is accepted, as `sha256=<hex>` or bare hex; it covers no key."""
    good = sign(SECRET, NOW, BODY)
    assert not SIGNER.verify(headers(good, NOW), BODY, now=NOW + 10).covers_key
    SIGNER.verify(headers(good.removeprefix("sha256="), NOW), BODY, now=NOW - 10)


def test_v2_covers_the_idempotency_key_it_was_signed_with() -> None:
    """A v2 signature is valid with the key it signed, and with no key when it signed ""."""
    signed = headers(sign_v2(SECRET, NOW, KEY, BODY), NOW)
    assert SIGNER.verify(signed, BODY, idempotency_key=KEY, now=NOW).covers_key
    unkeyed = headers(sign_v2(SECRET, NOW, "", BODY), NOW)
    assert SIGNER.verify(unkeyed, BODY, now=NOW).covers_key


@pytest.mark.parametrize("sent_key", ["stripe:in_2", None], ids=["another-key", "key-dropped"])
def test_v2_refuses_a_changed_or_dropped_key(sent_key: str | None) -> None:
    """A captured v2 request re-sent with another key (or none) does not verify."""
    signed = headers(sign_v2(SECRET, NOW, KEY, BODY), NOW)
    with pytest.raises(Problem) as raised:
        SIGNER.verify(signed, BODY, idempotency_key=sent_key, now=NOW)
    assert raised.value.status == 401 and raised.value.error == "invalid_signature"


def test_several_signatures_and_a_rotated_secret() -> None:
    """A header may list several signatures; any secret of the source verifies."""
    rotating = HmacSigner((SECRET, NEW_SECRET))
    listed = f"{sign('an-unknown-secret!', NOW, BODY)}, {sign(NEW_SECRET, NOW, BODY)}"
    rotating.verify(headers(listed, NOW), BODY, now=NOW)
    both = f"{sign_v2(SECRET, NOW, KEY, BODY)} {sign(SECRET, NOW, BODY)}"
    assert rotating.verify(headers(both, NOW), BODY, idempotency_key=KEY, now=NOW).covers_key
    with pytest.raises(Problem):
        SIGNER.verify(headers(sign(NEW_SECRET, NOW, BODY), NOW), BODY, now=NOW)


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
        ("SIGNED", "9" * 5000, BODY, NOW, "invalid_signature"),
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
        "timestamp-of-5000-digits",
        "other-secret",
    ],
)
def test_bad_missing_or_stale_signatures_are_401(
    signature: str | None, timestamp: int | str | None, body: bytes, now: int, code: str
) -> None:
    """Every way a signature can be wrong is a 401 with its own code."""
    if signature == "SIGNED":
        signature = sign(SECRET, NOW, BODY)
    elif signature == "OTHER-SECRET":
        signature = sign("another-secret-entirely", NOW, BODY)
    with pytest.raises(Problem) as raised:
        SIGNER.verify(headers(signature, timestamp), body, now=now)
    assert raised.value.status == 401 and raised.value.error == code


def test_header_names_are_configurable() -> None:
    """A source may name its own headers (as many providers do)."""
    custom = HmacSigner((SECRET,), "X-Shop-Hmac", "X-Shop-Time", 60)
    custom.verify({"x-shop-hmac": sign(SECRET, NOW, BODY), "x-shop-time": str(NOW)}, BODY, now=NOW)
    with pytest.raises(Problem):
        custom.verify(headers(sign(SECRET, NOW, BODY), NOW), BODY, now=NOW)


def test_parse_secrets_reads_source_equals_secret_pairs() -> None:
    """WEBHOOK_SECRETS is a comma-separated list; names are case-insensitive; a name given
    twice has both secrets (a rotation)."""
    assert parse_secrets("Stripe=whsec_1, shop=a=b,SHOP=c") == {
        "stripe": ("whsec_1",),
        "shop": ("a=b", "c"),
    }
    assert parse_secrets("") == {}
    with pytest.raises(ValueError):
        parse_secrets("stripe")
