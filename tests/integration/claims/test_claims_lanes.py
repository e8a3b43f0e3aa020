"""Claims that name a lane, on real PostgreSQL: one holder per lane, waits given back with
Retry-After, versions superseded, the lane handed on by complete and fail."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import httpx

from tests.support import Stack, claim, claim_call, query


def _complete(stack: Stack, key: str, answer: httpx.Response) -> None:
    done = claim_call(stack, key, "complete", {"lease_token": answer.json()["lease_token"]})
    assert done.status_code == 200, done.text


def _fail(stack: Stack, key: str, answer: httpx.Response, *, retryable: bool) -> str:
    """`/fail` with the claim's token; the status it answers."""
    body = {
        "lease_token": answer.json()["lease_token"],
        "error_code": "crm",
        "retryable": retryable,
    }
    done = claim_call(stack, key, "fail", body)
    assert done.status_code == 200, done.text
    status: str = done.json()["status"]
    return status


def _lane_busy(answer: httpx.Response) -> int:
    """Retry-After of a 409 lane_busy answer."""
    assert answer.status_code == 409, answer.text
    assert answer.json()["status"] == "lane_busy"
    retry_after = int(answer.headers["retry-after"])
    assert retry_after == answer.json()["retry_after"] and retry_after >= 1
    return retry_after


def _superseded(answer: httpx.Response, key: str, by: str) -> dict[str, Any]:
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    assert body["status"] == "superseded" and body["key"] == key and body["superseded_by"] == by
    return body


def test_concurrent_claims_of_one_lane_get_one_holder_and_the_other_waits(stack: Stack) -> None:
    """Ten lanes, two keys each, twenty claims at once: in every lane exactly one holds it and
    the other gets 409 lane_busy with Retry-After (its key given back, its attempt unspent);
    after the holder completes, the other claims it."""
    keys = [(f"contact-{lane}", f"upd-{lane}-{n}") for lane in range(10) for n in range(2)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=20) as pool:
        answers = dict(
            zip(
                keys,
                pool.map(lambda k: claim(stack, k[1], lane=k[0], lease_seconds=30), keys),
                strict=True,
            )
        )
    for lane in range(10):
        mine = {
            key: answers[(f"contact-{lane}", key)] for key in (f"upd-{lane}-0", f"upd-{lane}-1")
        }
        holders = [key for key, answer in mine.items() if answer.status_code == 201]
        assert len(holders) == 1, {key: a.text for key, a in mine.items()}
        (waiter,) = set(mine) - set(holders)
        assert 1 <= _lane_busy(mine[waiter]) <= 30
        # Still held: asked again, still busy.
        _lane_busy(claim(stack, waiter, lane=f"contact-{lane}"))
        _complete(stack, holders[0], mine[holders[0]])
        after = claim(stack, waiter, lane=f"contact-{lane}")
        assert after.status_code == 201, after.text
        assert (
            after.json()["attempt"] == 1 and after.json()["previous_error_code"] == "lane_waiting"
        )
        _complete(stack, waiter, after)
    assert query(
        stack.database_url,
        "SELECT status, attempts, count(*) FROM idempotency_keys GROUP BY 1, 2",
    ) == [("succeeded", 1, 20)]
    # Workflow keys get no delivery: parking and handing on queued nothing for the worker.
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(0,)]
    assert query(stack.database_url, "SELECT DISTINCT route, ordering, on_failure FROM lanes") == [
        ("(claims)", "accepted", "skip")
    ]


def test_a_parked_claim_that_never_returns_does_not_hold_its_lane(stack: Stack) -> None:
    """A workflow told lane_busy may give up: its key waits, pending, and the lane still goes
    to the next claim once the holder is done."""
    first = claim(stack, "a", lane="order-1")
    _lane_busy(claim(stack, "b", lane="order-1"))
    _complete(stack, "a", first)
    third = claim(stack, "c", lane="order-1")
    assert third.status_code == 201, third.text
    _lane_busy(claim(stack, "b", lane="order-1"))
    assert query(
        stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys ORDER BY 1"
    ) == [("a", "succeeded"), ("b", "pending"), ("c", "processing")]


def test_failing_the_holder_hands_the_lane_on(stack: Stack) -> None:
    """A retryable failure and a permanent one (dead letter) both free the lane: a failed
    claim never blocks it."""
    first = claim(stack, "x1", lane="ticket-9")
    _lane_busy(claim(stack, "x2", lane="ticket-9"))
    assert _fail(stack, "x1", first, retryable=True) == "failed_retryable"
    second = claim(stack, "x2", lane="ticket-9")
    assert second.status_code == 201, second.text
    _lane_busy(claim(stack, "x1", lane="ticket-9"))
    assert _fail(stack, "x2", second, retryable=False) == "failed_final"
    again = claim(stack, "x1", lane="ticket-9")
    assert again.status_code == 201 and again.json()["uncertain"] is True
    assert query(
        stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys ORDER BY 1"
    ) == [("x1", "processing"), ("x2", "failed_final")]


def test_an_older_version_after_a_newer_one_completed_is_superseded(stack: Stack) -> None:
    """v2 completed, then v1 claimed: 200 superseded by "2", and the same answer to every
    later claim of v1; v1 never held a lease it could act on."""
    v2 = claim(stack, "contact-5-v2", lane="contact-5", version=2, correlation_id="c-2")
    assert v2.status_code == 201, v2.text
    _complete(stack, "contact-5-v2", v2)
    v1 = claim(stack, "contact-5-v1", lane="contact-5", version=1, correlation_id="c-1")
    assert _superseded(v1, "contact-5-v1", "2")["correlation_id"] == "c-1"
    assert claim(stack, "contact-5-v1", lane="contact-5", version=1).json() == v1.json()
    assert claim(stack, "contact-5-v1").json() == v1.json()
    assert query(
        stack.database_url,
        "SELECT k.idempotency_key, k.status, k.superseded_by, k.lane_rank, e.version"
        " FROM idempotency_keys k JOIN events e USING (idempotency_key) ORDER BY 1",
    ) == [
        ("contact-5-v1", "superseded", "2", 1, "1"),
        ("contact-5-v2", "succeeded", None, 2, "2"),
    ]
    assert query(stack.database_url, "SELECT ordering, applied_version FROM lanes") == [
        ("supersede", "2")
    ]


def test_a_newer_version_waits_for_the_holder_then_supersedes_a_later_older_one(
    stack: Stack,
) -> None:
    """v1 held while v3 is claimed: 409 lane_busy. v1 completes; v3 goes; v2 claimed while
    v3 runs is superseded by "3", and still is after v3 completes."""
    v1 = claim(stack, "p-v1", lane="product-1", version=1, lease_seconds=60)
    assert v1.status_code == 201, v1.text
    assert 1 <= _lane_busy(claim(stack, "p-v3", lane="product-1", version=3)) <= 60
    _complete(stack, "p-v1", v1)
    v3 = claim(stack, "p-v3", lane="product-1", version=3)
    assert v3.status_code == 201, v3.text
    _superseded(claim(stack, "p-v2", lane="product-1", version=2), "p-v2", "3")
    _complete(stack, "p-v3", v3)
    _superseded(claim(stack, "p-v2", lane="product-1", version=2), "p-v2", "3")
    assert query(
        stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys ORDER BY 1"
    ) == [("p-v1", "succeeded"), ("p-v2", "superseded"), ("p-v3", "succeeded")]
    assert query(stack.database_url, "SELECT applied_version FROM lanes") == [("3",)]


def test_timestamp_versions_compare_as_instants(stack: Stack) -> None:
    """RFC 3339 versions are compared in UTC, to the microsecond; superseded_by names the
    newer one in UTC."""
    newer = claim(stack, "t-new", lane="deal-1", version="2026-12-01T11:00:00.5+01:00")
    assert newer.status_code == 201, newer.text
    _complete(stack, "t-new", newer)
    older = claim(stack, "t-old", lane="deal-1", version="2026-12-01T10:00:00.499999Z")
    _superseded(older, "t-old", "2026-12-01T10:00:00.500000Z")
    later = claim(stack, "t-later", lane="deal-1", version="2026-12-01T10:00:00.500001Z")
    assert later.status_code == 201, later.text


def test_bad_lane_or_version_is_422_and_stores_nothing(stack: Stack) -> None:
    """A version that is not an integer or an RFC 3339 timestamp, a version without a lane and
    a lane that is not a label are refused before anything is stored."""
    for version in ("yesterday", "2026-12-01", "2026-12-01T10:00:00", "7", 1.5, True, 2**63):
        answer = claim(stack, "bad", lane="l", version=version)
        assert answer.status_code == 422, (version, answer.text)
        assert answer.json()["error"] == "version_invalid", version
    missing = claim(stack, "bad", version=3)
    assert missing.status_code == 422 and missing.json()["error"] == "lane_required"
    for lane in ("", "x" * 201, "line\nbreak"):
        answer = claim(stack, "bad", lane=lane)
        assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", lane
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_a_repeat_naming_another_lane_or_version_is_a_payload_mismatch(stack: Stack) -> None:
    """As with payloads: a claim that names a lane or version must name the key's own (422
    idempotency_key_reused, nothing changed); one that names none matches."""
    first = claim(stack, "m-1", lane="lane-a", version=4)
    _complete(stack, "m-1", first)
    for extra in ({"lane": "lane-b", "version": 4}, {"lane": "lane-a", "version": 5}):
        answer = claim(stack, "m-1", **extra)
        assert answer.status_code == 422 and answer.json()["error"] == "idempotency_key_reused"
    assert claim(stack, "m-1").json()["status"] == "already_succeeded"
    assert claim(stack, "m-1", lane="lane-a").json()["status"] == "already_succeeded"
    held = claim(stack, "m-2")
    assert held.status_code == 201
    laned = claim(stack, "m-2", lane="lane-a")
    assert laned.status_code == 422 and laned.json()["error"] == "idempotency_key_reused"
    assert query(
        stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys ORDER BY 1"
    ) == [("m-1", "succeeded"), ("m-2", "processing")]
