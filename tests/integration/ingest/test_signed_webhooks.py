"""Signed webhooks through the real receiver: a signed source must sign, or nothing is stored."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from outbox.ingest.signatures import sign, sign_v2
from tests.support import WEBHOOK_SECRET, Stack, envelope, other_receiver, query


def _post(stack: Stack, body: bytes, headers: dict[str, str]) -> tuple[int, str]:
    with stack.client() as client:
        answer = client.post(
            "/v1/events", content=body, headers={"content-type": "application/json", **headers}
        )
    return answer.status_code, answer.json().get("error", "")


def _signed_v1(body: bytes, stamp: int) -> dict[str, str]:
    return {"X-Idem-Timestamp": str(stamp), "X-Idem-Signature": sign(WEBHOOK_SECRET, stamp, body)}


def _body(external_id: str = "sig-1") -> bytes:
    return json.dumps(envelope(external_id, "noop.signed", source="Signed")).encode()


def test_a_correctly_signed_event_is_accepted(stack: Stack) -> None:
    """The documented scheme, computed by the sender, is accepted."""
    body = _body()
    stamp = int(time.time())
    status, _ = _post(
        stack,
        body,
        _signed_v1(body, stamp),
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


def test_a_route_of_signed_sources_refuses_other_sources(stack: Stack) -> None:
    """`payment.*` takes only the signing source `signed`: an unsigned event naming another
    source is 403 source_not_allowed and stores nothing; a signed one of `signed` is accepted."""
    forged = json.dumps(envelope("pay-1", "payment.refund", source="x")).encode()
    status, error = _post(stack, forged, {})
    assert (status, error) == (403, "source_not_allowed")
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    body = json.dumps(envelope("pay-1", "payment.refund", source="signed")).encode()
    stamp = int(time.time())
    status, _ = _post(
        stack,
        body,
        _signed_v1(body, stamp),
    )
    assert status == 202


def test_an_idempotency_key_outside_the_signature_is_refused(stack: Stack) -> None:
    """A v1 signature does not cover Idempotency-Key: sent together they are 400
    unsigned_idempotency_key, and nothing is stored."""
    body = _body("sig-key-1")
    stamp = int(time.time())
    status, error = _post(
        stack,
        body,
        {
            "X-Idem-Timestamp": str(stamp),
            "X-Idem-Signature": sign(WEBHOOK_SECRET, stamp, body),
            "Idempotency-Key": "signed:sig-key-1",
        },
    )
    assert (status, error) == (400, "unsigned_idempotency_key")
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_a_v2_signature_binds_the_key_so_a_replay_cannot_change_it(stack: Stack) -> None:
    """A v2-signed request is stored under its signed Idempotency-Key; the same captured
    request re-sent with another key is 401, so it cannot become a second event."""
    body = _body("sig-key-2")
    stamp = int(time.time())
    headers = {
        "X-Idem-Timestamp": str(stamp),
        "X-Idem-Signature": sign_v2(WEBHOOK_SECRET, stamp, "signed:sig-key-2", body),
        "Idempotency-Key": "signed:sig-key-2",
    }
    assert _post(stack, body, headers)[0] == 202
    assert _post(stack, body, {**headers, "Idempotency-Key": "signed:other"}) == (
        401,
        "invalid_signature",
    )
    assert query(stack.database_url, "SELECT idempotency_key FROM idempotency_keys") == [
        ("signed:sig-key-2",)
    ]


def test_require_signed_webhooks_refuses_sources_without_a_secret(
    stack: Stack, tmp_path: Path
) -> None:
    """With REQUIRE_SIGNED_WEBHOOKS=true an event of a source with no secret is 401
    unknown_source and stores nothing; a signing source's signed event is accepted."""
    with other_receiver(stack, tmp_path, REQUIRE_SIGNED_WEBHOOKS="true") as strict:
        unsigned = _post(strict, json.dumps(envelope("plain-2", "noop.x")).encode(), {})
        body = _body("sig-3")
        stamp = int(time.time())
        signed = _post(
            strict,
            body,
            _signed_v1(body, stamp),
        )
    assert unsigned == (401, "unknown_source")
    assert signed[0] == 202
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(1,)]
