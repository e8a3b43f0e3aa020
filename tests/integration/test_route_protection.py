"""Protecting the downstream, on real processes: the circuit breaker through an outage, the
rate and in-flight limits across worker processes (one of them SIGKILLed), pause and resume,
and a Retry-After that opens one route's circuit only. Counted at the fake downstream.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from outbox import embedded
from tests.support import (
    AUTH,
    Downstream,
    Reply,
    Stack,
    envelope,
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
{common}circuit_failure_threshold = 1
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


@pytest.fixture
def protected(
    own_database: str, downstream: Downstream, tmp_path: Path
) -> Iterator[tuple[Stack, Path]]:
    """An unstarted stack on its own database and Redis, with this module's routes; the test
    writes the routes (for its breaker settings) and starts the processes it needs."""
    downstream.reset()
    redis_process, url = embedded.start_redis(tmp_path / "redis", appendonly=False)
    stack = Stack(own_database, url, tmp_path / "routes.toml", tmp_path)
    yield stack, stack.routes_file
    stack.stop_all()
    redis_process.terminate()
    redis_process.wait(timeout=10)


def _post(stack: Stack, body: dict[str, Any]) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    return key


def _statuses(stack: Stack, keys: list[str]) -> dict[str, tuple[str, int]]:
    rows = query(
        stack.database_url,
        "SELECT idempotency_key, status, attempts FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    return {key: (status, attempts) for key, status, attempts in rows}


def _all_succeeded(stack: Stack, keys: list[str]) -> bool:
    return all(status == "succeeded" for status, _ in _statuses(stack, keys).values())


def _max_probes(outage: float, cooldown: float, cap: float) -> int:
    """How many probes fit in an outage: the k-th comes no sooner than the first k cool-downs
    (each doubles, up to the cap) after the circuit opened."""
    probes, elapsed, step = 0, 0.0, cooldown
    while elapsed + step <= outage:
        elapsed += step
        probes += 1
        step = min(cap, step * 2)
    return probes


@pytest.mark.parametrize(
    ("outage", "events", "cooldown", "cap"),
    [
        pytest.param(10.0, 50, 1.0, 4.0, id="10s"),
        pytest.param(60.0, 200, 10.0, 300.0, id="60s-default-cooldown", marks=pytest.mark.slow),
    ],
)
def test_an_outage_costs_no_attempts_and_loses_no_event(
    protected: tuple[Stack, Path],
    downstream: Downstream,
    outage: float,
    events: int,
    cooldown: float,
    cap: float,
) -> None:
    """The downstream answers 503 to everything while events arrive: the circuit opens, only the
    attempts already on their way and the probes reach it, and after it recovers every event
    succeeds exactly once, with no dead letter and no key spending more than 2 attempts.

    The circuit opens at the first failure here (threshold 1): with a higher threshold a key
    that failed early may come back (its backoff) before the circuit opened and spend a
    second failed attempt, and then a third after the recovery.
    """
    stack, routes = protected
    _routes(
        routes,
        downstream.url,
        circuit_cooldown_seconds=cooldown,
        circuit_cooldown_cap_seconds=cap,
    )
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
    # At most the attempts in flight when the first failure opened the circuit, plus probes.
    bound = concurrency + _max_probes(outage, cooldown, cap)
    assert len(during) <= bound, (len(during), bound)
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]
    assert downstream.effects == {key: 1 for key in keys}
    attempts = [attempts for _, attempts in _statuses(stack, keys).values()]
    assert max(attempts) <= 2, sorted(attempts)[-5:]
    log = stack.logs("worker")
    assert '"route.circuit_opened"' in log and '"route.circuit_closed"' in log
