"""Providers posting straight to `POST /v1/webhooks/{source}` through the real receiver, relay
and worker: one event and one effect per provider event however often it is delivered, and
nothing stored for a request that is not correctly signed or cannot be keyed."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from outbox.ingest.provider_signatures import sign_github, sign_shopify, sign_standard, sign_stripe
from tests.support import PROVIDER_SECRETS, Downstream, Stack, query, wait_until

Delivery = tuple[bytes, dict[str, str]]
# Valid in every scheme's format (Standard Webhooks' is whsec_ + base64), known to no source.
WRONG_SECRET = "whsec_bm90IHRoZSBzZWNyZXQgb2YgYW55IHNvdXJjZQ=="


def standard(event_id: str, *, secret: str = PROVIDER_SECRETS["acme"][1]) -> Delivery:
    body = json.dumps(
        {"type": "invoice.paid", "timestamp": "2026-11-30T10:00:00Z", "data": {"id": "in_42"}}
    ).encode()
    stamp = int(time.time())
    return body, {
        "webhook-id": event_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign_standard(secret, event_id, stamp, body),
    }


def stripe(
    event_id: str, *, secret: str = PROVIDER_SECRETS["stripe"][1], kind: str = "succeeded"
) -> Delivery:
    body = json.dumps(
        {
            "id": event_id,
            "object": "event",
            "type": f"payment_intent.{kind}",
            "created": 1_800_000_000,
            "data": {"object": {"id": "pi_3Nabc", "amount": 4200, "currency": "eur"}},
        }
    ).encode()
    return body, {"Stripe-Signature": sign_stripe(secret, int(time.time()), body)}


def github(event_id: str, *, secret: str = PROVIDER_SECRETS["github"][1]) -> Delivery:
    body = json.dumps(
        {"action": "opened", "issue": {"number": 1347}, "repository": {"id": 1296269}}
    ).encode()
    return body, {
        "X-GitHub-Delivery": event_id,
        "X-GitHub-Event": "issues",
        "X-Hub-Signature-256": sign_github(secret, body),
    }


def shopify(event_id: str, *, secret: str = PROVIDER_SECRETS["shopify"][1]) -> Delivery:
    body = json.dumps({"id": 820982911946154508, "email": "jon@example.com"}).encode()
    return body, {
        "X-Shopify-Webhook-Id": event_id,
        "X-Shopify-Topic": "orders/create",
        "X-Shopify-Hmac-Sha256": sign_shopify(secret, body),
    }


PROVIDERS: dict[str, Callable[..., Delivery]] = {
    "acme": standard,
    "stripe": stripe,
    "github": github,
    "shopify": shopify,
}


def post(stack: Stack, source: str, delivery: Delivery) -> httpx.Response:
    body, headers = delivery
    with stack.client() as client:
        return client.post(
            f"/v1/webhooks/{source}",
            content=body,
            headers={"content-type": "application/json", **headers},
        )


def stored(stack: Stack) -> int:
    return int(query(stack.database_url, "SELECT count(*) FROM events")[0][0])


@pytest.mark.parametrize("source", PROVIDERS)
def test_one_delivery_three_times_is_one_event_and_one_effect(
    stack: Stack, downstream: Downstream, source: str
) -> None:
    """Two copies at once, then a third: one 202 and two 200 duplicates, one stored event, and
    the route's action ran once, with the provider's body."""
    delivery = PROVIDERS[source](f"evt_{uuid.uuid4().hex[:12]}")
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(lambda _: post(stack, source, delivery), range(2)))
    answers = [*together, post(stack, source, delivery)]
    assert sorted(a.status_code for a in answers) == [200, 200, 202], [a.text for a in answers]
    (key,) = {a.json()["key"] for a in answers}
    assert key.startswith(f"{source}:webhook:")
    for answer in answers:
        duplicate = answer.status_code == 200
        assert answer.json()["duplicate"] is duplicate
        assert (answer.headers.get("idempotent-replayed") == "true") is duplicate
    wait_until(
        lambda: query(stack.database_url, "SELECT status FROM idempotency_keys") == [("succeeded",)]
    )
    assert downstream.effects == {key: 1}
    assert stored(stack) == 1
    (request,) = downstream.requests
    assert request["body"] == json.loads(delivery[0])


@pytest.mark.parametrize("source", PROVIDERS)
def test_a_badly_signed_delivery_is_401_and_stores_nothing(stack: Stack, source: str) -> None:
    """A delivery signed with another secret, or with one byte of its body changed, is a 401
    and leaves no trace in the database."""
    wrong_secret = PROVIDERS[source]("evt_bad", secret=WRONG_SECRET)
    body, headers = PROVIDERS[source]("evt_bad")
    altered = (body.replace(b"}", b" }", 1), headers)
    for delivery in (wrong_secret, altered):
        answer = post(stack, source, delivery)
        assert answer.status_code == 401 and answer.json()["error"] == "invalid_signature"
    unsigned = post(stack, source, (body, {}))
    # Missing, like wrong, is the one answer of the public path (which scheme it lacks is logged).
    assert unsigned.status_code == 401 and unsigned.json()["error"] == "invalid_signature"
    assert stored(stack) == 0


def _answer(response: httpx.Response) -> tuple[int, bytes, dict[str, str]]:
    """Everything a sender sees of an answer but the time it was sent."""
    headers = {k: v for k, v in response.headers.items() if k.lower() != "date"}
    return response.status_code, response.content, headers


def test_an_unknown_source_answers_exactly_like_a_bad_signature(stack: Stack) -> None:
    """Whatever a stranger sends (a provider's headers with a wrong secret, a stale signature,
    no signature, another scheme's headers, a body over the limit), a source that is not
    configured gets the very answer a configured one gives: status, body and headers, so the
    path does not tell which sources exist; nothing is stored."""
    body, _ = stripe("evt_probe")
    stale = sign_stripe(PROVIDER_SECRETS["stripe"][1], int(time.time()) - 3600, body)
    probes: list[Delivery] = [
        stripe("evt_probe", secret=WRONG_SECRET),
        (body, {"Stripe-Signature": stale}),
        (body, {}),
        github("evt_probe", secret=WRONG_SECRET),
        (b"x" * (1_048_576 + 1), {}),
    ]
    for probe in probes:
        known = [_answer(post(stack, name, probe)) for name in PROVIDERS]
        unknown = _answer(post(stack, "paypal", probe))
        assert all(answer == unknown for answer in known), (unknown, known)
        assert unknown[0] in (401, 413)
    assert stored(stack) == 0


def test_unkeyable_body_and_forbidden_route(stack: Stack) -> None:
    """A signed body without its id is 400 naming the place; a provider event whose route does
    not take that source is 403, and the 403 names no route; nothing is stored."""
    body = b'{"type": "payment_intent.succeeded"}'
    stamp = int(time.time())
    signature = sign_stripe(PROVIDER_SECRETS["stripe"][1], stamp, body)
    no_id = post(stack, "stripe", (body, {"Stripe-Signature": signature}))
    assert no_id.status_code == 400
    assert (no_id.json()["error"], no_id.json()["location"]) == ("missing_event_id", "/id")
    garbage = b"not json"
    signature = sign_stripe(PROVIDER_SECRETS["stripe"][1], stamp, garbage)
    not_json = post(stack, "stripe", (garbage, {"Stripe-Signature": signature}))
    assert (not_json.status_code, not_json.json()["error"]) == (400, "invalid_json")
    body, headers = stripe("evt_2")
    body = body.replace(b"payment_intent.succeeded", b"payment.captured")
    headers = {"Stripe-Signature": sign_stripe(PROVIDER_SECRETS["stripe"][1], stamp, body)}
    forbidden = post(stack, "stripe", (body, headers))
    assert forbidden.status_code == 403 and forbidden.json()["error"] == "source_not_allowed"
    # The route taking `payment.*` is "payments", for the source `signed` only: neither shows.
    assert "payments" not in forbidden.text and "signed" not in forbidden.text
    assert stored(stack) == 0


def test_many_signed_stripe_events_at_once_are_each_stored_once(stack: Stack) -> None:
    """200 distinct signed Stripe-style events over 16 concurrent connections: 200 keys, every
    answer a 202, no error (the 1 000-event figure is in `make bench`)."""
    deliveries = [stripe(f"evt_many_{n}", kind="processing") for n in range(200)]
    with ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(lambda d: post(stack, "stripe", d).status_code, deliveries))
    assert statuses == [202] * 200
    keys = query(stack.database_url, "SELECT count(DISTINCT idempotency_key) FROM events")
    assert keys == [(200,)]
