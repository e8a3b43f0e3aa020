"""The providers' schemes: correct requests built from each specification (and the published
test values where they exist) pass; a wrong secret, a body altered by one byte, a stale
timestamp or a missing header is a 401; rotated secrets and several signatures work."""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable

import pytest

from outbox.core.problems import Problem
from outbox.core.routes import standard_key
from outbox.ingest.provider_signatures import (
    GithubSigner,
    ShopifySigner,
    StandardSigner,
    StripeSigner,
    sign_github,
    sign_shopify,
    sign_standard,
    sign_stripe,
)
from outbox.ingest.signatures import Signer, Verified

NOW = 1_800_000_000
BODY = b'{"id":"evt_1","type":"invoice.paid","data":{"object":{"id":"in_1"}}}'
ALTERED = BODY.replace(b"in_1", b"in_2")  # one byte differs
assert len(ALTERED) == len(BODY) and sum(a != b for a, b in zip(BODY, ALTERED, strict=True)) == 1
OLD = "old-secret-0123456789abcdef"
NEW = "new-secret-0123456789abcdef"
STANDARD_OLD = "whsec_" + base64.b64encode(b"old key bytes for the test!").decode()
STANDARD_NEW = "whsec_" + base64.b64encode(b"new key bytes for the test!").decode()


def mac(key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hashlib.sha256).digest()


def rejects(signer: Signer, headers: dict[str, str], body: bytes, now: float = NOW) -> str:
    with pytest.raises(Problem) as raised:
        signer.verify(headers, body, now=now)
    assert raised.value.status == 401
    return raised.value.error


# -- published test values ---------------------------------------------------------------------


def test_standard_webhooks_published_vector() -> None:
    """The Standard Webhooks libraries' own test value: secret, id, timestamp, body and the
    signature they expect (libraries/go/webhook_test.go, TestWebhookSign)."""
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    expected = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert sign_standard(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == expected
    headers = {
        "webhook-id": "msg_p5jXN8AQM9LWM0D4loKWxJek",
        "webhook-timestamp": "1614265330",
        "webhook-signature": expected,
    }
    for spelled in (secret, secret.removeprefix("whsec_")):  # the prefix is optional
        StandardSigner((spelled,)).verify(headers, body, now=1614265330)


def test_github_published_test_values() -> None:
    """GitHub's documented test values ("Validating webhook deliveries"): secret "It's a
    Secret to Everybody", body "Hello, World!"."""
    secret = "It's a Secret to Everybody"
    expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert sign_github(secret, b"Hello, World!") == expected
    GithubSigner((secret,)).verify({"x-hub-signature-256": expected}, b"Hello, World!")


# -- built from each specification ---------------------------------------------------------------


def standard_headers(secret: str, body: bytes = BODY, stamp: int = NOW) -> dict[str, str]:
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signature = base64.b64encode(mac(key, f"msg_1.{stamp}.".encode() + body)).decode()
    return {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": f"v1,{signature}",
    }


def stripe_headers(secret: str, body: bytes = BODY, stamp: int = NOW) -> dict[str, str]:
    signature = mac(secret.encode(), f"{stamp}.".encode() + body).hex()
    return {"stripe-signature": f"t={stamp},v1={signature}"}


def github_headers(secret: str, body: bytes = BODY, stamp: int = NOW) -> dict[str, str]:
    return {"x-hub-signature-256": "sha256=" + mac(secret.encode(), body).hex()}


def shopify_headers(secret: str, body: bytes = BODY, stamp: int = NOW) -> dict[str, str]:
    return {"x-shopify-hmac-sha256": base64.b64encode(mac(secret.encode(), body)).decode()}


Headers = Callable[..., dict[str, str]]
SCHEMES: dict[str, tuple[Callable[[tuple[str, ...]], Signer], Headers, str, str]] = {
    "standard": (lambda s: StandardSigner(s, 300), standard_headers, STANDARD_OLD, STANDARD_NEW),
    "stripe": (lambda s: StripeSigner(s, 300), stripe_headers, OLD, NEW),
    "github": (GithubSigner, github_headers, OLD, NEW),
    "shopify": (ShopifySigner, shopify_headers, OLD, NEW),
}
TIMED = ["standard", "stripe"]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_correct_request_passes_and_covers_no_idempotency_key(scheme: str) -> None:
    """A request signed as the specification says is accepted; no provider signs our key."""
    make, headers, old, _ = SCHEMES[scheme]
    assert make((old,)).verify(headers(old), BODY, idempotency_key="k", now=NOW) == Verified()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_signing_helpers_agree_with_the_specification(scheme: str) -> None:
    """The helpers senders use (tests, bench, docs) produce the headers built above."""
    _, headers, old, _ = SCHEMES[scheme]
    helper = {
        "standard": lambda: {
            "webhook-id": "msg_1",
            "webhook-timestamp": str(NOW),
            "webhook-signature": sign_standard(old, "msg_1", NOW, BODY),
        },
        "stripe": lambda: {"stripe-signature": sign_stripe(old, NOW, BODY)},
        "github": lambda: {"x-hub-signature-256": sign_github(old, BODY)},
        "shopify": lambda: {"x-shopify-hmac-sha256": sign_shopify(old, BODY)},
    }[scheme]
    assert helper() == headers(old)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_wrong_secret_is_refused(scheme: str) -> None:
    """A request signed with another secret is a 401 invalid_signature."""
    make, headers, old, new = SCHEMES[scheme]
    assert rejects(make((old,)), headers(new), BODY) == "invalid_signature"


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_body_altered_by_one_byte_is_refused(scheme: str) -> None:
    """The signature covers the exact bytes: one changed byte is a 401."""
    make, headers, old, _ = SCHEMES[scheme]
    assert rejects(make((old,)), headers(old), ALTERED) == "invalid_signature"
    assert rejects(make((old,)), headers(old), BODY + b"\n") == "invalid_signature"


@pytest.mark.parametrize("scheme", TIMED)
@pytest.mark.parametrize("offset", [-301, 301], ids=["too-old", "from-the-future"])
def test_a_stale_timestamp_is_refused(scheme: str, offset: int) -> None:
    """A correctly signed request whose signed timestamp is outside the tolerance is a 401."""
    make, headers, old, _ = SCHEMES[scheme]
    signed = headers(old, stamp=NOW + offset)
    assert rejects(make((old,)), signed, BODY) == "stale_signature"
    make((old,)).verify(signed, BODY, now=NOW + offset - 1)  # within it: fine


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_rotated_secret_verifies_with_either(scheme: str) -> None:
    """During a rotation a source has two secrets, and a request signed with either passes."""
    make, headers, old, new = SCHEMES[scheme]
    rotating = make((old, new))
    rotating.verify(headers(old), BODY, now=NOW)
    rotating.verify(headers(new), BODY, now=NOW)
    assert rejects(make((new,)), headers(old), BODY) == "invalid_signature"


def test_standard_several_signatures_in_one_header() -> None:
    """webhook-signature lists signatures separated by spaces; other versions are skipped."""
    good = standard_headers(STANDARD_NEW)
    good["webhook-signature"] = " ".join(
        [
            "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=",
            "v1a,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc=",
            good["webhook-signature"],
        ]
    )
    StandardSigner((STANDARD_NEW,)).verify(good, BODY, now=NOW)
    only_others = {**good, "webhook-signature": good["webhook-signature"].split()[0]}
    assert rejects(StandardSigner((STANDARD_NEW,)), only_others, BODY) == "invalid_signature"


def test_stripe_several_v1_signatures_in_one_header() -> None:
    """Stripe-Signature may carry several v1 (a secret being rolled) and a v0; any v1 passes."""
    valid = stripe_headers(NEW)["stripe-signature"].split(",")[1]
    header = f"t={NOW},v1={'0' * 64},{valid},v0={'1' * 64}"
    StripeSigner((NEW,)).verify({"stripe-signature": header}, BODY, now=NOW)
    v0_only = f"t={NOW},v0={mac(NEW.encode(), f'{NOW}.'.encode() + BODY).hex()}"
    assert rejects(StripeSigner((NEW,)), {"stripe-signature": v0_only}, BODY) == (
        "invalid_signature"
    )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_missing_headers_are_refused(scheme: str) -> None:
    """Without its signature header (or any header the scheme signs) a request is a 401."""
    make, headers, old, _ = SCHEMES[scheme]
    complete = headers(old)
    assert rejects(make((old,)), {}, BODY) == "missing_signature"
    for name in complete:
        partial = {k: v for k, v in complete.items() if k != name}
        assert rejects(make((old,)), partial, BODY) == "missing_signature"


@pytest.mark.parametrize(
    "header",
    [f"v1={'0' * 64}", f"t={NOW}", f"t=soon,v1={'0' * 64}", f"t={NOW},t={NOW},v1={'0' * 64}"],
    ids=["no-timestamp", "no-v1", "timestamp-not-a-number", "two-timestamps"],
)
def test_stripe_malformed_headers_are_refused(header: str) -> None:
    """A Stripe-Signature without exactly one t= and a v1= is a 401 invalid_signature."""
    assert rejects(StripeSigner((OLD,)), {"stripe-signature": header}, BODY) == "invalid_signature"


def test_github_needs_the_sha256_prefix() -> None:
    """X-Hub-Signature-256 is `sha256=<hex>`; the bare digest is not accepted."""
    bare = mac(OLD.encode(), BODY).hex()
    assert rejects(GithubSigner((OLD,)), {"x-hub-signature-256": bare}, BODY) == (
        "invalid_signature"
    )


def test_a_standard_secret_must_be_base64() -> None:
    """A mistyped Standard Webhooks secret is refused when the source is built."""
    with pytest.raises(ValueError):
        standard_key("whsec_not base64!")
