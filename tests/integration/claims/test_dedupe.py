"""`POST /v1/claims/dedupe` on real PostgreSQL: test-and-mark in one call, races, the TTL, and
keys of other uses left alone."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx

from tests.support import Stack, claim, envelope, query


def dedupe(stack: Stack, key: str, ttl_seconds: Any = 60, **extra: Any) -> httpx.Response:
    with stack.client() as client:
        return client.post(
            "/v1/claims/dedupe", json={"key": key, "ttl_seconds": ttl_seconds, **extra}
        )


def test_first_call_is_new_then_seen_with_first_seen_at(stack: Stack) -> None:
    first = dedupe(stack, "dd-1")
    assert first.status_code == 201
    assert first.json() == {"seen": False, "key": "dd-1"}
    again = dedupe(stack, "dd-1")
    assert again.status_code == 200
    body = again.json()
    assert body["seen"] is True and body["first_seen_at"] and body["expires_at"]
    [(status, actor, result, lease, ttl)] = query(
        stack.database_url,
        "SELECT status, actor, result, lease_token,"
        " round(EXTRACT(EPOCH FROM expires_at - created_at))"
        " FROM idempotency_keys WHERE idempotency_key = 'dd-1'",
    )
    assert (status, actor, result, lease) == ("succeeded", "workflow", {"dedupe": True}, None)
    assert ttl == 60


def test_two_concurrent_calls_give_exactly_one_new(stack: Stack) -> None:
    for round_ in range(5):
        key = f"race-{round_}"
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            answers = list(pool.map(lambda k: dedupe(stack, k), [key, key]))
        assert sorted(a.status_code for a in answers) == [200, 201]
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(lambda _: dedupe(stack, "race-20"), range(20)))
    assert sorted(a.status_code for a in answers) == [200] * 19 + [201]


def test_a_mark_past_its_ttl_is_new_again(stack: Stack) -> None:
    dedupe(stack, "dd-ttl", ttl_seconds=1)
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
        " WHERE idempotency_key = 'dd-ttl'",
    )
    assert dedupe(stack, "dd-ttl").status_code == 201
    assert dedupe(stack, "dd-ttl").status_code == 200


def test_keys_of_other_uses_are_refused_409_and_left_alone(stack: Stack) -> None:
    held = claim(stack, "claimed-key", lease_seconds=60)
    assert held.status_code == 201
    refused = dedupe(stack, "claimed-key")
    assert refused.status_code == 409
    assert refused.json()["error"] == "key_in_other_use"
    with stack.client() as client:
        key = client.post("/v1/events", json=envelope("dd-evt", "noop.thing")).json()["key"]
    assert dedupe(stack, key).json()["error"] == "key_in_other_use"
    assert query(
        stack.database_url,
        "SELECT status FROM idempotency_keys WHERE idempotency_key = 'claimed-key'",
    ) == [("processing",)]


def test_a_dedupe_key_is_not_claimed(stack: Stack) -> None:
    """A claim of a dedupe key takes no lease: the key is finished."""
    dedupe(stack, "dd-claim")
    answer = claim(stack, "dd-claim")
    assert answer.status_code == 200 and answer.json()["status"] == "already_succeeded"


def test_bad_dedupe_requests_are_422_with_a_code(stack: Stack) -> None:
    for body in (
        {"key": "k"},
        {"key": "k", "ttl_seconds": 0},
        {"key": "k", "ttl_seconds": "x"},
        {"key": "", "ttl_seconds": 5},
        {"key": "k", "ttl_seconds": 5, "lease_seconds": 5},
    ):
        with stack.client() as client:
            answer = client.post("/v1/claims/dedupe", json=body)
        assert answer.status_code == 422, body
        assert answer.json()["error"], body
