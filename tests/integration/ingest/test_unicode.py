"""A string that is not Unicode text (a lone surrogate, sent as the JSON escape `\\ud800`) is
refused at intake on every endpoint that takes a JSON body: 400 `invalid_unicode` naming the
member, nothing stored, and no traceback in the receiver's log."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from outbox.ingest.provider_signatures import sign_standard
from tests.support import AUTH, PROVIDER_SECRETS, Stack, query

# Lone surrogates as JSON escapes, spelled in the body as a sender would (json.dumps writes
# them so: its default ensure_ascii escapes every non-ASCII character).
HIGH = "\\ud800"
LOW = "\\uDC00"

EVENT = (
    '{"source": "webform", "event_type": "crm.lead.created", "external_id": %s, "payload": {%s}}'
)

# name: (path, body, extra headers, the member named)
CASES: dict[str, tuple[str, str, dict[str, str], str]] = {
    "event payload value": (
        "/v1/events",
        EVENT % ('"u-1"', f'"email": "a@example.com", "name": "Ada{HIGH}"'),
        {},
        "payload.name",
    ),
    "event payload key": (
        "/v1/events",
        EVENT % ('"u-2"', f'"na{LOW}me": "Ada"'),
        {},
        "payload.na\ufffdme",
    ),
    "nested payload value": (
        "/v1/events",
        EVENT % ('"u-3"', f'"items": [{{"sku": "x"}}, {{"sku": "{HIGH}{LOW[:-4]}dbff"}}]'),
        {},
        "payload.items.1.sku",
    ),
    "event external_id": ("/v1/events", EVENT % (f'"u-{HIGH}"', '"n": 1'), {}, "external_id"),
    "claim payload": (
        "/v1/claims",
        f'{{"key": "claim-u-1", "payload": {{"note": "{HIGH}"}}}}',
        {},
        "payload.note",
    ),
    "claim member name": ("/v1/claims", f'{{"key": "claim-u-2", "x{HIGH}": 1}}', {}, "x\ufffd"),
    "dedupe member name": (
        "/v1/claims/dedupe",
        f'{{"key": "dedupe-u-1", "ttl_seconds": 60, "{LOW}": 1}}',
        {},
        "\ufffd",
    ),
    "replay key": (
        "/v1/replays",
        f'{{"keys": ["k-{HIGH}"]}}',
        {**AUTH, "X-Operator": "ops"},
        "keys.0",
    ),
}


def _post(stack: Stack, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    with stack.client() as client:
        return client.post(
            path, content=body, headers={"content-type": "application/json", **headers}
        )


def _stored(stack: Stack) -> list[tuple[Any, ...]]:
    return query(
        stack.database_url,
        "SELECT (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM events),"
        " (SELECT count(*) FROM outbox), (SELECT count(*) FROM replays)",
    )


def _assert_refused(stack: Stack, answer: httpx.Response, field: str) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["error"] == "invalid_unicode"
    assert [(e["field"], e["type"]) for e in problem["errors"]] == [(field, "lone_surrogate")]
    assert _stored(stack) == [(0, 0, 0, 0)]
    assert "Traceback" not in stack.logs("receiver")


@pytest.mark.parametrize("case", CASES)
def test_a_lone_surrogate_is_400_naming_the_member(stack: Stack, case: str) -> None:
    """A lone surrogate in a value or a member's name of any JSON body is 400
    `invalid_unicode` with the member's path; nothing is stored, nothing is traced."""
    path, body, headers, field = CASES[case]
    _assert_refused(stack, _post(stack, path, body.encode(), headers), field)


def test_a_lone_surrogate_in_a_signed_provider_body_is_400(stack: Stack) -> None:
    """A correctly signed provider delivery whose body holds a lone surrogate is 400
    `invalid_unicode` naming the member; nothing is stored."""
    body = f'{{"type": "invoice.paid", "data": {{"id": "in_1", "name": "{HIGH}"}}}}'.encode()
    stamp = int(time.time())
    headers = {
        "webhook-id": "msg_u1",
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign_standard(PROVIDER_SECRETS["acme"][1], "msg_u1", stamp, body),
    }
    _assert_refused(stack, _post(stack, "/v1/webhooks/acme", body, headers), "data.name")


def test_an_escaped_backslash_before_ud_is_text(stack: Stack) -> None:
    """`"\\\\ud800"` is a backslash followed by letters, not an escape: the event is taken."""
    body = EVENT % ('"u-ok"', '"path": "C:\\\\ud800"')
    answer = _post(stack, "/v1/events", body.encode(), {})
    assert answer.status_code == 202, answer.text
