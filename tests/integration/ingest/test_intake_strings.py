"""Strings a sender controls that reach a log line, a metric label, a header or the audit
trail are checked at intake: a control character in an event type or a source, a line break
in a claim key given in the path, a tab in X-Operator are each a 4xx naming the field, and
nothing is stored or changed."""

from __future__ import annotations

import json
import time

import pytest

from outbox.ingest.provider_signatures import sign_standard
from tests.support import AUTH, PROVIDER_SECRETS, Stack, envelope, query


def _nothing_stored(stack: Stack) -> None:
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(0,)]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("event_type", "crm.lead.created\u001b[2J"),
        ("event_type", "crm.lead.\u202ecreated"),
        ("source", "web\u0007form"),
        ("source", "webform\u0085\u009b31m"),
    ],
    ids=["escape-sequence", "bidi-override", "bell", "c1-controls"],
)
def test_an_unprintable_source_or_event_type_is_422(stack: Stack, field: str, value: str) -> None:
    """A source or event type with a control or format character left after whitespace is
    folded is 422 `invalid_envelope`, the field named; nothing is stored."""
    with stack.client() as client:
        answer = client.post("/v1/events", json={**envelope("p-1"), field: value})
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"] == "invalid_envelope"
    assert [(e["field"], e["type"]) for e in answer.json()["errors"]] == [
        (field, "name_not_printable")
    ]
    _nothing_stored(stack)


def test_an_unprintable_provider_event_type_is_400(stack: Stack) -> None:
    """A correctly signed provider delivery whose event type holds a control character is 400
    `invalid_event_type` naming where it was read; nothing is stored."""
    body = json.dumps({"type": "invoice.paid\u001b[2J", "data": {"id": "in_1"}}).encode()
    stamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "webhook-id": "msg_p1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign_standard(PROVIDER_SECRETS["acme"][1], "msg_p1", stamp, body),
    }
    with stack.client() as client:
        answer = client.post("/v1/webhooks/acme", content=body, headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == "invalid_event_type"
    assert answer.json()["location"] == "/type"
    _nothing_stored(stack)


@pytest.mark.parametrize("action", ["heartbeat", "complete", "fail"])
def test_a_claim_key_in_the_path_follows_the_key_rules(stack: Stack, action: str) -> None:
    """A key with a line break in a claim's path is 422 naming `path.key` (it would reach a
    log line), not a lease_lost answer."""
    body = {"lease_token": "t", "error_code": "x", "retryable": False}
    if action != "fail":
        body = {"lease_token": "t"}
    with stack.client() as client:
        answer = client.post(f"/v1/claims/a%0D%0Ab/{action}", json=body)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in answer.json()["errors"]] == ["path.key"]


def test_an_operator_name_that_is_no_label_is_422_and_changes_nothing(stack: Stack) -> None:
    """X-Operator goes to the audit trail and log lines: a tab or a non-ASCII byte in it is
    422 naming the header, and the route is not paused."""
    for name in ("ops\tmallory", b"ops-\xe9"):
        with stack.client() as client:
            answer = client.post(
                "/v1/routes/crm/pause",
                json={"reason": "maintenance"},
                headers={**AUTH, "X-Operator": name},  # type: ignore[dict-item]
            )
        assert answer.status_code == 422, answer.text
        assert [e["field"] for e in answer.json()["errors"]] == ["header.x-operator"]
    assert query(stack.database_url, "SELECT count(*) FROM route_state WHERE paused") == [(0,)]
