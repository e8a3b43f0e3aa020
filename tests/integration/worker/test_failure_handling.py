"""Failure handling end to end: classified retries, dead letters, fencing, quarantine, a lost
broker and start-up timing checks, on real PostgreSQL, Redis and gateway processes."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import redis as redis_client

from outbox.core.settings import Settings
from outbox.store import lifecycle
from outbox.store.embedded import start_redis
from outbox.store.engines import create_sync_engine
from tests.support import (
    ROOT,
    Downstream,
    Reply,
    Stack,
    envelope,
    finished,
    key_state,
    query,
    queued_keys,
    seed_pending_key,
    wait_until,
)
from worker.store import Blocked, Claim, Failed, KeyStore


def _post(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code == 202, answer.text
    result: dict[str, Any] = answer.json()
    return result


def _dead_letters(database_url: str, key: str) -> list[tuple[Any, ...]]:
    return query(
        database_url,
        "SELECT kind, error_code, error_detail, attempts FROM dead_letters"
        " WHERE idempotency_key = %s ORDER BY id",
        (key,),
    )


# --- classified HTTP answers ------------------------------------------------------------------


def test_429_with_retry_after_is_retried_no_sooner_than_asked(
    stack: Stack, downstream: Downstream
) -> None:
    """A 429 with Retry-After: 1 is retried once, at least one second later, and succeeds."""
    downstream.behaviour = lambda _key, n: Reply(429, {"Retry-After": "1"}) if n == 1 else Reply()
    key = _post(stack, envelope("rate-1", event_type="plain.lead"))["key"]
    state = finished(stack, key)
    assert state["status"] == "succeeded"
    assert state["attempts"] == 2
    assert state["error_code"] is None
    assert state["external_ref"] == "task-1"
    assert downstream.effects == {key: 1}
    first, second = downstream.request_times(key)
    assert second - first >= 1.0, second - first
    assert _dead_letters(stack.database_url, key) == []
    assert query(
        stack.database_url,
        "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM outbox",
    ) == [(2, 0)]


def test_422_is_dead_lettered_at_once(stack: Stack, downstream: Downstream) -> None:
    """A permanent 422 answer ends the key in failed_final after one attempt, with one
    dead letter of kind permanent and no retry."""
    downstream.behaviour = lambda _key, _n: Reply(422)
    key = _post(stack, envelope("invalid-1"))["key"]
    state = finished(stack, key)
    assert state["status"] == "failed_final"
    assert state["attempts"] == 1
    assert state["error_code"] == "http_422"
    dead = _dead_letters(stack.database_url, key)
    assert [(kind, code, attempts) for kind, code, _, attempts in dead] == [
        ("permanent", "http_422", 1)
    ]
    assert len(downstream.request_times(key)) == 1
    assert downstream.effects == {}
    assert query(stack.database_url, "SELECT count(*) FROM outbox") == [(1,)]


def test_spent_budget_ends_in_retries_exhausted(stack: Stack, downstream: Downstream) -> None:
    """A downstream that always answers 503 gets exactly max_attempts (4) requests, then the
    key is failed_final with a retries_exhausted dead letter and no outbox row left to send."""
    downstream.behaviour = lambda _key, _n: Reply(503)
    key = _post(stack, envelope("down-1"))["key"]
    state = finished(stack, key)
    assert state["status"] == "failed_final"
    assert state["attempts"] == 4
    assert state["error_code"] == "http_503"
    dead = _dead_letters(stack.database_url, key)
    assert [(kind, code, attempts) for kind, code, _, attempts in dead] == [
        ("retries_exhausted", "http_503", 4)
    ]
    assert len(downstream.request_times(key)) == 4
    assert downstream.effects == {}
    # The first delivery plus three scheduled retries, all sent; nothing waits to be sent.
    assert query(
        stack.database_url,
        "SELECT count(*), count(*) FILTER (WHERE published_at IS NULL) FROM outbox",
    ) == [(4, 0)]


# --- fencing ----------------------------------------------------------------------------------


RETRY_503 = Failed("http_503", "downstream answered 503", uncertain=False, reconciled_absent=False)
FINAL_422 = Failed("http_422", "downstream answered 422", uncertain=False, reconciled_absent=False)


def test_stale_holder_cannot_write_after_its_lease_was_taken_over(own_database: str) -> None:
    """Once a key is reclaimed with a newer fence, every write of the old holder (succeed,
    renew, retry, dead letter) matches nothing and changes nothing, and so does a write with the
    current fence but another token; the new holder's writes land."""
    db = own_database
    key = seed_pending_key(db, "fenced")
    engine = create_sync_engine(Settings(database_url=db, redis_url="redis://x"))
    store = KeyStore(engine)

    def row() -> tuple[Any, ...]:
        return query(
            db,
            "SELECT status, fence, attempts, lease_owner, locked_until, result, external_ref,"
            " error_code, reclaimed_count FROM idempotency_keys WHERE idempotency_key = %s",
            (key,),
        )[0]

    try:
        stale = store.claim(key, "stale-worker", 1)
        assert isinstance(stale, Claim)
        assert (stale.fence, stale.attempt, stale.previous_status) == (1, 1, "pending")
        assert stale.payload == {"email": "a@b.c"}

        query(
            db,
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
            " in_flight_until = NULL"
            " WHERE idempotency_key = %s",
            (key,),
        )
        fresh = store.claim(key, "fresh-worker", 5)
        assert isinstance(fresh, Claim)
        assert (fresh.fence, fresh.attempt, fresh.previous_status) == (2, 2, "processing")
        # While the new lease is live, another delivery is refused.
        blocked = store.claim(key, "third-worker", 5)
        assert blocked == Blocked(status="processing", lease_live=True, actor="worker")

        before = row()
        assert before[:4] == ("processing", 2, 2, "fresh-worker")
        assert before[8] == 1  # reclaimed_count

        # The current fence with another token (a guessed or leaked number) is refused too.
        forged = dataclasses.replace(fresh, token=lifecycle.new_lease_token())
        for holder in (stale, forged):
            assert store.succeed(holder, {"status_code": 201}, "ref-stale") is False
            assert store.renew(holder, 5) is None
            assert store.schedule_retry(holder, 0.1, RETRY_503) is False
            assert store.fail_final(holder, "permanent", FINAL_422) is False
        assert row() == before
        assert query(db, "SELECT count(*) FROM outbox") == [(0,)]
        assert query(db, "SELECT count(*) FROM dead_letters") == [(0,)]

        assert store.succeed(fresh, {"status_code": 201}, "ref-fresh") is True
        after = row()
        assert after[0] == "succeeded" and after[1] == 2 and after[2] == 2
        assert after[5] == {"status_code": 201} and after[6] == "ref-fresh"
        assert after[3] is None and after[4] is None
        # A finished key takes no further write, even with the current fence.
        assert store.succeed(fresh, {"status_code": 500}, "ref-late") is False
        assert row() == after
    finally:
        engine.dispose()


# --- quarantine -------------------------------------------------------------------------------


def test_event_breaking_its_contract_is_quarantined_and_never_sent(
    stack: Stack, downstream: Downstream
) -> None:
    """An event missing a required field is accepted as quarantined with a dead letter that
    names the field but none of the payload's values, and it never reaches the downstream,
    while a compliant event of the same route does, once."""
    secret_payload = {"email": "grace.hopper@example.com", "name": "Grace Brewster Hopper"}
    answer = _post(stack, envelope("strict-bad", event_type="strict.lead", payload=secret_payload))
    bad_key = answer["key"]
    assert answer["status"] == "quarantined"
    quarantined_at = time.monotonic()

    state = key_state(stack, bad_key)
    assert state["status"] == "quarantined"
    assert state["attempts"] == 0
    assert state["error_code"] == "contract_violation"
    dead = _dead_letters(stack.database_url, bad_key)
    assert [(kind, code, attempts) for kind, code, _, attempts in dead] == [
        ("quarantined", "contract_violation", 0)
    ]
    details = [dead[0][2]] + [
        r[0]
        for r in query(
            stack.database_url,
            "SELECT error_detail FROM idempotency_keys WHERE idempotency_key = %s",
            (bad_key,),
        )
    ]
    for detail in details:
        assert "'phone'" in detail
        for value in secret_payload.values():
            assert value not in detail
        assert "grace" not in detail.lower()
    # No outbox row: nothing can ever publish it.
    assert query(
        stack.database_url, "SELECT count(*) FROM outbox WHERE idempotency_key = %s", (bad_key,)
    ) == [(0,)]

    # A repeat is answered by the same statement: counted, nothing else written (no second
    # event, no second dead letter).
    with stack.client() as client:
        again = client.post(
            "/v1/events",
            json=envelope("strict-bad", event_type="strict.lead", payload=secret_payload),
        )
    assert again.status_code == 200, again.text
    repeat = again.json()
    assert (repeat["key"], repeat["duplicate"], repeat["status"]) == (bad_key, True, "quarantined")
    assert query(
        stack.database_url,
        "SELECT k.duplicate_count, (SELECT count(*) FROM events e"
        " WHERE e.idempotency_key = k.idempotency_key) FROM idempotency_keys k"
        " WHERE k.idempotency_key = %s",
        (bad_key,),
    ) == [(1, 1)]
    assert len(_dead_letters(stack.database_url, bad_key)) == 1

    # A compliant event sent afterwards goes through the same relay and worker; once it has
    # succeeded, the quarantined one would have been sent too had it been queued.
    good_payload = {"email": "ok@example.com", "phone": "+1 555 0100"}
    good_key = _post(
        stack, envelope("strict-good", event_type="strict.lead", payload=good_payload)
    )["key"]
    good = finished(stack, good_key)
    assert good["status"] == "succeeded"
    assert good["attempts"] == 1

    def quiet_for_two_seconds() -> bool:
        assert downstream.request_times(bad_key) == []
        return time.monotonic() - quarantined_at >= 2.0

    wait_until(quiet_for_two_seconds, timeout=10)
    assert downstream.effects == {good_key: 1}
    assert [r["key"] for r in downstream.requests] == [good_key]
    assert key_state(stack, bad_key)["status"] == "quarantined"
    assert len(_dead_letters(stack.database_url, bad_key)) == 1
    assert _dead_letters(stack.database_url, good_key) == []


# --- a lost broker ----------------------------------------------------------------------------


def test_flushed_redis_with_messages_in_flight_is_recovered_by_the_sweeper(
    own_database: str, routes_file: Path, downstream: Downstream, tmp_path: Path
) -> None:
    """When Redis loses every queued message, the sweeper re-drives the waiting keys from the
    database, and each event still has exactly one effect."""
    db = own_database
    downstream.reset()
    redis, redis_url = start_redis(tmp_path / "redis", appendonly=False)
    broker = redis_client.Redis.from_url(redis_url)
    stack = Stack(db, redis_url, routes_file, tmp_path, extra_env={"RELAY_POLL_SECONDS": "0.2"})
    try:
        stack.start_receiver()
        stack.start_relay()
        stack.start_sweeper()
        keys = [_post(stack, envelope(f"flush-{i}"))["key"] for i in range(20)]
        assert len(set(keys)) == 20
        wait_until(
            lambda: (
                query(
                    db,
                    "SELECT count(DISTINCT idempotency_key) FROM outbox"
                    " WHERE published_at IS NOT NULL",
                )
                == [(20,)]
            ),
            timeout=30,
        )
        assert len(queued_keys(broker)) >= 20  # no worker yet: the messages wait in Redis
        broker.flushall()
        assert broker.dbsize() == 0
        assert query(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'pending'") == [
            (20,)
        ]

        stack.start_worker()
        wait_until(
            lambda: (
                query(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'")
                == [(20,)]
            ),
            timeout=60,
            interval=0.25,
        )
        assert downstream.effects == dict.fromkeys(keys, 1)
        assert query(db, "SELECT count(*) FROM dead_letters") == [(0,)]
        assert "sweeper.redrove" in stack.logs("sweeper")
        # Every key needed a second delivery: its first message was flushed.
        assert query(
            db,
            "SELECT count(*) FROM (SELECT idempotency_key FROM outbox GROUP BY 1"
            " HAVING count(*) >= 2) k",
        ) == [(20,)]
    finally:
        stack.stop_all()
        broker.close()
        redis.terminate()
        redis.wait(timeout=10)


# --- start-up timing checks -------------------------------------------------------------------


def _run_cli(stack: Stack, command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", command],
        env={**stack.env(), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_visibility_timeout_too_short_for_the_lease_refuses_to_start(
    routes_file: Path, tmp_path: Path
) -> None:
    """`serve` with VISIBILITY_TIMEOUT=6 and LEASE_SECONDS=5 exits with code 2, naming both."""
    # Nothing listens on these: the check must refuse before any connection is tried.
    stack = Stack(
        "postgresql+psycopg://idem@127.0.0.1:9/none", "redis://127.0.0.1:9/0", routes_file, tmp_path
    )
    done = _run_cli(stack, "serve", LEASE_SECONDS="5", VISIBILITY_TIMEOUT="6")
    assert done.returncode == 2, done.stderr
    assert "VISIBILITY_TIMEOUT=6" in done.stderr
    assert "LEASE_SECONDS=5" in done.stderr


def test_route_timeouts_not_below_the_lease_refuse_to_start(tmp_path: Path) -> None:
    """`serve` and `worker` refuse (code 2) a route whose connect + read timeout reaches
    LEASE_SECONDS, naming the route and the values."""
    routes = tmp_path / "slow.toml"
    routes.write_text(
        """
[[routes]]
match = "slow.*"
name = "slow-crm"
action = "http"
url = "http://127.0.0.1:9/tasks"
connect_timeout_seconds = 2
read_timeout_seconds = 3
""",
        encoding="utf-8",
    )
    stack = Stack(
        "postgresql+psycopg://idem@127.0.0.1:9/none", "redis://127.0.0.1:9/0", routes, tmp_path
    )
    for command in ("serve", "worker"):
        done = _run_cli(stack, command, LEASE_SECONDS="5")
        assert done.returncode == 2, (command, done.stderr)
        assert "'slow-crm'" in done.stderr
        assert "connect_timeout_seconds (2)" in done.stderr
        assert "read_timeout_seconds (3)" in done.stderr
        assert "LEASE_SECONDS=5" in done.stderr
        assert "VISIBILITY_TIMEOUT" not in done.stderr
