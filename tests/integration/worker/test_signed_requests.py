"""Signed outbound requests: on a route with signing secrets, every request the worker sends
carries a Standard Webhooks signature over the exact bytes the downstream received."""

from __future__ import annotations

import base64
import hashlib
import hmac
from typing import Any

from tests.support import (
    SIGNING_SECRET,
    SIGNING_SECRET_NEXT,
    Downstream,
    Reply,
    Stack,
    envelope,
    finished,
)


def _entries(secret: str, request: dict[str, Any]) -> bool:
    """Whether the request's signature header has an entry this secret's key produces over
    `webhook-id.webhook-timestamp.<raw body>`, computed here from the specification."""
    headers = {name.lower(): value for name, value in request["headers"].items()}
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + request["raw"]
    mac = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(f"v1,{mac}", e) for e in headers["webhook-signature"].split())


def _header(request: dict[str, Any], name: str) -> str:
    return next(v for k, v in request["headers"].items() if k.lower() == name)


def test_every_request_is_signed_over_its_raw_bytes_across_a_retry(
    stack: Stack, downstream: Downstream
) -> None:
    """A 500 (Retry-After: 1), the reconcile lookup and the successful re-send each carry a
    signature under both rotation secrets over the bytes received; webhook-id is the key every
    time and the re-send has a later timestamp."""
    downstream.behaviour = lambda _key, n: (
        Reply(500, {"Retry-After": "1"}, commit=False) if n == 1 else Reply()
    )
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope("signed-1", event_type="signed.lead"))
    assert answer.status_code == 202, answer.text
    key = answer.json()["key"]
    state = finished(stack, key)
    assert (state["status"], state["attempts"]) == ("succeeded", 2)
    posts = [r for r in downstream.requests if r["key"] == key]
    lookups = list(downstream.lookup_requests)
    assert len(posts) == 2
    assert len(lookups) == 1
    assert lookups[0]["raw"] == b""
    for request in [*posts, *lookups]:
        assert _header(request, "webhook-id") == key
        assert _entries(SIGNING_SECRET, request), request["headers"]
        assert _entries(SIGNING_SECRET_NEXT, request), request["headers"]
    first, second = (int(_header(r, "webhook-timestamp")) for r in posts)
    assert second > first
    assert posts[0]["raw"] == posts[1]["raw"]
    assert not _entries(SIGNING_SECRET, {**posts[0], "raw": posts[0]["raw"] + b" "})
