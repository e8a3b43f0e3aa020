"""The handoff matrix: every way a key changes hands, against a downstream that applies a request
late (after its client gave up, or after its client was killed or frozen), counted there.

For each handoff the last request of the key may still land when the next holder would look it
up; the in-flight rule (docs/explanation/architecture.md, "The in-flight rule") keeps everyone off
the key
until it can no longer land, so the lookup finds the late effect and nothing is sent again. An
ordered object ends at its highest version. The statements a live run cannot reach at the
right moment (a resume, a circuit release, a backfill after a purge, a re-drive after the
outbox was pruned) are run directly, on the same database.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Connection, create_engine, text

from outbox.core.keys import DELIVERY_SEPARATOR
from outbox.core.wire import PROCESS_TASK
from outbox.operate import stats
from outbox.store import maintenance, routes
from tests.support import (
    CLAIMS_TOKEN,
    Downstream,
    Reply,
    Stack,
    query,
    replay,
    seed_fan_out_event,
    wait_until,
)

LONG_AGO = datetime(2000, 1, 1, tzinfo=UTC)


def _routes(path: Path, url: str) -> Path:
    """Connect 0.5 + read 2 + margin 1: a request may land until 3.5 s after it was given up
    on (`crm`: read 3.5, 5 s); the stack's lease is 5 s."""
    common = f"""action = "http"
url = "{url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{url}/tasks/by-key/{{key}}"
connect_timeout_seconds = 0.5
in_flight_margin_seconds = 1
backoff_base_seconds = 0.1
backoff_cap_seconds = 0.5
"""
    path.write_text(
        f"""
[[routes]]
match = "crm.*"
name = "crm"
read_timeout_seconds = 3.5
{common}
[[routes]]
match = "once.*"
name = "once"
read_timeout_seconds = 2
max_attempts = 1
{common}
[[routes]]
match = "contact.*"
name = "contacts"
read_timeout_seconds = 2
order_by = "/contact/id"
versions = "supersede"
max_attempts = 1
{common}
[[routes]]
match = "profile.*"
name = "profiles"
read_timeout_seconds = 2
order_by = "/contact/id"
versions = "supersede"
lane_on_failure = "skip"
max_attempts = 1
{common}
[[routes]]
match = "feed.*"
name = "feed"
read_timeout_seconds = 2
order_by = "/contact/id"
lane_on_failure = "skip"
max_attempts = 1
{common}
""",
        encoding="utf-8",
    )
    return path


def _send(stack: Stack, event_type: str, obj: str, n: int = 1, *, versioned: bool = False) -> str:
    """Update `n` of object `obj` (its version `n` when `versioned`)."""
    body: dict[str, Any] = {
        "source": "crm",
        "event_type": event_type,
        "external_id": f"{obj}-{n}",
        "payload": {"contact": {"id": obj}, "v": n},
    }
    if versioned:
        body["version"] = n
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


def _status(stack: Stack, key: str) -> tuple[str, bool]:
    rows = query(
        stack.database_url,
        "SELECT status, uncertain FROM idempotency_keys WHERE idempotency_key = %s",
        (key,),
    )
    return rows[0] if rows else ("", False)


def _started(stack: Stack, routes_file: Path, url: str, *, sweeper: bool = True) -> Stack:
    _routes(routes_file, url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=4)
    if sweeper:
        stack.start_sweeper()
    return stack


def _first_late(late: float, then: Callable[[], None] = lambda: None) -> Callable[..., Reply]:
    """The first request the downstream sees is applied `late` seconds after it arrived,
    unanswered (after `then` ran, in the request's own thread); every other is answered at
    once."""
    seen: list[str] = []

    def reply(key: str, number: int) -> Reply:
        seen.append(key)
        if len(seen) == 1:
            then()
            return Reply(late=late)
        return Reply()

    return reply


@pytest.mark.parametrize("how", ["sigkill", "sigstop"])
def test_a_takeover_after_the_lease_waits_for_the_holders_request(
    protected: tuple[Stack, Path], downstream: Downstream, how: str
) -> None:
    """The worker holding the key is killed (or frozen: its renewals stop) while its request is
    at the downstream, which applies it 9 s later: after the 5 s lease ran out and the sweeper
    re-drove the key, before the lease's end plus the window (5 s). The next worker may not
    claim it before then; its lookup finds the late effect: one effect, one request."""
    stack, routes_file = protected
    _started(stack, routes_file, downstream.url)
    worker = stack.processes["worker"]
    sig = signal.SIGKILL if how == "sigkill" else signal.SIGSTOP
    downstream.behaviour = _first_late(9.0, then=lambda: os.kill(worker.pid, sig))
    key = _send(stack, "crm.lead", "a")
    wait_until(lambda: downstream.requests, timeout=20)
    stack.start_worker("worker-b", concurrency=4)
    try:
        wait_until(lambda: _status(stack, key)[0] == "succeeded", timeout=40, interval=0.2)
    finally:
        if how == "sigstop":
            os.kill(worker.pid, signal.SIGCONT)
    assert downstream.effects[key] == 1
    assert len(downstream.request_times(key)) == 1
    assert downstream.lookups.count(key) >= 1


def test_a_replay_of_an_uncertain_dead_letter_waits_for_its_request(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """The only attempt's request times out (read 2 s) and is dead-lettered uncertain; the
    downstream applies it a second after the client gave up. An operator replays it at once:
    the replay's delivery is due only once the request can no longer land, and its lookup
    finds the effect."""
    stack, routes_file = protected
    _started(stack, routes_file, downstream.url)
    downstream.behaviour = _first_late(3.0)
    key = _send(stack, "once.lead", "b")
    wait_until(lambda: _status(stack, key) == ("failed_final", True), timeout=20, interval=0.1)
    replay(stack, [key])
    wait_until(lambda: _status(stack, key)[0] == "succeeded", timeout=30, interval=0.2)
    assert downstream.effects[key] == 1
    assert len(downstream.request_times(key)) == 1


@pytest.mark.parametrize(
    ("event_type", "versioned"),
    [("contact.updated", True), ("profile.updated", True), ("feed.item", False)],
    ids=["supersede-block", "supersede-skip", "accepted-skip"],
)
def test_a_lane_is_not_handed_on_past_an_uncertain_write(
    protected: tuple[Stack, Path], downstream: Downstream, event_type: str, versioned: bool
) -> None:
    """v1's request times out and is dead-lettered uncertain while v2 waits; the downstream
    applies v1 a second after the client gave up. Under every mode the uncertain dead letter
    holds the lane (it is shown blocked, `held_by` uncertain); v2 is not applied and v1 is
    not superseded. Replayed, v1's lookup finds its effect, then v2 runs: the object ends at
    version 2, each version applied once, in order."""
    stack, routes_file = protected
    _started(stack, routes_file, downstream.url, sweeper=False)
    downstream.behaviour = _first_late(3.0)
    first = _send(stack, event_type, "obj", 1, versioned=versioned)
    wait_until(lambda: downstream.requests, timeout=20)
    second = _send(stack, event_type, "obj", 2, versioned=versioned)
    wait_until(lambda: _status(stack, first) == ("failed_final", True), timeout=20)
    wait_until(lambda: downstream.effects[first] == 1, timeout=20)
    # Given the time a hand-on would have taken: nothing moved.
    wait_until(lambda: _status(stack, second)[0] == "pending", timeout=10)
    threading.Event().wait(2.0)
    assert downstream.effects[second] == 0
    assert _status(stack, first) == ("failed_final", True)
    engine = create_engine(stack.database_url)
    try:
        held = stats.blocked_lanes(engine, older_than_seconds=0)
    finally:
        engine.dispose()
    assert [(lane["held_by"], lane["waiting"]) for lane in held] == [("uncertain", 1)]
    replay(stack, [first])
    wait_until(lambda: _status(stack, second)[0] == "succeeded", timeout=30, interval=0.2)
    assert _status(stack, first)[0] == "succeeded"
    assert [key for key, _ in downstream.applied] == [first, second]
    assert downstream.effects[first] == downstream.effects[second] == 1


def test_a_workflows_reclaim_after_its_lease_waits_for_the_last_request(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """A workflow claims (lease 1 s), sends its request, and vanishes; the downstream applies
    it 2 s later. Claims inside CLAIMS_IN_FLIGHT_SECONDS (3) after the lease are refused as
    in progress, with the time left; the claim after it is uncertain, and the workflow's
    lookup finds the effect: one effect."""
    stack, routes_file = protected
    stack.extra_env["CLAIMS_IN_FLIGHT_SECONDS"] = "3"
    _started(stack, routes_file, downstream.url, sweeper=False)
    key = "wf-invoice-1"
    headers = {"Authorization": f"Bearer {CLAIMS_TOKEN}"}

    def run_workflow(client: httpx.Client) -> httpx.Response:
        claimed = client.post("/v1/claims", json={"key": key, "lease_seconds": 1}, headers=headers)
        if claimed.status_code != 201:
            return claimed
        found = httpx.get(f"{downstream.url}/tasks/by-key/{key}").status_code == 200
        if not found:
            downstream.behaviour = _first_late(2.0)
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(
                    f"{downstream.url}/tasks",
                    json={},
                    headers={"Idempotency-Key": key},
                    timeout=0.5,
                )
        return claimed

    with httpx.Client(base_url=stack.url, timeout=15) as client:
        assert run_workflow(client).status_code == 201
        threading.Event().wait(1.2)  # the lease ran out; the request lands at 2 s
        refused = run_workflow(client)
        assert refused.status_code == 409, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        wait_until(lambda: run_workflow(client).status_code == 201, timeout=15, interval=0.5)
    assert downstream.effects[key] == 1
    assert len(downstream.request_times(key)) == 1


@contextlib.contextmanager
def _transaction(database_url: str) -> Iterator[Connection]:
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            yield conn
    finally:
        engine.dispose()


def _held_key(database_url: str, key: str, status: str, error_code: str) -> None:
    """A worker key of route `crm` whose last request may land for 30 s more."""
    _key(database_url, key, status, error_code)
    query(
        database_url,
        "UPDATE idempotency_keys SET uncertain = true,"
        " in_flight_until = now() + interval '30 seconds' WHERE idempotency_key = %s",
        (key,),
    )


def _key(database_url: str, key: str, status: str, error_code: str) -> None:
    """A worker key of route `crm`, due now, with its event and no outbox row."""
    query(
        database_url,
        """
        INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,
                                      event_type, route, status, error_code, next_attempt_at,
                                      expires_at)
        VALUES (%s, 'h', 'c', 'crm', 'crm.lead', 'crm', %s, %s, now(),
                now() + interval '1 day')
        """,
        (key, status, error_code),
    )
    query(
        database_url,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " VALUES (%s, 'crm', 'crm.lead', %s, '{}')",
        (key, key),
    )


def test_a_resume_and_a_circuit_release_queue_no_earlier_than_the_last_request(
    own_database: str,
) -> None:
    """A paused route's key and a key held by an open circuit, each with a request that may
    land for 30 s more: resuming the route and releasing the circuit make them due then, not
    now."""
    _held_key(own_database, "resumed", "pending", "route_paused")
    _held_key(own_database, "released", "failed_retryable", "circuit_open")
    query(
        own_database,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " VALUES ('released', %s, 'c')",
        (PROCESS_TASK,),
    )
    query(own_database, "INSERT INTO route_state (route, circuit) VALUES ('crm', 'closed')")
    with _transaction(own_database) as conn:
        conn.execute(
            routes.ENQUEUE_RESUMED, {"route": "crm", "batch": 10, "task_name": PROCESS_TASK}
        )
        conn.execute(routes.RELEASE_CIRCUIT_HELD, {"route": "crm", "batch": 10})
    due = dict(
        query(
            own_database,
            "SELECT o.idempotency_key, o.available_at >= k.in_flight_until"
            "  FROM outbox o JOIN idempotency_keys k USING (idempotency_key)"
            " WHERE o.published_at IS NULL",
        )
    )
    assert due == {"resumed": True, "released": True}


def test_a_backfill_after_a_purge_delivers_nothing_again(own_database: str) -> None:
    """An event's `archive` delivery was made by a backfill, finished, and purged after its TTL
    while the event stayed: the same backfill again adds nothing."""
    from outbox.store import ingest

    event = seed_fan_out_event(own_database, "inv-9", {"books": "succeeded"})
    params = {"destination": "archive", "separator": DELIVERY_SEPARATOR, "task_name": PROCESS_TASK}
    with _transaction(own_database) as conn:
        added = conn.execute(ingest.ADD_DELIVERIES, {**params, "keys": [event]}).scalar()
        assert added == 1
        conn.execute(
            text("DELETE FROM idempotency_keys WHERE event_key = :e AND destination = 'archive'"),
            {"e": event},
        )
        page = {"route": "billing", "destination": "archive", "until": None, "limit": 10}
        missing = conn.execute(
            ingest.MISSING_DELIVERIES,
            {**page, "since": LONG_AGO, "after_at": LONG_AGO, "after_key": ""},
        ).all()
        again = conn.execute(ingest.ADD_DELIVERIES, {**params, "keys": [event]}).scalar()
    assert missing == []
    assert again == 0


def test_a_key_whose_outbox_rows_were_pruned_is_re_driven(own_database: str) -> None:
    """A retry that was due long ago, its message lost and its outbox rows pruned by the
    retention: the sweeper's stalled-key re-drive queues it again."""
    _key(own_database, "pruned", "failed_retryable", "http_503")
    query(
        own_database,
        "UPDATE idempotency_keys SET next_attempt_at = now() - interval '1 hour',"
        " updated_at = now() - interval '1 hour'",
    )
    with _transaction(own_database) as conn:
        queued = conn.execute(
            maintenance.REDRIVE_STALLED_KEYS,
            {"grace_seconds": 60, "limit": 10, "task_name": PROCESS_TASK},
        ).all()
    assert [row[0] for row in queued] == ["pruned"]


def test_no_re_drive_while_a_request_may_land(own_database: str) -> None:
    """An expired lease whose holder's request may land for 30 s more, and a stalled retry
    likewise: neither is re-driven yet."""
    _held_key(own_database, "expired", "processing", "")
    _held_key(own_database, "stalled", "failed_retryable", "timeout_read")
    query(
        own_database,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 hour',"
        " next_attempt_at = now() - interval '1 hour', updated_at = now() - interval '1 hour'",
    )
    params = {"grace_seconds": 1, "limit": 10, "task_name": PROCESS_TASK}
    with _transaction(own_database) as conn:
        expired = conn.execute(maintenance.REDRIVE_EXPIRED_LEASES, params).all()
        stalled = conn.execute(maintenance.REDRIVE_STALLED_KEYS, params).all()
    assert expired == [] and stalled == []
