"""Keys namespaced by their source, through the real receiver, relay and worker: no sender can
take another source's key in advance, whatever `Idempotency-Key` it sends."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from outbox.core import keys
from outbox.ingest.provider_signatures import sign_shopify
from outbox.ingest.signatures import sign, sign_v2
from tests.integration.ingest.test_provider_webhooks import post, shopify
from tests.support import (
    PROVIDER_SECRETS,
    WEBHOOK_SECRET,
    Downstream,
    Stack,
    envelope,
    finished,
    other_receiver,
    query,
)


def _post_event(
    stack: Stack, document: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    with stack.client() as client:
        return client.post(
            "/v1/events",
            content=json.dumps(document).encode(),
            headers={"content-type": "application/json", **(headers or {})},
        )


def _signed_payment(external_id: str, key: str | None = None) -> tuple[bytes, dict[str, str]]:
    """The signing source's (`signed`, the billing system here) own event, signed: v1 without a
    key, v2 over the key when one is sent."""
    body = json.dumps(envelope(external_id, "payment.paid", source="signed")).encode()
    stamp = int(time.time())
    if key is None:
        return body, {
            "X-Idem-Timestamp": str(stamp),
            "X-Idem-Signature": sign(WEBHOOK_SECRET, stamp, body),
        }
    return body, {
        "X-Idem-Timestamp": str(stamp),
        "X-Idem-Signature": sign_v2(WEBHOOK_SECRET, stamp, key, body),
        "Idempotency-Key": key,
    }


def _send(stack: Stack, delivery: tuple[bytes, dict[str, str]]) -> httpx.Response:
    body, headers = delivery
    with stack.client() as client:
        return client.post(
            "/v1/events", content=body, headers={"content-type": "application/json", **headers}
        )


def _shopify_key(event_id: str) -> str:
    """The key the gateway gives Shopify's delivery `event_id` (no version configured)."""
    return keys.derive_key("shopify", "webhook", event_id)


def test_an_unsigned_source_cannot_take_a_signed_or_provider_source_key(
    stack: Stack, downstream: Downstream
) -> None:
    """An unsigned `webform` event sends the keys the signed source's derived event, its own
    client key and Shopify's delivery will get: each is stored inside `webform:`, and the
    genuine events are then accepted as new (202), each stored and run once."""
    paid_id, shop_id = f"o-{uuid.uuid4().hex[:8]}", f"evt_{uuid.uuid4().hex[:12]}"
    derived = keys.derive_key("signed", "payment.paid", paid_id)
    taken = [derived, "signed:o-77", _shopify_key(shop_id)]
    squats = [
        _post_event(stack, envelope(f"squat-{n}"), {"Idempotency-Key": key})
        for n, key in enumerate(taken)
    ]
    assert [a.status_code for a in squats] == [202, 202, 202]

    genuine = _send(stack, _signed_payment(paid_id))
    assert (genuine.status_code, genuine.json()["key"]) == (202, derived), genuine.text
    own_key = _send(stack, _signed_payment("o-77-event", key="o-77"))
    assert (own_key.status_code, own_key.json()["key"]) == (202, "signed:o-77"), own_key.text
    delivery = post(stack, "shopify", shopify(shop_id))
    assert (delivery.status_code, delivery.json()["key"]) == (202, _shopify_key(shop_id))
    assert [a.json()["key"] for a in squats] == [f"webform:{key}" for key in taken]

    for key in (derived, "signed:o-77", _shopify_key(shop_id)):
        assert finished(stack, key)["status"] == "succeeded"
        stored = query(
            stack.database_url, "SELECT source FROM events WHERE idempotency_key = %s", (key,)
        )
        assert stored == [("shopify",) if "webhook" in key else ("signed",)]
    assert downstream.effects[_shopify_key(shop_id)] == 1


def test_an_envelope_cannot_make_a_provider_key_without_its_signature(stack: Stack) -> None:
    """An envelope naming the provider source with the fields of its delivery would get the
    delivery's key: unsigned it is refused (401), so the delivery is new; signed with the
    provider's own secret it is the provider itself (the same key)."""
    shop_id = f"evt_{uuid.uuid4().hex[:12]}"
    forged = envelope(shop_id, "webhook", source="Shopify")
    refused = _post_event(stack, forged)
    assert (refused.status_code, refused.json()["error"]) == (401, "missing_signature")
    keyed = _post_event(stack, forged, {"Idempotency-Key": f"webhook:{shop_id}"})
    assert keyed.status_code == 401
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    delivery = post(stack, "shopify", shopify(shop_id))
    assert delivery.status_code == 202

    signed = json.dumps(envelope("evt_other", "webhook", source="shopify")).encode()
    _, secret = PROVIDER_SECRETS["shopify"]
    own = _send(stack, (signed, {"X-Shopify-Hmac-Sha256": sign_shopify(secret, signed)}))
    assert (own.status_code, own.json()["key"]) == (202, _shopify_key("evt_other"))


def test_sources_whose_slugs_collide_never_share_a_key(stack: Stack) -> None:
    """`my app` and `my-app` have the same slug: `my-app` sends, in its own namespace, the key
    `my app`'s event would get under a slug prefix (`my-app:noop.created:<its digest>`), and
    `my app`'s event is still new, in a namespace of its own."""
    external_id = f"c-{uuid.uuid4().hex[:8]}"
    digest = keys.derive_key("my app", "noop.created", external_id).rsplit(":", 1)[1]
    squat = _post_event(
        stack,
        envelope("squat", "noop.created", source="my-app"),
        {"Idempotency-Key": f"my-app:noop.created:{digest}"},
    )
    assert squat.status_code == 202
    assert squat.json()["key"] == f"my-app:noop.created:{digest}"
    genuine = _post_event(stack, envelope(external_id, "noop.created", source="My App"))
    assert genuine.status_code == 202, genuine.text
    namespace = keys.source_namespace("my app")
    assert genuine.json()["key"] == f"{namespace}:noop.created:{digest}"
    assert namespace.startswith("my-app~")


def test_with_signed_webhooks_required_a_signed_source_cannot_take_a_provider_key(
    stack: Stack, tmp_path: Path
) -> None:
    """REQUIRE_SIGNED_WEBHOOKS=true: a v2-signed event of the signing source that sends
    Shopify's key is stored under its own namespace, and Shopify's delivery is new (202)."""
    shop_id = f"evt_{uuid.uuid4().hex[:12]}"
    with other_receiver(stack, tmp_path, REQUIRE_SIGNED_WEBHOOKS="true") as strict:
        squat = _send(strict, _signed_payment("p-1", key=_shopify_key(shop_id)))
        delivery = post(strict, "shopify", shopify(shop_id))
    assert squat.status_code == 202, squat.text
    assert (delivery.status_code, delivery.json()["key"]) == (202, _shopify_key(shop_id))
    assert squat.json()["key"] == f"signed:{_shopify_key(shop_id)}"
