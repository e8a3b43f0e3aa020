"""The providers' signature schemes, each implemented from its published specification.

| scheme   | header(s)                                        | signed text             | MAC    |
|----------|--------------------------------------------------|-------------------------|--------|
| standard | webhook-id, webhook-timestamp, webhook-signature | "<id>.<timestamp>.body" | base64 |
| stripe   | Stripe-Signature: t=<timestamp>,v1=<mac>[,v1=…]  | "<timestamp>.body"      | hex    |
| github   | X-Hub-Signature-256: sha256=<mac>                | body                    | hex    |
| shopify  | X-Shopify-Hmac-Sha256: <mac>                     | body                    | base64 |

All are HMAC-SHA256. Standard Webhooks (standardwebhooks.com) keys are `whsec_` + base64 of
the key bytes and its header lists space-separated `v1,<mac>` signatures (other versions, such
as the asymmetric `v1a`, are skipped); Stripe's header may carry several `v1` (a secret being
rolled) and older `v0` ones, which are skipped; the other two use the secret's UTF-8 bytes as the
key. Standard Webhooks and Stripe sign a timestamp, held to the source's tolerance. GitHub and
Shopify sign the body alone: their delivery-id and topic headers are outside the signature, and
no timestamp bounds a replay (docs/how-to/providers.md).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox.core import standard_webhooks
from outbox.core.problems import Problem
from outbox.core.routes import standard_key
from outbox.ingest.signatures import (
    Verified,
    any_equal,
    fresh_timestamp,
    hmac_sha256,
    missing,
    unauthorized,
)


class ProviderSigner:
    """A provider's scheme. None signs the gateway's `Idempotency-Key` header (on
    `/v1/events` such a header is refused; `/v1/webhooks` does not read it)."""

    def verify(
        self,
        headers: Mapping[str, str],
        body: bytes,
        *,
        idempotency_key: str | None = None,
        now: float | None = None,
    ) -> Verified:
        """Raise a 401 Problem unless the request carries a valid signature."""
        self.check(headers, body, now)
        return Verified()

    def check(self, headers: Mapping[str, str], body: bytes, now: float | None) -> None:
        raise NotImplementedError


def _mismatch() -> Problem:
    return unauthorized("invalid_signature", "The signature does not match the body.")


@dataclass(frozen=True)
class StandardSigner(ProviderSigner):
    secrets: tuple[str, ...]
    tolerance_seconds: int = 300
    keys: tuple[bytes, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(standard_key(s) for s in self.secrets))

    def check(self, headers: Mapping[str, str], body: bytes, now: float | None) -> None:
        message_id = headers.get("webhook-id")
        stamp = headers.get("webhook-timestamp")
        given = headers.get("webhook-signature")
        if not message_id or not stamp or not given:
            raise missing("webhook-id", "webhook-timestamp", "webhook-signature")
        timestamp = fresh_timestamp(stamp, "webhook-timestamp", self.tolerance_seconds, now)
        signatures = [
            value.encode()
            for version, _, value in (item.partition(",") for item in given.split())
            if version == standard_webhooks.VERSION
        ]
        expected = (standard_webhooks.mac(key, message_id, timestamp, body) for key in self.keys)
        if not signatures or not any_equal(expected, signatures):
            raise _mismatch()


@dataclass(frozen=True)
class StripeSigner(ProviderSigner):
    secrets: tuple[str, ...]
    tolerance_seconds: int = 300

    def check(self, headers: Mapping[str, str], body: bytes, now: float | None) -> None:
        given = headers.get("stripe-signature")
        if not given:
            raise missing("Stripe-Signature")
        stamps: list[str] = []
        signatures: list[bytes] = []
        for item in given.split(","):
            name, _, value = item.strip().partition("=")
            if name == "t":
                stamps.append(value)
            elif name == "v1":
                signatures.append(value.lower().encode())
        if len(stamps) != 1 or not signatures:
            raise unauthorized(
                "invalid_signature", "Stripe-Signature needs one t= and at least one v1=."
            )
        timestamp = fresh_timestamp(stamps[0], "Stripe-Signature t", self.tolerance_seconds, now)
        base = f"{timestamp}.".encode()
        expected = (hmac_sha256(s.encode(), base, body).hex().encode() for s in self.secrets)
        if not any_equal(expected, signatures):
            raise _mismatch()


@dataclass(frozen=True)
class GithubSigner(ProviderSigner):
    secrets: tuple[str, ...]

    def check(self, headers: Mapping[str, str], body: bytes, now: float | None) -> None:
        given = headers.get("x-hub-signature-256")
        if not given:
            raise missing("X-Hub-Signature-256")
        algorithm, _, value = given.strip().partition("=")
        if algorithm != "sha256" or not value:
            raise unauthorized("invalid_signature", "X-Hub-Signature-256 is sha256=<hex>.")
        expected = (hmac_sha256(s.encode(), body).hex().encode() for s in self.secrets)
        if not any_equal(expected, [value.lower().encode()]):
            raise _mismatch()


@dataclass(frozen=True)
class ShopifySigner(ProviderSigner):
    secrets: tuple[str, ...]

    def check(self, headers: Mapping[str, str], body: bytes, now: float | None) -> None:
        given = headers.get("x-shopify-hmac-sha256")
        if not given:
            raise missing("X-Shopify-Hmac-Sha256")
        expected = (base64.b64encode(hmac_sha256(s.encode(), body)) for s in self.secrets)
        if not any_equal(expected, [given.strip().encode()]):
            raise _mismatch()


# -- signing, as the providers do (for senders of tests, benchmarks and documentation) --------


def sign_standard(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    """A `webhook-signature` value."""
    return standard_webhooks.signature_header([standard_key(secret)], message_id, timestamp, body)


def sign_stripe(secret: str, timestamp: int, body: bytes) -> str:
    """A `Stripe-Signature` value."""
    return f"t={timestamp},v1=" + hmac_sha256(secret.encode(), f"{timestamp}.".encode(), body).hex()


def sign_github(secret: str, body: bytes) -> str:
    """An `X-Hub-Signature-256` value."""
    return "sha256=" + hmac_sha256(secret.encode(), body).hex()


def sign_shopify(secret: str, body: bytes) -> str:
    """An `X-Shopify-Hmac-Sha256` value."""
    return base64.b64encode(hmac_sha256(secret.encode(), body)).decode()
