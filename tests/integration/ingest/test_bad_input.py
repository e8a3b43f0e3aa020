"""Bad input gets a clear 4xx with a machine-readable code, and nothing is stored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.support import AUTH, Stack, envelope, query

MALFORMED: list[tuple[str, Any, dict[str, str], int, str]] = [
    ("not json", b"{nope", {}, 400, "invalid_json"),
    ("NaN is not JSON", b'{"a": NaN}', {}, 400, "invalid_json"),
    ("empty body", b"", {}, 400, "invalid_json"),
    ("array body", b"[1, 2]", {}, 422, "invalid_envelope"),
    ("missing fields", json.dumps({"source": "x"}).encode(), {}, 422, "invalid_envelope"),
    (
        "payload not an object",
        json.dumps({**envelope("a"), "payload": [1]}).encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "unknown member",
        json.dumps({**envelope("a"), "evnt_type": "x"}).encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "blank source",
        json.dumps({**envelope("a"), "source": "   "}).encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "boolean external id",
        json.dumps({**envelope("a"), "external_id": True}).encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "number overflowing a double",
        json.dumps(envelope("a")).replace('"Ada"', "1e400").encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "negative number overflowing a double",
        json.dumps(envelope("a")).replace('"Ada"', "[-1e400]").encode(),
        {},
        422,
        "invalid_envelope",
    ),
    (
        "key with a space",
        json.dumps(envelope("a")).encode(),
        {"Idempotency-Key": "a b"},
        400,
        "invalid_idempotency_key",
    ),
    (
        "key too long",
        json.dumps(envelope("a")).encode(),
        {"Idempotency-Key": "k" * 256},
        400,
        "invalid_idempotency_key",
    ),
]


@pytest.mark.parametrize(
    ("case", "body", "headers", "status", "error"), MALFORMED, ids=[m[0] for m in MALFORMED]
)
def test_malformed_input_is_refused_and_nothing_is_stored(
    stack: Stack, case: str, body: bytes, headers: dict[str, str], status: int, error: str
) -> None:
    """Each malformed request gets its own 4xx code as problem+json; no row is written."""
    with stack.client() as client:
        answer = client.post(
            "/v1/events", content=body, headers={"content-type": "application/json", **headers}
        )
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["error"] == error
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(0,)]


def test_field_level_detail_names_the_fields(stack: Stack) -> None:
    """A malformed envelope's answer lists each bad field without echoing its value."""
    with stack.client() as client:
        answer = client.post(
            "/v1/events",
            json={"source": "s", "event_type": "t", "external_id": "secret@example.com"},
        )
    fields = {e["field"] for e in answer.json()["errors"]}
    assert fields == {"payload"}
    assert "secret@example.com" not in answer.text


def test_body_over_the_limit_is_413(stack: Stack) -> None:
    """A body above the configured size (1 MiB by default) is refused before parsing."""
    big = envelope("big")
    big["payload"]["blob"] = "x" * (1_048_576 + 10)
    with stack.client() as client:
        declared = client.post("/v1/events", json=big)
        streamed = client.post(
            "/v1/events",
            content=iter([json.dumps(big).encode()]),
            headers={"content-type": "application/json"},
        )
    for answer in (declared, streamed):
        assert answer.status_code == 413
        assert answer.json()["error"] == "payload_too_large"
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_event_type_without_a_route_is_refused(stack: Stack, tmp_path: Path) -> None:
    """An event type no route accepts gets 422 no_route: it would have nowhere to go."""
    routes = tmp_path / "routes.toml"
    routes.write_text('[[routes]]\nmatch = "crm.*"\naction = "noop"\n', encoding="utf-8")
    narrow = Stack(stack.database_url, stack.broker_url, routes, tmp_path)
    narrow.start_receiver()
    try:
        with narrow.client() as client:
            answer = client.post("/v1/events", json=envelope("a", event_type="billing.x"))
    finally:
        narrow.stop_all()
    assert answer.status_code == 422
    assert answer.json()["error"] == "no_route"
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_unknown_path_and_method_are_problem_documents(stack: Stack) -> None:
    """Routing errors use the same problem+json shape as everything else."""
    with stack.client() as client:
        missing = client.get("/v2/nothing")
        wrong = client.delete("/v1/events")
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")
    assert (wrong.status_code, wrong.json()["error"]) == (405, "method_not_allowed")


def _raw_post(stack: Stack, path: str, text: str) -> Any:
    with stack.client() as client:
        return client.post(path, content=text, headers={"content-type": "application/json"})


def test_claim_payload_or_result_overflowing_a_double_is_422_and_changes_nothing(
    stack: Stack,
) -> None:
    """A claim payload or a claim result holding `1e400` (a JSON number no double holds) gets
    422 invalid_request; no key is created and a held key stays as it was."""
    refused = _raw_post(stack, "/v1/claims", '{"key": "k-inf", "payload": {"amount": 1e400}}')
    assert refused.status_code == 422, refused.text
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["error"] == "invalid_request"
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]

    with stack.client() as client:
        claimed = client.post("/v1/claims", json={"key": "k-held", "payload": {"amount": 1}})
    assert claimed.status_code == 201, claimed.text
    token = claimed.json()["lease_token"]
    before = query(stack.database_url, "SELECT status, fence, result FROM idempotency_keys")
    completed = _raw_post(
        stack,
        "/v1/claims/k-held/complete",
        f'{{"lease_token": "{token}", "result": {{"total": [-1e400]}}}}',
    )
    assert completed.status_code == 422, completed.text
    assert completed.json()["error"] == "invalid_request"
    assert query(stack.database_url, "SELECT status, fence, result FROM idempotency_keys") == before


@pytest.mark.parametrize(
    "since",
    ["1000000w", "9" * 400 + "s", "99999999999999999999d"],
    ids=["a-million-weeks", "400-digits", "20-digit-days"],
)
def test_an_operator_time_filter_out_of_range_is_422(stack: Stack, since: str) -> None:
    """A relative `since` too far back for a calendar (`1000000w`) gets 422 invalid_request from
    the dead-letter list and the replay dry run alike, and no replay is recorded."""
    with stack.client() as client:
        listed = client.get("/v1/dead-letters", params={"since": since}, headers=AUTH)
        replay = client.post(
            "/v1/replays",
            json={"statuses": ["failed_final"], "since": since},
            headers={**AUTH, "X-Operator": "ops-alice"},
        )
    for answer in (listed, replay):
        assert answer.status_code == 422, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["error"] == "invalid_request"
    assert query(stack.database_url, "SELECT count(*) FROM replays") == [(0,)]


@pytest.mark.parametrize("field", ["correlation_id", "workflow", "execution_id"])
def test_a_label_that_cannot_be_a_header_is_422_naming_the_field(stack: Stack, field: str) -> None:
    """A non-ASCII correlation id, workflow or execution id is refused at intake with 422, the
    field and the rule named, and nothing stored (events and claims alike)."""
    with stack.client() as client:
        event = client.post("/v1/events", json=envelope("label-1", **{field: "caf\u00e9"}))
        claim = client.post("/v1/claims", json={"key": "label-1", field: "a\r\nb"})
    assert event.status_code == 422, event.text
    assert event.json()["error"] == "invalid_envelope"
    assert [(e["field"], e["type"]) for e in event.json()["errors"]] == [
        (field, "label_not_visible_ascii")
    ]
    if field != "execution_id":  # the claims API takes no execution id
        assert claim.status_code == 422, claim.text
        assert [(e["field"], e["type"]) for e in claim.json()["errors"]] == [
            (f"body.{field}", "label_not_visible_ascii")
        ]
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(0,)]
