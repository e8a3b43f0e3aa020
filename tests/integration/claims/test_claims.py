"""The claims API on real PostgreSQL: every answer, races for one key, lease expiry, stale
tokens. The same key store as the event path."""

from __future__ import annotations

import concurrent.futures

from tests.support import Stack, claim, claim_call, envelope, query, wait_until


def test_claim_then_complete_then_already_succeeded(stack: Stack) -> None:
    """Claim, complete, and every later claim gets the stored result and original correlation
    id without a lease."""
    first = claim(
        stack,
        "lead-7",
        payload={"email": "a@example.com"},
        correlation_id="c-1",
        workflow="crm-sync",
    )
    assert first.status_code == 201
    body = first.json()
    assert body["status"] == "claimed" and body["reclaimed"] is False
    assert body["correlation_id"] == "c-1" and body["locked_until"]
    done = claim_call(
        stack,
        "lead-7",
        "complete",
        {"lease_token": body["lease_token"], "result": {"task": "T-9"}, "external_ref": "T-9"},
    )
    assert done.status_code == 200 and done.json()["status"] == "succeeded"
    again = claim(stack, "lead-7", payload={"email": "a@example.com"}, correlation_id="c-2")
    assert again.status_code == 200
    assert again.json() == {
        "status": "already_succeeded",
        "key": "lead-7",
        "result": {"task": "T-9"},
        "external_ref": "T-9",
        "correlation_id": "c-1",
    }
    assert query(
        stack.database_url, "SELECT status, attempts, workflow_name FROM idempotency_keys"
    ) == [("succeeded", 1, "crm-sync")]


def test_a_live_lease_answers_409_in_progress_with_retry_after(stack: Stack) -> None:
    """While another caller holds the lease, a claim gets 409 in_progress and Retry-After."""
    claim(stack, "busy", lease_seconds=60)
    second = claim(stack, "busy")
    assert second.status_code == 409
    assert second.json()["status"] == "in_progress"
    assert 1 <= int(second.headers["retry-after"]) <= 60


def test_same_key_with_another_payload_is_refused(stack: Stack) -> None:
    """A claim with a different payload than the key was created with gets 422."""
    claim(stack, "pay-1", payload={"amount": 10})
    other = claim(stack, "pay-1", payload={"amount": 11})
    assert other.status_code == 422
    assert other.json()["error"] == "idempotency_key_reused"


def test_twenty_callers_racing_for_one_key_get_one_claim(stack: Stack) -> None:
    """Twenty simultaneous claims of a new key: exactly one 201, nineteen 409."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(lambda _: claim(stack, "race", payload={"x": 1}), range(20)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [201] + [409] * 19


def test_an_expired_lease_is_reclaimed_by_exactly_one_caller(stack: Stack) -> None:
    """After the lease expires, twenty racing callers produce one reclaim (reclaimed: true) and
    the old holder's token is refused."""
    old = claim(stack, "stale", payload={"x": 1}).json()["lease_token"]
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
        " in_flight_until = NULL",
    )
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        answers = list(pool.map(lambda _: claim(stack, "stale", payload={"x": 1}), range(20)))
    winners = [a.json() for a in answers if a.status_code == 201]
    assert len(winners) == 1 and winners[0]["reclaimed"] is True and winners[0]["attempt"] == 2
    assert sorted(a.status_code for a in answers).count(409) == 19
    for action, body in (
        ("heartbeat", {}),
        ("complete", {"result": 1}),
        ("fail", {"error_code": "x", "retryable": True}),
    ):
        stale = claim_call(stack, "stale", action, {"lease_token": old, **body})
        assert stale.status_code == 409 and stale.json()["status"] == "lease_lost"
    assert query(
        stack.database_url, "SELECT status, reclaimed_count, result FROM idempotency_keys"
    ) == [("processing", 1, None)]


def test_heartbeat_extends_the_lease(stack: Stack) -> None:
    """A heartbeat with the current token moves locked_until forward."""
    token = claim(stack, "hb", lease_seconds=5).json()["lease_token"]
    before = query(stack.database_url, "SELECT locked_until FROM idempotency_keys")[0][0]
    beat = claim_call(stack, "hb", "heartbeat", {"lease_token": token, "lease_seconds": 120})
    after = query(stack.database_url, "SELECT locked_until FROM idempotency_keys")[0][0]
    assert beat.status_code == 200 and after > before


def test_fail_retryable_frees_the_key_and_fail_final_writes_a_dead_letter(stack: Stack) -> None:
    """A retryable failure lets the next claim in; a permanent one ends in a dead letter and
    further claims get 409 with the final status."""
    token = claim(stack, "crm-down").json()["lease_token"]
    soft = claim_call(
        stack,
        "crm-down",
        "fail",
        {
            "lease_token": token,
            "error_code": "http_503",
            "retryable": True,
            "detail": "crm said 503",
        },
    )
    assert soft.json()["status"] == "failed_retryable"
    retry = claim(stack, "crm-down")
    assert retry.status_code == 201 and retry.json()["previous_error_code"] == "http_503"
    hard = claim_call(
        stack,
        "crm-down",
        "fail",
        {
            "lease_token": retry.json()["lease_token"],
            "error_code": "http_422",
            "retryable": False,
            "detail": "rejected; Authorization: Bearer abc123",
        },
    )
    assert hard.json()["status"] == "failed_final"
    assert query(
        stack.database_url, "SELECT kind, error_code, error_detail, attempts FROM dead_letters"
    ) == [("permanent", "http_422", "rejected; Authorization: [redacted]", 2)]
    after = claim(stack, "crm-down")
    assert after.status_code == 409 and after.json()["status"] == "failed_final"


def test_an_event_key_is_not_a_claim_key(stack: Stack) -> None:
    """A key created by an event belongs to the gateway's worker: a claim of it, finished or
    still pending, answers 409 not_a_claim_key and changes nothing."""
    with stack.client() as client:
        key = client.post("/v1/events", json=envelope("shared-1", "noop.thing")).json()["key"]
        wait_until(lambda: client.get(f"/v1/events/{key}").json()["status"] == "succeeded")
    before = query(stack.database_url, "SELECT status, fence, attempts FROM idempotency_keys")
    answer = claim(stack, key)
    assert answer.status_code == 409 and answer.json()["error"] == "not_a_claim_key"
    assert (
        query(stack.database_url, "SELECT status, fence, attempts FROM idempotency_keys") == before
    )


def test_bad_claim_requests_are_4xx(stack: Stack) -> None:
    """Malformed claims get 422 with field detail, never a 500."""
    with stack.client() as client:
        for body in (
            {},
            {"key": ""},
            {"key": "has space"},
            {"key": "k", "lease_seconds": 0},
            {"key": "k", "unknown": 1},
        ):
            answer = client.post("/v1/claims", json=body)
            assert answer.status_code == 422, (body, answer.text)
        bad_fail = client.post("/v1/claims/k/fail", json={"lease_token": "t"})
        assert bad_fail.status_code == 422


def test_busy_retry_after_estimates_the_run_from_how_long_it_has_been_held(stack: Stack) -> None:
    """A key held 10 s (by the database's clock) under a 120 s lease is answered with
    Retry-After 10 or 11 s, not the lease's remainder; one held longer than its lease has
    left is answered with that remainder; a fresh hold with at least 1 s."""
    claim(stack, "estimate", lease_seconds=120)
    fresh = int(claim(stack, "estimate").headers["retry-after"])
    assert 1 <= fresh < 110
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET updated_at = now() - interval '10 seconds'"
        " WHERE idempotency_key = 'estimate'",
    )
    assert int(claim(stack, "estimate").headers["retry-after"]) in (10, 11)
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET updated_at = now() - interval '1000 seconds',"
        " locked_until = now() + interval '30 seconds' WHERE idempotency_key = 'estimate'",
    )
    assert int(claim(stack, "estimate").headers["retry-after"]) in (29, 30)


def test_a_repeated_complete_or_fail_is_answered_with_what_it_recorded(stack: Stack) -> None:
    """The same call sent again after its answer was lost: a complete is confirmed with the
    stored reference, a fail with its status, each marked `repeated` and changing nothing (one
    dead letter, one attempt logged). Another outcome with that token, a forged token, or the
    old token after a new claim still get `lease_lost`."""
    token = claim(stack, "twice-done").json()["lease_token"]
    body = {"lease_token": token, "result": {"task": "T-1"}, "external_ref": "T-1"}
    first = claim_call(stack, "twice-done", "complete", body)
    assert first.json() == {"status": "succeeded", "key": "twice-done", "external_ref": "T-1"}
    again = claim_call(stack, "twice-done", "complete", {**body, "external_ref": "T-2"})
    assert again.status_code == 200
    assert again.json() == {
        "status": "succeeded",
        "key": "twice-done",
        "external_ref": "T-1",
        "repeated": True,
    }
    other = claim_call(
        stack, "twice-done", "fail", {"lease_token": token, "error_code": "x", "retryable": True}
    )
    assert other.status_code == 409 and other.json()["status"] == "lease_lost"
    forged = token.split(".")[0] + ".not-the-token"
    assert (
        claim_call(stack, "twice-done", "complete", {**body, "lease_token": forged}).json()[
            "status"
        ]
        == "lease_lost"
    )

    token = claim(stack, "twice-failed").json()["lease_token"]
    hard = {"lease_token": token, "error_code": "http_422", "retryable": False, "detail": "no"}
    for _ in range(2):
        answer = claim_call(stack, "twice-failed", "fail", hard)
        assert answer.status_code == 200 and answer.json()["status"] == "failed_final"
    assert answer.json()["repeated"] is True
    assert query(
        stack.database_url,
        "SELECT count(*) FROM dead_letters WHERE idempotency_key = 'twice-failed'",
    ) == [(1,)]
    assert query(
        stack.database_url,
        "SELECT outcome FROM attempts WHERE idempotency_key = 'twice-failed' ORDER BY id",
    ) == [("claimed",), ("failed",)]

    token = claim(stack, "twice-soft").json()["lease_token"]
    soft = {"lease_token": token, "error_code": "http_503", "retryable": True}
    assert claim_call(stack, "twice-soft", "fail", soft).json()["status"] == "failed_retryable"
    assert claim_call(stack, "twice-soft", "fail", soft).json()["repeated"] is True
    assert claim(stack, "twice-soft").status_code == 201
    stale = claim_call(stack, "twice-soft", "fail", soft)
    assert stale.status_code == 409 and stale.json()["status"] == "lease_lost"
