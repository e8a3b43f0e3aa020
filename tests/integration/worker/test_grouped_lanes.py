"""The lane steps of one process's attempts sharing a statement (`worker.grouped`,
`ADMIT_KEYS`, `lane_admit_many`) on real PostgreSQL: each key decided as alone, its wait or
supersede logged as alone; and a key whose row or lane another transaction holds is left out
at once, never waited for inside the shared statement, and decided alone after."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy import Engine

from tests.integration.worker.test_grouped import (
    behind_one_in_flight,
    lock_waits,
    row_locked,
    sent,
)
from tests.integration.worker.test_lanes import (
    Recorder,
    _accepted,
    _routes,
    _settled,
    _states,
)
from tests.support import Downstream, Stack, libpq, query, seed_lane_key, wait_until
from worker.grouped import GroupedStore
from worker.lanes import admit_keys
from worker.store import KeyStore

LEASE = 30.0
ADMIT_ONE = "-- The lane step of an attempt"
ADMIT_MANY = "-- The lane step of several keys"


def held(database_url: str, external_id: str, lane: str, rank: int) -> str:
    """A key of `lane` claimed by this test: processing, fence 1, token `t-<external_id>`."""
    key = seed_lane_key(database_url, external_id, "processing", lane=lane, rank=rank)
    query(
        database_url,
        "UPDATE idempotency_keys SET fence = 1, lease_token = %s,"
        " locked_until = now() + interval '30 seconds' WHERE idempotency_key = %s",
        (f"t-{external_id}", key),
    )
    return key


def step(key: str, ordering: str = "accepted") -> dict[str, Any]:
    """A lane step's parameters, as `worker.lanes.order` gives them for a claim of `held`."""
    return {
        "key": key,
        "fence": 1,
        "token": f"t-{key.rsplit(':', 1)[1]}",
        "attempt": 1,
        "started_at": datetime.now(UTC),
        "worker": "w-test",
        "outcome": "deferred_lane",
        "reconciled": None,
        "status_code": None,
        "log_error_code": None,
        "log_detail": None,
        "ordering": ordering,
        "on_failure": "block",
        "ttl_seconds": 3600.0,
    }


@contextmanager
def lane_locked(database_url: str, lane: str, route: str = "crm") -> Iterator[None]:
    """Another transaction holds `lane`'s row (as a key of it finishing does) until the block
    ends."""
    with psycopg.connect(libpq(database_url)) as conn:
        conn.execute("SELECT 1 FROM lanes WHERE route = %s AND lane = %s FOR UPDATE", (route, lane))
        yield
        conn.rollback()


def without_waiting(call: Callable[[], Any]) -> Any:
    """`call`'s answer, given while the test still holds its lock: a statement that waited for
    that lock would not answer before the test lets it go."""
    answers: list[Any] = []
    thread = threading.Thread(target=lambda: answers.append(call()), daemon=True)
    thread.start()
    thread.join(20)
    assert answers, "the shared lane step waited for a lock held elsewhere"
    return answers[0]


def states(database_url: str) -> dict[str, tuple[str, str | None]]:
    rows = query(database_url, "SELECT idempotency_key, status, error_code FROM idempotency_keys")
    return {key: (status, error_code) for key, status, error_code in rows}


def test_lane_steps_behind_one_in_flight_share_one_statement_each_decided_as_alone(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """A lane step waits on its key's row lock; four more arrive meanwhile and go in one
    statement. A key alone in its lane goes; two keys of one lane, both running, both park and
    the lane is handed to the older (as two steps alone do); a version older than the lane's
    applied one is superseded. The waits and the supersede are in the attempt log, each with
    its own attempt and holder."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    first = held(db, "first", "head", 1)
    alone = held(db, "alone", "a", 1)
    older, newer = held(db, "b-1", "b", 1), held(db, "b-2", "b", 2)
    stale = held(db, "stale", "c", 1)
    query(db, "UPDATE lanes SET applied_rank = 2, applied_version = '2' WHERE lane = 'c'")

    calls = [
        partial(store.admit, step(alone)),
        partial(store.admit, step(older)),
        partial(store.admit, step(newer)),
        partial(store.admit, step(stale, "supersede")),
    ]
    head, answers = behind_one_in_flight(
        db, first, lambda: store.admit(step(first)), calls, store._admits
    )

    assert head["decision"] == "go"
    assert [a["decision"] for a in answers] == ["go", "wait", "wait", "superseded"]
    assert answers[3]["superseded_by"] == "2"
    assert sent(statements, ADMIT_ONE) == 1 and sent(statements, ADMIT_MANY) == 1
    assert {k: v for k, v in states(db).items() if k != first} == {
        alone: ("processing", None),
        older: ("pending", "lane_released"),
        newer: ("pending", "lane_waiting"),
        stale: ("superseded", None),
    }
    assert sorted(
        query(
            db,
            "SELECT idempotency_key, attempt, fence, outcome, error_code, worker FROM attempts",
        )
    ) == sorted(
        [
            (older, 1, 1, "deferred_lane", "lane_waiting", "w-test"),
            (newer, 1, 1, "deferred_lane", "lane_waiting", "w-test"),
            (stale, 1, 1, "superseded", "superseded", "w-test"),
        ]
    )


def test_a_key_whose_lane_is_held_elsewhere_is_left_out_at_once_and_decided_alone_after(
    own_database: str, worker_engine: Engine
) -> None:
    """While another transaction holds lane x (a key of it finishing), the shared step decides
    the key of lane y and leaves x's key out without waiting for the lock, and without writing
    it; the grouped store then sends that key alone, which waits for the lane and goes."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    in_x, in_y = held(db, "in-x", "x", 1), held(db, "in-y", "y", 1)

    with lane_locked(db, "x"):
        decided = without_waiting(lambda: admit_keys(store, [step(in_x), step(in_y)]))
        assert {k: row["decision"] for k, row in decided.items()} == {in_y: "go"}
        assert states(db)[in_x] == ("processing", None)
        assert without_waiting(lambda: store._admit_together([step(in_x)])) == [None]
    assert KeyStore.admit(store, step(in_x))["decision"] == "go"


def test_a_key_whose_row_is_held_elsewhere_is_left_out_at_once(
    own_database: str, worker_engine: Engine
) -> None:
    """A key whose row another transaction holds (a renewal, a copy of its message claiming
    it) is left out of the shared step, which decides the others; alone, after, it goes."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    busy, free = held(db, "busy", "p", 1), held(db, "free", "q", 1)

    with row_locked(db, busy):
        decided = without_waiting(lambda: admit_keys(store, [step(busy), step(free)]))
        assert {k: row["decision"] for k, row in decided.items()} == {free: "go"}
    assert KeyStore.admit(store, step(busy))["decision"] == "go"


def test_a_key_no_longer_held_by_its_caller_is_left_out_and_lost_alone(
    own_database: str, worker_engine: Engine
) -> None:
    """A step whose claim was taken over (another token) is not decided in the shared
    statement; alone it is `lost`, and nothing of the key changed."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    taken, mine = held(db, "taken", "r", 1), held(db, "mine", "s", 1)
    query(
        db,
        "UPDATE idempotency_keys SET fence = 2, lease_token = 't-new' WHERE idempotency_key = %s",
        (taken,),
    )

    decided = admit_keys(store, [step(taken), step(mine)])

    assert {k: row["decision"] for k, row in decided.items()} == {mine: "go"}
    assert KeyStore.admit(store, step(taken))["decision"] == "lost"
    assert query(
        db,
        "SELECT status, fence, lease_token FROM idempotency_keys WHERE idempotency_key = %s",
        (taken,),
    ) == [("processing", 2, "t-new")]


def test_a_worker_deciding_lane_steps_together_keeps_each_contact_in_order(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """12 versions of each of 6 contacts, posted in a shuffled order, wait for a worker of 32
    threads; as it starts, another transaction holds one contact's lane for half a second, so
    that contact's lane steps wait and the others' are decided together (`lane_admit_many`
    runs). Each contact's applied versions still increase strictly and end at the newest, one
    request of a contact at a time; every event is applied once or superseded, never both."""
    stack, routes = protected
    name = query(stack.database_url, "SELECT current_database()")[0][0]
    query(stack.database_url, f"ALTER DATABASE \"{name}\" SET track_functions = 'all'")
    _routes(routes, downstream.url)
    recorder = Recorder(downstream, delay=0.02)
    contacts = [f"g{n}" for n in range(6)]
    query(
        stack.database_url,
        "INSERT INTO lanes (route, lane, ordering, on_failure, expires_at)"
        " VALUES ('contacts', 'crm:g0', 'supersede', 'block', now() + interval '1 day')",
    )
    stack.start_receiver()
    stack.start_relay()
    work = [(obj, v) for obj in contacts for v in range(1, 13)]
    random.Random(50).shuffle(work)
    keys = [_accepted(stack, recorder, "contact.updated", obj, v) for obj, v in work]
    with lane_locked(stack.database_url, "crm:g0", route="contacts"):
        stack.start_worker(concurrency=32)
        wait_until(lambda: lock_waits(stack.database_url) >= 1, timeout=30, interval=0.02)
        # Well within the statement timeout (3 s) of the step that waits.
        time.sleep(0.5)
    wait_until(lambda: _settled(stack, keys), timeout=90, interval=0.3)

    states = _states(stack, keys)
    assert {status for status, _ in states.values()} <= {"succeeded", "superseded"}
    for obj in contacts:
        applied = recorder.applied[obj]
        assert applied == sorted(set(applied)) and applied[-1] == 12, (obj, applied)
        assert recorder.overlaps(obj) == 0, obj
    for key, (status, by) in states.items():
        assert downstream.effects[key] == (1 if status == "succeeded" else 0), (key, status)
        if status == "superseded":
            assert by is not None and int(by) > recorder.version_of[key], (key, by)
    # The worker's sessions report their function calls as they end.
    stack.stop("worker")
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions"
                " WHERE funcname = 'lane_admit_many'",
            )[0][0]
            >= 1
        ),
        timeout=30,
        interval=0.2,
    )
