"""The worker's store and lease keeper on real PostgreSQL: one statement per step in
autocommit, a dropped connection costs a retried statement (not the step), and one keeper
thread renews every lease a process holds. Fencing itself is in test_failure_handling."""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack

from sqlalchemy import Engine

from tests.support import query, seed_pending_key
from worker.lease import Heartbeat
from worker.store import Claim, KeyStore


def _drop_store_connections(db: str) -> int:
    """Terminate the store's server sessions (as a PostgreSQL restart or an idle cut would)."""
    rows = query(
        db,
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'idem'",
    )
    return len(rows)


def test_each_step_commits_by_itself(own_database: str, worker_engine: Engine) -> None:
    """A claim and a finish are visible to another session at once: nothing waits in an open
    transaction, and the store's connections sit idle (not idle in transaction) between steps."""
    db = own_database
    store = KeyStore(worker_engine)
    key = seed_pending_key(db, "autocommit")
    claim = store.claim(key, "w1", 30)
    assert isinstance(claim, Claim)
    assert query(db, "SELECT status, fence FROM idempotency_keys") == [("processing", 1)]
    assert query(
        db,
        "SELECT state FROM pg_stat_activity"
        " WHERE datname = current_database() AND application_name = 'idem'",
    ) == [("idle",)]
    assert store.succeed(claim, {"ok": True}, "ref-1") is True
    assert query(db, "SELECT status, result FROM idempotency_keys") == [("succeeded", {"ok": True})]


def test_a_dropped_connection_costs_one_retried_statement(
    own_database: str, worker_engine: Engine
) -> None:
    """The server drops the store's pooled connection between the claim and the finish (no
    pre-ping to notice): the finish is sent again on a fresh connection and lands once; so
    does a claim after a second drop."""
    db = own_database
    store = KeyStore(worker_engine)
    first, second = seed_pending_key(db, "dropped-1"), seed_pending_key(db, "dropped-2")
    claim = store.claim(first, "w1", 30)
    assert isinstance(claim, Claim)

    assert _drop_store_connections(db) == 1
    assert store.succeed(claim, {"ok": True}, "ref-1") is True
    assert query(
        db,
        "SELECT status, fence, attempts FROM idempotency_keys WHERE idempotency_key = %s",
        (first,),
    ) == [("succeeded", 1, 1)]

    assert _drop_store_connections(db) == 1
    again = store.claim(second, "w1", 30)
    assert isinstance(again, Claim) and (again.fence, again.attempt) == (1, 1)


def test_one_keeper_renews_every_lease_held_and_leaves_finished_ones_alone(
    own_database: str, worker_engine: Engine
) -> None:
    """Three attempts hold 3 s leases at once for 4.5 s: one keeper thread renews all three
    (each lease would have run out at 3 s), none is cancelled, and after one attempt finishes
    its key is not renewed or cancelled again."""
    db = own_database
    store = KeyStore(worker_engine)
    keys = [seed_pending_key(db, f"held-{n}") for n in range(3)]
    claims = [store.claim(key, "w1", 3) for key in keys]
    assert all(isinstance(c, Claim) for c in claims)
    cancelled = [threading.Event() for _ in keys]
    first = claims[0]
    assert isinstance(first, Claim)

    with ExitStack() as others:
        beats = [
            others.enter_context(Heartbeat(store, c, 3, flag))
            for c, flag in zip(claims[1:], cancelled[1:], strict=True)
            if isinstance(c, Claim)
        ]
        with Heartbeat(store, first, 3, cancelled[0]) as first_beat:
            time.sleep(4.5)
            live = query(
                db,
                "SELECT count(*) FROM idempotency_keys"
                " WHERE status = 'processing' AND locked_until > now() + interval '1 second'",
            )
            keepers = [t for t in threading.enumerate() if t.name == "lease-keeper"]
        assert store.succeed(first, {"ok": True}, None) is True
        time.sleep(1.5)
        still_live = query(db, "SELECT count(*) FROM idempotency_keys WHERE locked_until > now()")

    assert live == [(3,)]
    assert len(keepers) == 1
    assert still_live == [(2,)]
    assert not any(flag.is_set() for flag in cancelled)
    assert not first_beat.lost and not any(beat.lost for beat in beats)
    assert query(db, "SELECT status FROM idempotency_keys ORDER BY idempotency_key") == [
        ("succeeded",),
        ("processing",),
        ("processing",),
    ]
