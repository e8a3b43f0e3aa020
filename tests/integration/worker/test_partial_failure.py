"""Partial failure, from outside, on real processes: a downstream that mostly works, keys it
always refuses, a flaky spell, and a breaker whose bookkeeping fails after an effect. Effects
are counted at the fake downstream; every attempt a key spends is a request it received.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.chaos.plan import derived_key
from tests.support import (
    Downstream,
    Reply,
    Stack,
    all_in,
    envelope,
    libpq,
    query,
    wait_until,
)


def _routes(path: Path, url: str, **settings: Any) -> Path:
    """One http route at the fake downstream: the breaker's defaults unless a test says."""
    extra = "\n".join(f"{name} = {value}" for name, value in settings.items())
    path.write_text(
        f"""
[[routes]]
match = "crm.*"
name = "crm"
action = "http"
url = "{url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{url}/tasks/by-key/{{key}}"
connect_timeout_seconds = 1
read_timeout_seconds = 2
{extra}
""",
        encoding="utf-8",
    )
    return path


def _post(stack: Stack, external_id: str, **extra: Any) -> str:
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope(external_id, "crm.lead", **extra))
    assert answer.status_code in (200, 202), answer.text
    key: str = answer.json()["key"]
    return key


def _keys(stack: Stack, keys: list[str]) -> dict[str, tuple[str, int, str | None]]:
    rows = query(
        stack.database_url,
        "SELECT idempotency_key, status, attempts, error_code FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    return {key: (status, attempts, code) for key, status, attempts, code in rows}


def _all(stack: Stack, keys: list[str], status: str) -> bool:
    return all_in(stack.database_url, keys, status)


def _requests(downstream: Downstream, key: str) -> int:
    return len(downstream.request_times(key))


def test_events_refused_twice_each_all_succeed_once_within_the_breakers_cool_downs(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Ten events whose first two requests each get 503, on a route with the breaker's
    defaults: every one succeeds once, having spent exactly the three attempts it sent (a key
    held back by the circuit spends nothing), within the breaker's worst case.

    That case: the circuit opens at the 14th failure at the earliest (20 calls, half of them
    failed, and each success counted needs its key's two failures before it), so at most six
    failures are left when it opens, and at most two rounds of three trial calls can fail
    (the trials are whichever held keys come back first): cool-downs of 10, 20 and 40 s. Most
    runs see one round or none (about 15 to 30 s)."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker()
    downstream.behaviour = lambda key, n: Reply(503) if n <= 2 else Reply(201)
    keys = [_post(stack, f"twice-{n}") for n in range(10)]
    wait_until(lambda: _all(stack, keys, "succeeded"), timeout=100, interval=0.5)
    assert downstream.effects == {key: 1 for key in keys}
    log = query(
        stack.database_url,
        "SELECT idempotency_key, attempt, outcome, error_code FROM attempts ORDER BY id",
    )
    spent = {key: row[1] for key, row in _keys(stack, keys).items()}
    assert spent == {key: 3 for key in keys}, [row for row in log if spent[row[0]] != 3]
    assert all(_requests(downstream, key) == 3 for key in keys)
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]


def test_keys_always_refused_end_as_dead_letters_without_delaying_the_healthy(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Five events the downstream always refuses among forty it serves (max_attempts 4): the
    five end as dead letters after their four attempts (at most four requests each), the
    route's circuit never
    opens, and healthy events posted after them go through, one effect each."""
    stack, routes = protected
    _routes(routes, downstream.url, max_attempts=4, backoff_base_seconds=0.2, backoff_cap_seconds=1)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker()
    ids = [f"poison-{n}" if n % 9 == 0 else f"fine-{n}" for n in range(45)]
    refused = {derived_key(envelope(i, "crm.lead")) for i in ids if i.startswith("poison")}
    downstream.behaviour = lambda key, n: Reply(503) if key in refused else Reply(201)
    keys = [_post(stack, i) for i in ids]
    poisoned = [key for key in keys if key in refused]
    healthy = [key for key in keys if key not in refused]
    assert len(poisoned) == 5
    wait_until(lambda: _all(stack, poisoned, "failed_final"), timeout=60, interval=0.5)
    later = [_post(stack, f"later-{n}") for n in range(10)]
    wait_until(lambda: _all(stack, healthy + later, "succeeded"), timeout=30, interval=0.2)

    assert downstream.effects == {key: 1 for key in healthy + later}
    # Four attempts each, every one a request unless a lease was lost on a loaded machine
    # (that attempt counts without sending): never more requests than the budget.
    assert all(1 <= _requests(downstream, key) <= 4 for key in poisoned)
    dead = query(
        stack.database_url,
        "SELECT idempotency_key, kind, attempts FROM dead_letters ORDER BY idempotency_key",
    )
    assert dead == [(key, "retries_exhausted", 4) for key in sorted(poisoned)]
    assert query(stack.database_url, "SELECT circuit FROM route_state") == [("closed",)]
    assert '"route.circuit_opened"' not in stack.logs("worker")


@pytest.mark.parametrize(
    "spell",
    [pytest.param(10.0, id="10s"), pytest.param(30.0, id="30s", marks=pytest.mark.slow)],
)
def test_a_flaky_spell_delivers_every_event_once(
    protected: tuple[Stack, Path], downstream: Downstream, spell: float
) -> None:
    """For `spell` seconds the downstream refuses 40 % of requests at random while 60 events
    arrive: every event succeeds exactly once, and the backlog is gone within a minute of the
    spell's end."""
    stack, routes = protected
    _routes(
        routes, downstream.url, max_attempts=12, backoff_base_seconds=0.5, backoff_cap_seconds=5
    )
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker()
    rng = random.Random(23)
    draw = threading.Lock()
    refusals: list[str] = []
    started = time.monotonic()
    ends = started + spell

    def flaky(key: str, n: int) -> Reply:
        with draw:
            refused = time.monotonic() < ends and rng.random() < 0.4
            if refused:
                refusals.append(key)
        return Reply(503) if refused else Reply(201)

    downstream.behaviour = flaky
    keys = []
    for number in range(60):
        keys.append(_post(stack, f"flaky-{number}"))
        time.sleep(max(0.0, started + (number + 1) * spell / 61 - time.monotonic()))
    wait_until(
        lambda: _all(stack, keys, "succeeded"),
        timeout=max(0.0, ends - time.monotonic()) + 60,
        interval=0.5,
    )
    assert downstream.effects == {key: 1 for key in keys}
    # The spell was real: a good share of the requests in it were refused.
    assert len(refusals) >= 15, len(refusals)
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]


def test_a_breaker_that_cannot_be_told_never_costs_a_second_effect(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """A trial call succeeds while the route's state row is locked past the statement timeout:
    the success is recorded first, the failed bookkeeping is only logged, and the key is never
    acted on again (one effect, one attempt, succeeded)."""
    stack, routes = protected
    _routes(routes, downstream.url)
    stack.extra_env["DB_TIMEOUT_SECONDS"] = "1"
    stack.start_receiver()
    stack.start_relay()
    with psycopg.connect(libpq(stack.database_url), autocommit=True) as setup:
        # Open, with its cool-down over: the next key is a trial.
        setup.execute(
            "INSERT INTO route_state (route, circuit, open_until, opened_at)"
            " VALUES ('crm', 'open', now() - interval '1 second', now() - interval '1 minute')"
        )
    holder = psycopg.connect(libpq(stack.database_url))
    locked = threading.Event()

    def lock_the_route(key: str, n: int) -> Reply:
        # While the trial's request is at the downstream, take the route's row lock and keep
        # it: the worker's telling statement after the record has to time out.
        holder.execute("SELECT 1 FROM route_state WHERE route = 'crm' FOR UPDATE")
        locked.set()
        return Reply(201)

    downstream.behaviour = lock_the_route
    try:
        stack.start_worker()
        key = _post(stack, "told-0")
        wait_until(locked.is_set, timeout=30)
        wait_until(lambda: '"route.tell_failed"' in stack.logs("worker"), timeout=30)
        assert _keys(stack, [key])[key][:2] == ("succeeded", 1)
    finally:
        holder.rollback()
        holder.close()
    downstream.behaviour = None
    # The lost close is made up by the next trial; the first key stays done.
    other = _post(stack, "told-1")
    wait_until(lambda: _all(stack, [other], "succeeded"), timeout=30)
    assert downstream.effects == {key: 1, other: 1}
    assert _keys(stack, [key])[key][:2] == ("succeeded", 1)
    assert query(stack.database_url, "SELECT circuit FROM route_state") == [("closed",)]


def test_an_effect_that_lands_after_its_attempt_ended_is_found_not_repeated(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """Five events whose first request the downstream carries out only after the 2 s read
    timeout (2.6 s after it arrived), on a route whose backoff would retry within 50 ms: the
    retry waits the request's connect plus read timeout (3 s), its lookup finds each effect,
    and none is made twice (before, the lookup came 50 ms after the timeout and found
    nothing)."""
    stack, routes = protected
    _routes(routes, downstream.url, backoff_base_seconds=0.05, backoff_cap_seconds=0.05)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker()

    landed: list[str] = []

    def late(key: str, n: int) -> Reply:
        if n == 1:
            time.sleep(2.6)  # the effect is written after the worker stopped waiting
            landed.append(key)
        return Reply(201)

    downstream.behaviour = late
    keys = [_post(stack, f"late-{n}") for n in range(5)]
    wait_until(lambda: _all(stack, keys, "succeeded"), timeout=30, interval=0.5)
    wait_until(lambda: len(landed) == len(keys))
    assert downstream.effects == {key: 1 for key in keys}
    assert all(_requests(downstream, key) == 1 for key in keys)
    assert {key: row[1] for key, row in _keys(stack, keys).items()} == {key: 2 for key in keys}
    assert all(downstream.lookups.count(key) >= 1 for key in keys)
    assert '"timeout_read"' in stack.logs("worker")
