"""07's Idem Trigger through the ordinary life of an n8n instance (tests/n8n_e2e/trigger_world.py:
07 published a second time with an 8 s lease, behind the route `trigger-look`).

Every case counts the creates the fake CRM saw for its events, the executions n8n recorded for
the workflow, and reads the gateway key's stored result: one create per event, and the stored
result `{"status_code": 200, "body": {"task_id": ...}}` with its external reference, whichever
way the answer came.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from typing import Any

import psycopg

from tests.n8n_e2e.cases import (
    Case,
    Outcome,
    _attempts,
    _event,
    _gateway_key,
    post_gateway_event,
    tasks,
)
from tests.n8n_e2e.n8n import _unflatten, executions
from tests.n8n_e2e.trigger_world import (
    LOOK_EVENT_TYPE,
    LOOK_LEASE_SECONDS,
    LOOK_READ_TIMEOUT_SECONDS,
    LOOK_WORKFLOW_ID,
)
from tests.n8n_e2e.world import World
from tests.support import Reply, libpq, wait_until

# The Look First branch's first node: an execution that ran it started on Look First.
LOOK_NODE = "CRM: find task"
SETTLE_SECONDS = 90.0


def post(world: World, event: dict[str, Any]) -> int:
    """The event to the gateway for the route `trigger-look`; the receiver's status."""
    return post_gateway_event(world, event, LOOK_EVENT_TYPE).status_code


def stored(world: World, key: str) -> tuple[str | None, Any, str | None]:
    """The gateway key's status, stored result and external reference."""
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT status, result, external_ref FROM idempotency_keys WHERE idempotency_key = %s",
            (key,),
        ).fetchone()
    return (None, None, None) if row is None else (row[0], row[1], row[2])


def dead_letters(world: World, keys: list[str]) -> int:
    with psycopg.connect(libpq(world.stack.database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM dead_letters WHERE idempotency_key = ANY(%s)", (keys,)
        ).fetchone()
    return 0 if row is None else int(row[0])


def creates(world: World, marker: str) -> int:
    """Create requests the CRM received for the event (whether they created or not)."""
    with world.crm.lock:
        return sum(1 for r in world.crm.requests if marker in r["key"])


def look_first_runs(world: World, since: int) -> int:
    """Executions of the workflow after execution id `since` that ran the Look First branch."""
    database = world.n8n.home / ".n8n" / "database.sqlite"
    with contextlib.closing(sqlite3.connect(database)) as conn:
        rows = conn.execute(
            "SELECT d.data FROM execution_entity e JOIN execution_data d"
            " ON d.executionId = e.id WHERE e.workflowId = ? AND e.id > ?",
            (LOOK_WORKFLOW_ID, since),
        ).fetchall()
    return sum(
        1 for (data,) in rows if LOOK_NODE in _unflatten(json.loads(data))["resultData"]["runData"]
    )


def last_execution_id(world: World) -> int:
    database = world.n8n.home / ".n8n" / "database.sqlite"
    with contextlib.closing(sqlite3.connect(database)) as conn:
        (found,) = conn.execute("SELECT coalesce(max(id), 0) FROM execution_entity").fetchone()
    return int(found)


def wait_status(world: World, keys: list[str], timeout: float = SETTLE_SECONDS) -> bool:
    """Whether every key ended succeeded within `timeout` (False as soon as one dead-letters)."""

    def settled() -> bool:
        statuses = [stored(world, key)[0] for key in keys]
        if any(status in ("failed_final", "quarantined") for status in statuses):
            raise AssertionError("dead-lettered")
        return all(status == "succeeded" for status in statuses)

    try:
        wait_until(settled, timeout=timeout)
    except AssertionError:
        return False
    return True


def wait_executions_done(world: World, seconds: float = 40.0) -> None:
    """Until n8n runs no execution of the workflow (a late one would count in the next case)."""
    database = world.n8n.home / ".n8n" / "database.sqlite"

    def idle() -> bool:
        with contextlib.closing(sqlite3.connect(database)) as conn:
            (running,) = conn.execute(
                "SELECT count(*) FROM execution_entity WHERE workflowId = ?"
                " AND status IN ('new', 'running', 'waiting')",
                (LOOK_WORKFLOW_ID,),
            ).fetchone()
        return int(running) == 0

    with contextlib.suppress(AssertionError):
        wait_until(idle, timeout=seconds)


def check_result(outcome: Outcome, world: World, key: str, label: str) -> dict[str, Any] | None:
    """The stored result is `{"status_code": 200, "body": {"task_id"}}`, no lease token in it,
    and the external reference is the task id (the route's pointer `/task_id`)."""
    status, result, external_ref = stored(world, key)
    body = result.get("body") if isinstance(result, dict) else None
    task_id = body.get("task_id") if isinstance(body, dict) else None
    outcome.check(
        isinstance(result, dict)
        and set(result) == {"status_code", "body"}
        and result["status_code"] == 200
        and isinstance(body, dict)
        and set(body) == {"task_id"}
        and bool(task_id)
        and "lease_token" not in json.dumps(result),
        f"{label}: key {status}, stored result {json.dumps(result, sort_keys=True)}",
    )
    outcome.check(
        external_ref is not None and external_ref == task_id,
        f"{label}: external_ref {external_ref}",
    )
    return body if isinstance(body, dict) else None


def count_run(outcome: Outcome, world: World, before: int, wanted: int) -> None:
    wait_executions_done(world)
    started = executions(world.n8n.home, LOOK_WORKFLOW_ID) - before
    outcome.check(started == wanted, f"{started} execution(s) (want {wanted})")


def miswired_complete(world: World, outcome: Outcome) -> None:
    """Idem Trigger → Config → HTTP Request (the CRM create, which replaces the item) → Idem
    Complete with its Key and Lease Token left at the defaults: Complete finds the trigger's
    claim, so the execution runs once; two leases later nothing has run again."""
    event = _event("look-miswired")
    key = _gateway_key(event)
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    started = time.monotonic()
    outcome.check(post(world, event) == 202, "event accepted")
    done = wait_status(world, [key])
    outcome.check(done, f"gateway key succeeded in {time.monotonic() - started:.1f} s")
    time.sleep(2 * LOOK_LEASE_SECONDS + 2)
    count_run(outcome, world, before, 1)
    sent = creates(world, event["id"])
    outcome.check(
        sent == 1, f"the CRM saw {sent} create(s) after two {LOOK_LEASE_SECONDS} s leases"
    )
    check_result(outcome, world, key, "first try")
    outcome.tasks = tasks(world, event["id"])


def result_shape_first_try_and_resend(world: World, outcome: Outcome) -> None:
    """One event answered on the gateway's first try, one whose CRM call (5 s) outlasts the
    route's 3 s read timeout, so its answer comes to a re-send, from the claim: both keys store
    the same shape, the external reference set from it."""
    fast, slow = _event("look-shape-fast"), _event("look-shape-slow")
    outcome.wanted = 2

    def behaviour(key: str, number: int) -> Reply:
        if slow["id"] in key and number == 1:
            return Reply(status=201, delay=LOOK_READ_TIMEOUT_SECONDS + 2)
        return Reply()

    world.crm.behaviour = behaviour
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    outcome.check([post(world, fast), post(world, slow)] == [202, 202], "events accepted")
    keys = [_gateway_key(fast), _gateway_key(slow)]
    outcome.check(wait_status(world, keys), "both gateway keys succeeded")
    attempts = [_attempts(world, key) for key in keys]
    outcome.check(
        attempts[0] == 1 and (attempts[1] or 0) >= 2,
        f"attempts: first try {attempts[0]}, re-send {attempts[1]}",
    )
    first = check_result(outcome, world, keys[0], "first try")
    resent = check_result(outcome, world, keys[1], "re-send")
    outcome.check(
        first is not None and resent is not None and set(first) == set(resent),
        "the same shape both ways",
    )
    count_run(outcome, world, before, 2)
    outcome.tasks = tasks(world, fast["id"]) + tasks(world, slow["id"])


def look_first_after_expired_lease(world: World, outcome: Outcome) -> None:
    """The CRM creates the task at once but answers after 20 s; the execution's 8 s lease runs
    out meanwhile. The gateway's next delivery is claimed `uncertain` and starts on Look First:
    the CRM is asked, the task is found, completed with it; no second create."""
    event = _event("look-expired")
    key = _gateway_key(event)

    def behaviour(found: str, number: int) -> Reply:
        if event["id"] in found and number == 1:
            return Reply(status=201, delay=20)
        return Reply()

    world.crm.behaviour = behaviour
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    since = last_execution_id(world)
    started = time.monotonic()
    outcome.check(post(world, event) == 202, "event accepted")
    outcome.check(
        wait_status(world, [key]),
        f"gateway key succeeded in {time.monotonic() - started:.1f} s"
        f" (lease {LOOK_LEASE_SECONDS} s)",
    )
    check_result(outcome, world, key, "looked up")
    # The first execution ends when the CRM's late answer comes (its Complete: lease_lost).
    time.sleep(20)
    count_run(outcome, world, before, 2)
    looked = look_first_runs(world, since)
    outcome.check(looked == 1, f"{looked} execution(s) started on Look First")
    with world.crm.lock:
        lookups = sum(1 for found in world.crm.lookups if event["id"] in found)
    outcome.check(lookups == 1, f"the CRM was asked {lookups} time(s)")
    sent = creates(world, event["id"])
    outcome.check(sent == 1, f"the CRM saw {sent} create(s)")
    outcome.tasks = tasks(world, event["id"])


def failed_workflow_frees_the_claim(world: World, outcome: Outcome) -> None:
    """The CRM refuses the first create (500, nothing created): the workflow fails, the
    trigger frees its claim and answers the gateway a transient failure; the gateway's retry
    starts on Look First (the effect was unknown), finds nothing, creates once. Within the
    lease: the claim was not held until it ran out."""
    event = _event("look-failed")
    key = _gateway_key(event)

    def behaviour(found: str, number: int) -> Reply:
        if event["id"] in found and number == 1:
            return Reply(status=500)
        return Reply()

    world.crm.behaviour = behaviour
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    since = last_execution_id(world)
    started = time.monotonic()
    outcome.check(post(world, event) == 202, "event accepted")
    done = wait_status(world, [key])
    took = time.monotonic() - started
    outcome.check(
        done and took < LOOK_LEASE_SECONDS,
        f"gateway key succeeded in {took:.1f} s (lease {LOOK_LEASE_SECONDS} s),"
        f" attempts {_attempts(world, key)}",
    )
    count_run(outcome, world, before, 2)
    looked = look_first_runs(world, since)
    outcome.check(looked == 1, f"{looked} execution(s) started on Look First")
    sent = creates(world, event["id"])
    outcome.check(sent == 2, f"the CRM saw {sent} create request(s), the first refused")
    check_result(outcome, world, key, "after the failure")
    outcome.tasks = tasks(world, event["id"])


RESTART_EVENTS = 5
EVENT_EVERY_SECONDS = 8.0
DOWN_SECONDS = 60.0
# How long the restart case waits for its events once n8n is ready. n8n 2.8.4 opens its port
# before it registers its webhooks; a request in between may hang past the route's read timeout
# (an uncertain failure, told to the breaker), and the circuit may then stay open up to the
# route's circuit_cooldown_cap_seconds (300 s by default) before the events go.
RESTART_SETTLE_SECONDS = 420.0


def _spaced_events(world: World, events: list[dict[str, Any]], accepted: list[int]) -> None:
    for number, event in enumerate(events):
        if number:
            time.sleep(EVENT_EVERY_SECONDS)
        accepted.append(post(world, event))


def restart_n8n(world: World, outcome: Outcome) -> None:
    """n8n stopped for 60 s while 5 events arrive one every 8 s, then started: each event runs
    exactly once afterwards, none is dead-lettered."""
    events = [_event(f"look-restart{n}") for n in range(RESTART_EVENTS)]
    keys = [_gateway_key(event) for event in events]
    outcome.wanted = RESTART_EVENTS
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    accepted: list[int] = []
    world.n8n.stop()
    stopped = time.monotonic()
    sender = threading.Thread(target=_spaced_events, args=(world, events, accepted))
    sender.start()
    time.sleep(DOWN_SECONDS)
    sender.join()
    world.n8n.start()
    ready = time.monotonic()
    outcome.notes.append(f"n8n down {ready - stopped:.0f} s (start included)")
    outcome.check(accepted == [202] * RESTART_EVENTS, f"events -> {accepted}")
    done = wait_status(world, keys, timeout=RESTART_SETTLE_SECONDS)
    outcome.check(done, f"every key succeeded {time.monotonic() - ready:.1f} s after n8n was ready")
    dead = dead_letters(world, keys)
    outcome.check(dead == 0, f"{dead} dead letter(s)")
    count_run(outcome, world, before, RESTART_EVENTS)
    per_event = [creates(world, event["id"]) for event in events]
    outcome.check(per_event == [1] * RESTART_EVENTS, f"CRM creates per event {per_event}")
    outcome.tasks = sum(tasks(world, event["id"]) for event in events)


REPUBLISH_EVENTS = 5
PUBLISHED_WITHIN_SECONDS = 10.0


def republish(world: World, outcome: Outcome) -> None:
    """The workflow unpublished in the running n8n for 60 s while 5 events arrive, then
    published again: the held events run within 10 s of the publication, once each."""
    events = [_event(f"look-republish{n}") for n in range(REPUBLISH_EVENTS)]
    keys = [_gateway_key(event) for event in events]
    outcome.wanted = REPUBLISH_EVENTS
    before = executions(world.n8n.home, LOOK_WORKFLOW_ID)
    accepted: list[int] = []
    world.n8n.unpublish_live(LOOK_WORKFLOW_ID)
    try:
        sender = threading.Thread(target=_spaced_events, args=(world, events, accepted))
        sender.start()
        time.sleep(DOWN_SECONDS)
        sender.join()
    finally:
        world.n8n.publish_live(LOOK_WORKFLOW_ID)
    published = time.monotonic()
    outcome.check(accepted == [202] * REPUBLISH_EVENTS, f"events -> {accepted}")
    done = wait_status(world, keys)
    took = time.monotonic() - published
    outcome.check(
        done and took <= PUBLISHED_WITHIN_SECONDS,
        f"every key succeeded {took:.1f} s after publication"
        f" (want <= {PUBLISHED_WITHIN_SECONDS:.0f})",
    )
    dead = dead_letters(world, keys)
    outcome.check(dead == 0, f"{dead} dead letter(s)")
    count_run(outcome, world, before, REPUBLISH_EVENTS)
    per_event = [creates(world, event["id"]) for event in events]
    outcome.check(per_event == [1] * REPUBLISH_EVENTS, f"CRM creates per event {per_event}")
    outcome.tasks = sum(tasks(world, event["id"]) for event in events)


CASES = [
    Case("07 trigger: HTTP Request → Complete with defaults", miswired_complete),
    Case("07 trigger: stored result, first try and re-send", result_shape_first_try_and_resend),
    Case("07 trigger: Look First after an expired lease", look_first_after_expired_lease),
    Case("07 trigger: a failed run frees the claim", failed_workflow_frees_the_claim),
    Case("07 trigger: re-published while events arrive", republish),
    # Last: a restart of n8n may leave the route's circuit open for minutes (its note).
    Case("07 trigger: n8n restarted while events arrive", restart_n8n),
]
