"""A claim whose answer comes back after the lease's trust window never acts.

Found by the multi-host soak (docs/explanation/reliability.md): a worker cut from PostgreSQL had
sent a claim that the database executed; the answer was held by the network for the whole cut, and
reached the worker after the lease had run out and another worker had taken the key over and
acted. The attempt gave the lease up 4 ms later, but its action thread had already passed its
check and sent the write: a second effect.
"""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

from sqlalchemy import Engine

from outbox.core.routes import load_routes
from tests.support import Downstream, query, seed_pending_key, write_routes
from worker.attempt import run_attempt
from worker.lease import GIVE_UP_MARGIN, Heartbeat
from worker.store import Blocked, Claim, KeyStore

LEASE_SECONDS = 5


def test_a_heartbeat_begun_after_its_trust_window_is_given_up_before_anything_runs(
    own_database: str, worker_engine: Engine
) -> None:
    """Entering the heartbeat of a claim sent 0.8 of a lease ago or more sets the action's
    cancel flag and wakes the attempt at once, before the action's thread is started: the
    action sees the flag on its first look, whichever thread runs first."""
    store = KeyStore(worker_engine)
    key = seed_pending_key(own_database, "late-heartbeat")
    claim = store.claim(key, "test", LEASE_SECONDS)
    assert isinstance(claim, Claim)
    cancelled, wake = threading.Event(), threading.Event()
    late = claim.sent - 0.8 * LEASE_SECONDS
    with Heartbeat(store, claim, LEASE_SECONDS, cancelled, wake, late) as heartbeat:
        assert cancelled.is_set()
        assert wake.is_set()
        assert heartbeat.lost
    # A claim answered in time is held as before.
    query(
        own_database,
        "UPDATE idempotency_keys SET status = 'pending', in_flight_until = NULL"
        " WHERE idempotency_key = %s",
        (key,),
    )
    fresh = store.claim(key, "test", LEASE_SECONDS)
    assert isinstance(fresh, Claim)
    cancelled = threading.Event()
    with Heartbeat(store, fresh, LEASE_SECONDS, cancelled, None, fresh.sent) as heartbeat:
        assert not cancelled.is_set()
        assert not heartbeat.lost


class LateAnswers(KeyStore):
    """A store whose claims' answers arrive late: each claim reads as sent `late` seconds
    before it was (the network held the answer that long; the database acted at once)."""

    def __init__(self, engine: Engine, late: float) -> None:
        super().__init__(engine)
        self.late = late

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        claim = super().claim(key, owner, lease_seconds)
        if isinstance(claim, Claim):
            return dataclasses.replace(claim, sent=claim.sent - self.late)
        return claim


def test_an_uncertain_key_claimed_past_its_window_sends_neither_lookup_nor_write(
    own_database: str, worker_engine: Engine, downstream: Downstream, tmp_path: Path
) -> None:
    """An uncertain key (its last holder may have acted) whose claim is answered past the
    trust window: the attempt gives the lease up before starting anything, so the downstream
    sees no lookup (which could answer "not found" while the next holder writes) and no
    write, and nothing is recorded: the next holder decides."""
    downstream.reset()
    routes = load_routes(write_routes(tmp_path / "routes.toml", downstream.url))
    key = seed_pending_key(own_database, "late-uncertain")
    query(own_database, "UPDATE idempotency_keys SET uncertain = true")
    store = LateAnswers(worker_engine, late=(1 - GIVE_UP_MARGIN) * LEASE_SECONDS)
    outcome = run_attempt(store, routes, key, lease_seconds=LEASE_SECONDS)
    assert outcome == "lease_lost"
    assert downstream.lookups == []
    assert downstream.requests == []
    assert query(own_database, "SELECT status, uncertain FROM idempotency_keys") == [
        ("processing", True)
    ]
    # The same key claimed in time is looked up, then written once.
    query(
        own_database,
        "UPDATE idempotency_keys SET status = 'pending', locked_until = NULL,"
        " in_flight_until = NULL",
    )
    assert run_attempt(KeyStore(worker_engine), routes, key, lease_seconds=LEASE_SECONDS) == (
        "succeeded"
    )
    assert downstream.lookups == [key]
    assert downstream.effects == {key: 1}
