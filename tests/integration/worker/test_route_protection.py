"""Protecting the downstream, on real processes: the circuit breaker through an outage, the
rate and in-flight limits across worker processes (one of them SIGKILLed), pause and resume,
and a Retry-After that opens one route's circuit only. Counted at the fake downstream.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.chaos.plan import max_trials
from tests.support import (
    AUTH,
    Downstream,
    Reply,
    Stack,
    all_in,
    envelope,
    key_rows,
    query,
    wait_until,
)


def _routes(path: Path, url: str, **outage: Any) -> Path:
    """Routes of these tests: each its own event-type family, all at the fake downstream."""
    breaker = "\n".join(f"{name} = {value}" for name, value in outage.items())
    common = f"""action = "http"
url = "{url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{url}/tasks/by-key/{{key}}"
connect_timeout_seconds = 1
read_timeout_seconds = 2
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
"""
    path.write_text(
        f"""
[[routes]]
match = "outage.*"
name = "outage"
{common}circuit_minimum_calls = 1
{breaker}

[[routes]]
match = "paced.*"
name = "paced"
{common}rate_per_second = 10

[[routes]]
match = "narrow.*"
name = "narrow"
{common}max_in_flight = 3

[[routes]]
match = "ordered.*"
name = "ordered"
{common}
[[routes]]
match = "busy.*"
name = "busy"
{common}
[[routes]]
match = "other.*"
name = "other"
{common}""",
        encoding="utf-8",
    )
    return path


def _post(stack: Stack, body: dict[str, Any]) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    return key


def _all_succeeded(stack: Stack, keys: list[str]) -> bool:
    return all_in(stack.database_url, keys, "succeeded")


@pytest.mark.parametrize(
    ("outage", "events", "cooldown", "cap"),
    [
        pytest.param(10.0, 50, 1.0, 4.0, id="10s"),
        pytest.param(60.0, 200, 10.0, 300.0, id="60s-default-cooldown", marks=pytest.mark.slow),
    ],
)
def test_an_outage_spends_attempts_only_on_requests_sent_and_loses_no_event(
    protected: tuple[Stack, Path],
    downstream: Downstream,
    outage: float,
    events: int,
    cooldown: float,
    cap: float,
) -> None:
    """The downstream answers 503 to everything while events arrive: the circuit opens, only the
    attempts already on their way and the half-open trials reach it, and after it recovers
    every event succeeds exactly once, with no dead letter; every attempt a key spent is a
    request the downstream received (keys held back unsent cost nothing).

    The circuit opens at the first failure here (a minimum of one call), so the bound on what
    reaches a dead downstream is the attempts in flight plus the trials of each half-open spell.
    """
    stack, routes = protected
    _routes(
        routes,
        downstream.url,
        circuit_cooldown_seconds=cooldown,
        circuit_cooldown_cap_seconds=cap,
    )
    # Keys due together travel packed, two to a message; attempts in flight stay within the
    # worker's concurrency (worker/slots.py).
    stack.extra_env["RELAY_KEYS_PER_MESSAGE"] = "2"
    stack.start_receiver()
    stack.start_relay()
    concurrency = 4
    stack.start_worker(concurrency=concurrency)
    started = time.monotonic()
    outage_ends = started + outage
    downstream.behaviour = lambda key, n: (
        Reply(503) if time.monotonic() < outage_ends else Reply(201)
    )
    keys = []
    for number in range(events):
        keys.append(_post(stack, envelope(f"out-{number}", event_type="outage.lead")))
        # The events arrive through the outage, not in one burst before it.
        time.sleep(max(0.0, started + (number + 1) * outage / (events + 1) - time.monotonic()))
    wait_until(lambda: _all_succeeded(stack, keys), timeout=outage + cap + 60, interval=0.5)

    during = [r for r in downstream.requests if r["at"] < outage_ends]
    # At most the attempts in flight when the first failure opened the circuit, plus trials.
    bound = concurrency + max_trials(outage, cooldown, cap, trials=3)
    assert len(during) <= bound, (len(during), bound)
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]
    assert downstream.effects == {key: 1 for key in keys}
    attempts = [attempts for _, attempts in key_rows(stack.database_url, keys).values()]
    assert sum(attempts) == len(downstream.requests), (sum(attempts), len(downstream.requests))
    log = stack.logs("worker")
    assert '"route.circuit_opened"' in log and '"route.circuit_closed"' in log


def _route(stack: Stack, name: str) -> dict[str, Any]:
    with stack.client() as client:
        answer = client.get("/v1/routes", headers=AUTH)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = next(r for r in answer.json()["items"] if r["name"] == name)
    return found


def test_pause_holds_events_pending_and_resume_runs_them_once_in_acceptance_order(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Events of a paused route are accepted and wait as pending without spending an attempt;
    on resume each succeeds once, in the order accepted (one attempt at a time: the resumed
    keys travel packed, and a worker of concurrency 1 runs a message's keys one after another,
    so the order of deliveries is the order of requests), and both changes are on record."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=1)
    with stack.client() as client:
        paused = client.post(
            "/v1/routes/ordered/pause",
            json={"reason": "CRM maintenance"},
            headers={**AUTH, "X-Operator": "ada"},
        )
    assert paused.status_code == 200 and paused.json()["changed"] is True, paused.text
    keys = [_post(stack, envelope(f"ord-{n}", event_type="ordered.lead")) for n in range(12)]

    def all_held() -> bool:
        rows = query(
            stack.database_url,
            "SELECT status, attempts, error_code FROM idempotency_keys WHERE route = 'ordered'",
        )
        unpublished = query(
            stack.database_url, "SELECT count(*) FROM outbox WHERE published_at IS NULL"
        )
        return unpublished == [(0,)] and rows == [("pending", 0, "route_paused")] * len(keys)

    wait_until(all_held, timeout=30)
    assert downstream.requests == []
    shown = _route(stack, "ordered")
    assert (shown["state"], shown["backlog"], shown["paused_by"]) == ("paused", 12, "ada")
    with stack.client() as client:
        stats = client.get("/v1/stats", headers=AUTH).json()
        resumed = client.post("/v1/routes/ordered/resume", headers={**AUTH, "X-Operator": "ada"})
    assert stats["routes"]["ordered"]["state"] == "paused"
    assert stats["routes"]["ordered"]["backlog"] == 12
    assert resumed.status_code == 200 and resumed.json()["queued"] == 12, resumed.text

    wait_until(lambda: _all_succeeded(stack, keys), timeout=30)
    assert [r["key"] for r in downstream.requests] == keys
    assert downstream.effects == {key: 1 for key in keys}
    assert {attempts for _, attempts in key_rows(stack.database_url, keys).values()} == {1}
    audit = query(
        stack.database_url,
        "SELECT route, action, reason, requested_by FROM route_changes ORDER BY id",
    )
    assert audit == [
        ("ordered", "pause", "CRM maintenance", "ada"),
        ("ordered", "resume", None, "ada"),
    ]


def test_retry_after_longer_than_the_backoff_cap_opens_that_route_only(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """A 429 with Retry-After: 30 on one key opens its route's circuit for at least 30 s: that
    route's later events wait unspent without a request, while another route keeps going."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker()
    downstream.behaviour = lambda key, n: (
        Reply(429, {"Retry-After": "30"}) if "busy.lead" in key else Reply(201)
    )
    first = _post(stack, envelope("busy-0", event_type="busy.lead"))
    opened = wait_until(
        lambda: query(
            stack.database_url,
            "SELECT EXTRACT(EPOCH FROM open_until - opened_at), open_reason FROM route_state"
            " WHERE route = 'busy' AND circuit = 'open'",
        ),
        timeout=30,
    )
    ((cooldown, reason),) = opened
    assert cooldown >= 30, cooldown
    assert "retry_after" in reason
    busy = [_post(stack, envelope(f"busy-{n}", event_type="busy.lead")) for n in range(1, 4)]
    other = [_post(stack, envelope(f"other-{n}", event_type="other.lead")) for n in range(3)]
    wait_until(lambda: _all_succeeded(stack, other), timeout=30)

    def busy_waiting() -> bool:
        rows = query(
            stack.database_url,
            "SELECT k.status, k.attempts, k.error_code,"
            " k.next_attempt_at >= r.opened_at + interval '30 seconds'"
            " FROM idempotency_keys k JOIN route_state r ON r.route = k.route"
            " WHERE k.idempotency_key = ANY(%s)",
            (busy,),
        )
        return rows == [("failed_retryable", 0, "circuit_open", True)] * len(busy)

    wait_until(busy_waiting, timeout=30)
    assert [r["key"] for r in downstream.requests if "busy.lead" in r["key"]] == [first]
    assert downstream.effects == {key: 1 for key in other}
    assert _route(stack, "busy")["state"] == "open"
    assert _route(stack, "other")["state"] == "closed"


@pytest.mark.parametrize(
    ("events", "window", "workers"),
    [
        pytest.param(60, 5.0, 2, id="5s"),
        pytest.param(260, 20.0, 2, id="20s", marks=pytest.mark.slow),
    ],
)
def test_rate_per_second_holds_across_two_worker_processes(
    protected: tuple[Stack, Path],
    downstream: Downstream,
    events: int,
    window: float,
    workers: int,
) -> None:
    """With rate_per_second = 10 and a backlog, two worker processes together send 10 requests
    a second (within 10 %, counted over the window from the downstream's arrival times), and
    every event succeeds once."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    stack.start_relay()
    for number in range(workers):
        stack.start_worker(f"worker-{number}", concurrency=4)
    # Warm both workers (connections, first imports) so the window starts on time.
    warm = [_post(stack, envelope(f"warm-{n}", event_type="other.lead")) for n in range(8)]
    wait_until(lambda: _all_succeeded(stack, warm), timeout=30)
    downstream.reset()
    stack.stop("relay")  # the whole backlog is there before its first delivery
    keys = [_post(stack, envelope(f"rate-{n}", event_type="paced.lead")) for n in range(events)]
    stack.start_relay()
    wait_until(lambda: _all_succeeded(stack, keys), timeout=events / 10 + 60, interval=0.5)
    times = sorted(r["at"] for r in downstream.requests)
    assert len(times) == events
    sent = sum(1 for t in times if t < times[0] + window)
    expected = 10 * window
    assert 0.9 * expected <= sent <= 1.1 * expected, (sent, expected)
    assert downstream.effects == {key: 1 for key in keys}
    assert {attempts for _, attempts in key_rows(stack.database_url, keys).values()} == {1}


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def test_max_in_flight_holds_even_when_a_worker_dies_holding_permits(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """With max_in_flight = 3, the downstream never sees more than 3 requests at once from two
    worker processes, also after one is SIGKILLed in the middle of its requests (its permits
    free themselves when its leases run out); every event succeeds exactly once."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_sweeper()
    stack.start_worker("worker-a", concurrency=6)
    stack.start_worker("worker-b", concurrency=6)
    downstream.behaviour = lambda key, n: Reply(201, delay=0.5)
    keys = [_post(stack, envelope(f"narrow-{n}", event_type="narrow.lead")) for n in range(24)]
    wait_until(lambda: downstream.in_flight >= 2 and len(downstream.effects) >= 4, timeout=30)
    doomed = stack.processes["worker-a"]
    for pid in [*_children(doomed.pid), doomed.pid]:
        os.kill(pid, signal.SIGKILL)
    doomed.wait(timeout=10)
    wait_until(lambda: _all_succeeded(stack, keys), timeout=90, interval=0.5)
    assert downstream.peak_in_flight == 3
    assert downstream.effects == {key: 1 for key in keys}
