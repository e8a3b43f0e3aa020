"""A claim whose answer comes back after the lease's trust window never acts.

Found by the multi-host soak (docs/reliability.md): a worker cut from PostgreSQL had sent a
claim that the database executed; the answer was held by the network for the whole cut, and
reached the worker after the lease had run out and another worker had taken the key over and
acted. The attempt gave the lease up 4 ms later, but its action thread had already passed its
check and sent the write: a second effect.
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine

from tests.support import query, seed_pending_key
from worker.lease import Heartbeat
from worker.store import Claim, KeyStore

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
        "UPDATE idempotency_keys SET status = 'pending' WHERE idempotency_key = %s",
        (key,),
    )
    fresh = store.claim(key, "test", LEASE_SECONDS)
    assert isinstance(fresh, Claim)
    cancelled = threading.Event()
    with Heartbeat(store, fresh, LEASE_SECONDS, cancelled, None, fresh.sent) as heartbeat:
        assert not cancelled.is_set()
        assert not heartbeat.lost
