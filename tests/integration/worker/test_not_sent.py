"""A downstream that is down (nothing listens: a restart, a deploy) or not listening on the path
(n8n's "webhook not registered": a re-publish), on real processes: requests that never reached
anything that could act spend no attempt, nothing is dead-lettered however long it lasts within
the retry deadline, and each event acts exactly once when the downstream is back. Counted at the
fake downstream."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from sqlalchemy import create_engine

from outbox.store import routes as routes_sql
from outbox.store.ports import free_port
from tests.support import (
    Downstream,
    Reply,
    Stack,
    envelope,
    key_rows,
    post_event,
    query,
    wait_until,
)

NOT_REGISTERED = {"code": 404, "message": 'The requested webhook "POST crm" is not registered.'}
# Far below the refusals each key meets while its downstream is away: a key that spent an
# attempt on each would be dead-lettered many times over.
MAX_ATTEMPTS = 2
RETRY_SECONDS = 1.0


def _routes(path: Path, url: str) -> None:
    common = f"""action = "http"
url = "{url}/tasks"
external_ref_pointer = "/id"
connect_timeout_seconds = 1
read_timeout_seconds = 2
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
max_attempts = {MAX_ATTEMPTS}
not_sent_retry_seconds = {RETRY_SECONDS}
circuit_minimum_calls = 3
"""
    path.write_text(
        f"""
[[routes]]
match = "away.*"
name = "away"
{common}
[[routes]]
match = "flow.*"
name = "flow"
kind = "n8n"
{common}
[[routes]]
match = "lane.*"
name = "lane"
order_by = "/contact/id"
{common}""",
        encoding="utf-8",
    )


def _not_sent_rows(stack: Stack, key: str) -> int:
    rows = query(
        stack.database_url,
        "SELECT count(*) FROM attempts WHERE idempotency_key = %s AND outcome = 'not_sent'",
        (key,),
    )
    return int(rows[0][0])


def _cooldowns(stack: Stack) -> list[float]:
    """The cool-down of each opening of a circuit, as the worker logged it."""
    return [
        float(line["cooldown_seconds"])
        for line in map(json.loads, stack.logs("worker").splitlines())
        if line.get("event") == "route.circuit_opened"
    ]


def _start_with_nothing_listening(stack: Stack, routes: Path) -> Downstream:
    """The stack started with its routes aimed at a port nothing listens on; the server that
    will listen there, not yet started."""
    later = Downstream(port=free_port())
    _routes(routes, later.url)
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=4)
    return later


def _serve_and_see_each_once(stack: Stack, later: Downstream, keys: list[str]) -> None:
    """Start the server on the port nothing listened on: each key is applied exactly once, on
    its first attempt, and nothing is dead-lettered."""
    server = later.start()
    try:
        wait_until(lambda: later.effects.keys() == set(keys), timeout=120, interval=0.5)
        wait_until(
            lambda: set(key_rows(stack.database_url, keys).values()) == {("succeeded", 1)},
            timeout=60,
            interval=0.5,
        )
        assert later.effects == {key: 1 for key in keys}
        assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]
    finally:
        server.shutdown()
        server.server_close()


def test_a_downstream_that_is_down_costs_no_attempt_and_each_event_acts_once_when_back(
    protected: tuple[Stack, Path],
) -> None:
    """Nothing listens on the route's port while five events arrive and for a while after:
    every key meets many refused connections (far more than its two attempts), none is
    dead-lettered or spends an attempt, the circuit re-opens with its short cool-down only;
    when a server starts on the port each event is applied exactly once, on one attempt."""
    stack, routes = protected
    later = _start_with_nothing_listening(stack, routes)
    keys = []
    for number in range(5):
        keys.append(post_event(stack, envelope(f"away-{number}", event_type="away.lead")))
        time.sleep(0.5)
    # Each key is refused again and again, well past the budget a sent failure would have.
    rows = _refused_past_the_budget(stack, keys)
    assert set(rows.values()) == {("failed_retryable", 0)}
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]
    # The circuit opened and re-opened at each failed trial, for the short cool-down each
    # time, never doubled towards the cap.
    cooldowns = _cooldowns(stack)
    assert len(cooldowns) >= 2, cooldowns
    assert max(cooldowns) <= RETRY_SECONDS + 0.05, cooldowns

    _serve_and_see_each_once(stack, later, keys)
    assert len(later.requests) == len(keys)


def test_a_workflow_published_again_gets_its_held_events_without_spending_attempts(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """n8n answers "webhook not registered" while the workflow is unpublished: the events wait
    unspent (the not-registered answers outnumber the route's attempts), and once it answers
    again each runs exactly once, the key's attempt count still one."""
    stack, routes = protected
    _routes(routes, downstream.url)
    published = threading.Event()
    downstream.behaviour = lambda _key, _n: (
        Reply() if published.is_set() else Reply(404, extra=NOT_REGISTERED, commit=False)
    )
    stack.start_receiver()
    stack.start_relay()
    stack.start_worker(concurrency=4)
    keys = [post_event(stack, envelope(f"flow-{n}", event_type="flow.lead")) for n in range(3)]
    rows = _refused_past_the_budget(stack, keys)
    assert set(rows.values()) == {("failed_retryable", 0)}
    published.set()
    wait_until(
        lambda: set(key_rows(stack.database_url, keys).values()) == {("succeeded", 1)},
        timeout=60,
        interval=0.2,
    )
    assert downstream.effects == {key: 1 for key in keys}
    assert query(stack.database_url, "SELECT count(*) FROM dead_letters") == [(0,)]


def test_an_ordered_route_down_for_a_while_applies_its_lane_in_acceptance_order_once_back(
    protected: tuple[Stack, Path],
) -> None:
    """Four updates of one contact arrive while nothing listens: none spends an attempt or is
    dead-lettered, and once a server starts on the port they are applied once each, in the
    order they were accepted."""
    stack, routes = protected
    later = _start_with_nothing_listening(stack, routes)
    keys = [
        post_event(
            stack,
            {
                "source": "crm",
                "event_type": "lane.contact.updated",
                "external_id": f"contact-7-update-{n}",
                "payload": {"contact": {"id": 7}, "update": n},
            },
        )
        for n in range(4)
    ]
    head = keys[0]
    rows = _refused_past_the_budget(stack, keys, watched=[head])
    assert {attempts for _, attempts in rows.values()} == {0}
    _serve_and_see_each_once(stack, later, keys)
    assert [body["update"] for _, body in later.applied] == [0, 1, 2, 3]


def _refused_past_the_budget(
    stack: Stack, keys: list[str], watched: list[str] | None = None
) -> dict[str, tuple[str, int]]:
    """Wait until each of `watched` (all `keys` by default) was refused more often than the
    route's attempts, at a moment when none of `keys` is being tried, and return their status
    and attempts then: a key being tried is `processing` with the attempt its claim counted,
    which the not-sent answer gives back."""
    rows: dict[str, tuple[str, int]] = {}

    def refused_and_at_rest() -> bool:
        if not all(_not_sent_rows(stack, key) > MAX_ATTEMPTS for key in watched or keys):
            return False
        rows.clear()
        rows.update(key_rows(stack.database_url, keys))
        return all(status != "processing" for status, _ in rows.values())

    wait_until(refused_and_at_rest, timeout=60, interval=0.2)
    return rows


def libpq_url(database_url: str) -> str:
    return database_url.replace("postgresql://", "postgresql+psycopg://", 1)


def test_reopenings_by_unsent_trials_do_not_double_a_later_cooldown(own_database: str) -> None:
    """Five trials refused unsent re-open the circuit for the short cool-down each, uncounted;
    a trial that was sent and failed after them re-opens it for the first doubling (2 s of a
    1 s cool-down), not for five doublings more (a downstream that accepts connections before
    it answers, as n8n does while it starts)."""
    engine = create_engine(libpq_url(own_database))
    calls = {
        "route": "crm",
        "successes": 0,
        "window": 30.0,
        "minimum_calls": 1,
        "rate": 0.5,
        "trials": 1,
        "opens_now": False,
        "reason": "refused",
        "retry_after": None,
        "failed": True,
    }
    short = {"cooldown": 0.01, "cooldown_cap": 0.01, "not_sent": True}
    try:
        with engine.begin() as conn:
            conn.execute(routes_sql.ENSURE_ROUTE, {"route": "crm", "max_in_flight": 1})
            opened = conn.execute(routes_sql.ROUTE_CALLS, {**calls, **short, "key": "k"}).one()
        assert opened.opened
        for trial in range(6):
            time.sleep(0.05)
            with engine.begin() as conn:
                key = f"trial-{trial}"
                taken = conn.execute(
                    routes_sql.TAKE_TRIAL,
                    {"route": "crm", "key": key, "trials": 1, "probe_seconds": 10},
                ).one_or_none()
                assert taken is not None
                sent = trial == 5
                cooldowns = (
                    {"cooldown": 1.0, "cooldown_cap": 300.0, "not_sent": False} if sent else short
                )
                row = conn.execute(routes_sql.ROUTE_CALLS, {**calls, **cooldowns, "key": key}).one()
            assert row.opened
        assert 1.5 < float(row.cooldown_seconds) <= 2.0, row.cooldown_seconds
    finally:
        engine.dispose()


def _circuit_returns(stack: Stack) -> int:
    """How many times a held key came back and found the circuit open (the attempt log)."""
    rows = query(
        stack.database_url,
        "SELECT count(*) FROM attempts WHERE outcome = %s",
        ("deferred_circuit",),
    )
    return int(rows[0][0])


def _held(stack: Stack) -> int:
    rows = query(
        stack.database_url,
        "SELECT count(*) FROM idempotency_keys WHERE error_code = 'circuit_open'"
        " AND status = 'failed_retryable'",
    )
    return int(rows[0][0])


BACKLOG = 300
WINDOW_SECONDS = 6.0


def test_a_backlog_behind_a_downstream_that_is_down_looks_at_the_circuit_at_a_bounded_rate(
    protected: tuple[Stack, Path],
) -> None:
    """300 events arrive while nothing listens: the circuit opens and re-opens every second
    (nothing was sent), and the held keys do not all come back each time, a claim and a
    deferral each: they wait in line, so over 6 s fewer come back than there are held keys
    (each came back every 0.5 to 1 s before, thousands of returns). Once a server starts on the
    port each event is applied exactly once."""
    stack, routes = protected
    later = _start_with_nothing_listening(stack, routes)
    keys = []
    with stack.client() as client:
        for number in range(BACKLOG):
            answer = client.post(
                "/v1/events", json=envelope(f"away-{number}", event_type="away.lead")
            )
            assert answer.status_code == 202, answer.text
            keys.append(answer.json()["key"])
    wait_until(lambda: _held(stack) >= BACKLOG - 10, timeout=120, interval=0.5)
    before = _circuit_returns(stack)
    time.sleep(WINDOW_SECONDS)
    returns = _circuit_returns(stack) - before
    assert returns < BACKLOG, returns
    _serve_and_see_each_once(stack, later, keys)
