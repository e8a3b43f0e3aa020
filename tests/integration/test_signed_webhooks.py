"""Signed webhooks through the real receiver: a signed source must sign, or nothing is stored."""

from __future__ import annotations

import json
import time

import pytest

from outbox.signatures import sign
from tests.support import WEBHOOK_SECRET, Stack, envelope, query


def _post(stack: Stack, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    with stack.client() as client:
        answer = client.post(
            "/v1/events", content=body, headers={"content-type": "application/json", **headers}
        )
    return answer.status_code, answer.json().get("error", "")


def _body(external_id: str = "sig-1") -> bytes:
    return json.dumps(envelope(external_id, "noop.signed", source="Signed")).encode()


def test_a_correctly_signed_event_is_accepted(stack: Stack) -> None:
    """The documented scheme, computed by the sender, is accepted."""
    body = _body()
    stamp = int(time.time())
    status, _ = _post(
        stack,
        body,
        {"X-Idem-Timestamp": str(stamp), "X-Idem-Signature": sign(WEBHOOK_SECRET, stamp, body)},
    )
    assert status == 202
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(1,)]


@pytest.mark.parametrize("case", ["missing", "bad", "too-old", "body-altered"])
def test_bad_signatures_get_401_and_nothing_is_stored(stack: Stack, case: str) -> None:
    """Missing, wrong, stale or mismatched signatures are refused before anything is written."""
    body = _body()
    stamp = int(time.time()) - (3600 if case == "too-old" else 0)
    signature = sign(WEBHOOK_SECRET, stamp, body)
    headers = {"X-Idem-Timestamp": str(stamp), "X-Idem-Signature": signature}
    if case == "missing":
        headers = {}
    elif case == "bad":
        headers["X-Idem-Signature"] = sign("not-the-secret-at-all", stamp, body)
    elif case == "body-altered":
        body = _body("sig-2")
    status, error = _post(stack, body, headers)
    assert status == 401
    assert error == {"missing": "missing_signature", "too-old": "stale_signature"}.get(
        case, "invalid_signature"
    )
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_sources_without_a_secret_stay_unsigned(stack: Stack) -> None:
    """A source with no configured secret is accepted unsigned (REQUIRE_SIGNED_WEBHOOKS off)."""
    status, _ = _post(stack, json.dumps(envelope("plain-1", "noop.x")).encode(), {})
    assert status == 202
