"""The attempt log end to end: each attempt written by the statement of its outcome, read the
same through the API and `idem show`, bounded per key, for worker and workflow keys alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from outbox.core.settings import Settings
from outbox.store.engines import create_sync_engine
from tests.support import (
    AUTH,
    ROOT,
    Downstream,
    Reply,
    Stack,
    claim,
    claim_call,
    envelope,
    finished,
    post_event,
    query,
    seed_pending_key,
    wait_until,
)
from worker.store import Claim, KeyStore

# The columns both read paths agree on.
SHOWN = ("attempt", "outcome", "status_code", "error_code", "fence", "reconciled")


def _api_log(stack: Stack, key: str) -> list[dict[str, Any]]:
    with stack.client() as client:
        answer = client.get(f"/v1/events/{key}/attempts", headers=AUTH)
    assert answer.status_code == 200, answer.text
    assert answer.json()["key"] == key
    rows: list[dict[str, Any]] = answer.json()["attempts"]
    return rows


def _idem_show(stack: Stack, key: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "DATABASE_URL": stack.database_url,
        "BROKER_URL": stack.broker_url,
        "ROUTES_FILE": str(stack.routes_file),
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "250",
    }
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "show", key, *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def refused_twice_then_lost_then_reconciled(stack: Stack, downstream: Downstream) -> str:
    """503, 503, then a write whose answer is lost (read timeout), then the reconcile finds it."""
    replies = {1: Reply(503), 2: Reply(503), 3: Reply(201, delay=2.5)}
    downstream.behaviour = lambda _key, n: replies.get(n, Reply())
    key = post_event(stack, envelope("log-1"))
    state = finished(stack, key)
    assert state["status"] == "succeeded" and state["attempts"] == 4, state
    assert downstream.effects == {key: 1}
    assert downstream.lookups == [key]
    return key


def test_every_attempt_is_logged_in_order_with_its_codes(
    stack: Stack, downstream: Downstream
) -> None:
    key = refused_twice_then_lost_then_reconciled(stack, downstream)
    log = _api_log(stack, key)
    assert [tuple(a[c] for c in SHOWN) for a in log] == [
        (1, "transient", 503, "http_503", 1, None),
        (2, "transient", 503, "http_503", 2, None),
        (3, "uncertain", None, "timeout_read", 3, None),
        (4, "reconciled_found", 200, None, 4, True),
    ]
    for row in log:
        assert row["worker"].count(":") == 2  # host:pid:thread
        assert row["started_at"] <= row["ended_at"]
        assert row["duration_ms"] >= 0
    assert log[0]["detail"] == "downstream answered 503"
    # The CLI reads the same rows.
    shown = _idem_show(stack, key, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"key": key, "attempts": log}
    table = _idem_show(stack, key)
    assert table.returncode == 0, table.stderr
    for outcome in ("transient", "uncertain", "reconciled_found", "http_503", "timeout_read"):
        assert outcome in table.stdout
    # An unknown key: a clear refusal on both paths.
    assert _idem_show(stack, "no:such:key").returncode == 2
    with stack.client() as client:
        missing = client.get("/v1/events/no:such:key/attempts", headers=AUTH)
    assert missing.status_code == 404 and missing.json()["error"] == "key_not_found"


def test_a_paused_route_logs_deferred_pause(stack: Stack, downstream: Downstream) -> None:
    with stack.client() as client:
        paused = client.post("/v1/routes/crm/pause", json={"reason": "maintenance"}, headers=AUTH)
    assert paused.status_code == 200, paused.text
    key = post_event(stack, envelope("log-paused"))
    wait_until(lambda: _api_log(stack, key), timeout=30)
    log = _api_log(stack, key)
    assert [(a["outcome"], a["error_code"], a["attempt"]) for a in log] == [
        ("deferred_pause", "route_paused", 1)
    ]
    assert downstream.requests == []


def test_a_workflow_key_logs_its_claim_and_complete(stack: Stack) -> None:
    taken = claim(stack, "wf:log:1", workflow="invoices")
    assert taken.status_code in (200, 201), taken.text
    done = claim_call(
        stack, "wf:log:1", "complete", {"lease_token": taken.json()["lease_token"], "result": {}}
    )
    assert done.status_code == 200, done.text
    log = _api_log(stack, "wf:log:1")
    assert [(a["attempt"], a["outcome"], a["fence"], a["worker"]) for a in log] == [
        (1, "claimed", 1, "invoices"),
        (1, "completed", 1, None),
    ]
    # The complete's attempt started at its claim.
    assert log[1]["started_at"] == log[0]["started_at"]


def test_the_log_keeps_the_newest_50_rows_of_a_key(stack: Stack) -> None:
    """60 claims and retryable fails of one workflow key: 120 attempts, the newest 50 kept."""
    key = "wf:log:bound"
    for _ in range(60):
        taken = claim(stack, key)
        assert taken.status_code in (200, 201), taken.text
        failed = claim_call(
            stack,
            key,
            "fail",
            {
                "lease_token": taken.json()["lease_token"],
                "error_code": "busy",
                "retryable": True,
                "effect": "none",
            },
        )
        assert failed.status_code == 200, failed.text
    log = _api_log(stack, key)
    assert len(log) == 50
    assert [a["outcome"] for a in log[-2:]] == ["claimed", "failed"]
    assert log[-1]["attempt"] == 60 and log[0]["attempt"] == 36
    assert query(stack.database_url, "SELECT count(*) FROM attempts") == [(50,)]


def test_a_lost_lease_is_logged_by_the_claim_that_takes_the_key_over(own_database: str) -> None:
    """The stale holder's writes log nothing (the fence refuses them); the reclaim logs its
    attempt as `lease_lost`, with its fence, worker and claim time, before the new one's."""
    db = own_database
    key = seed_pending_key(db, "lost-lease")
    engine = create_sync_engine(Settings(database_url=db, redis_url="redis://x"))
    store = KeyStore(engine)
    try:
        stale = store.claim(key, "stale-host:1:1", 5)
        assert isinstance(stale, Claim)
        query(
            db,
            "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
            " in_flight_until = NULL"
            " WHERE idempotency_key = %s",
            (key,),
        )
        fresh = store.claim(key, "fresh-host:2:2", 5)
        assert isinstance(fresh, Claim)
        assert store.succeed(stale, {"status_code": 201}, None) is False
        assert store.succeed(fresh, {"status_code": 201}, None) is True
        rows = query(
            db,
            "SELECT attempt, fence, outcome, error_code, worker, started_at, status_code"
            " FROM attempts WHERE idempotency_key = %s ORDER BY id",
            (key,),
        )
        assert [r[:5] for r in rows] == [
            (1, 1, "lease_lost", "lease_expired", "stale-host:1:1"),
            (2, 2, "succeeded", None, "fresh-host:2:2"),
        ]
        assert rows[0][5] == stale.claimed_at and rows[1][5] == fresh.claimed_at
        assert rows[1][6] == 201
    finally:
        engine.dispose()


def test_a_workflow_claim_whose_lease_ran_out_is_logged_expired(stack: Stack) -> None:
    """A claim whose lease ends unanswered: the next claim logs it `expired`, then its own."""
    first = claim(stack, "wf:log:expired", workflow="slow", lease_seconds=1)
    assert first.status_code in (200, 201), first.text
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT locked_until < now() FROM idempotency_keys WHERE idempotency_key = %s",
                ("wf:log:expired",),
            )
            == [(True,)]
        ),
        timeout=10,
    )
    second = claim(stack, "wf:log:expired", workflow="fast")
    assert second.status_code in (200, 201) and second.json()["reclaimed"] is True, second.text
    log = _api_log(stack, "wf:log:expired")
    assert [
        (a["attempt"], a["outcome"], a["fence"], a["worker"], a["error_code"]) for a in log
    ] == [
        (1, "claimed", 1, "slow", None),
        (1, "expired", 1, "slow", "lease_expired"),
        (2, "claimed", 2, "fast", None),
    ]
