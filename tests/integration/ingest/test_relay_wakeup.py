"""The relay's wake-up after an accept (outbox/ingest/wakeup.py) on real PostgreSQL: the accept
statement commits without a NOTIFY, the receiver sends one after its commit, accepts that
commit while one is in flight share the next, every other writer of outbox rows still
notifies through the trigger, and an event is published at once with the relay's poll an
hour away."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import create_engine

from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_TASK
from outbox.ingest import wakeup
from outbox.ingest.wakeup import RelayWakeup
from outbox.store.engines import create_receiver_engine
from outbox.store.ingest import RESERVE_KEY
from tests.support import (
    Stack,
    envelope,
    finished,
    libpq,
    post_event,
    proxied_database,
    query,
    seed_due_outbox,
)

QUIET = 0.5  # a NOTIFY is delivered at its commit: long enough to hear one that was sent


@pytest.fixture
def listener(own_database: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(libpq(own_database), autocommit=True) as conn:
        conn.execute("LISTEN outbox")
        yield conn


def _heard(conn: psycopg.Connection[tuple[object, ...]], wait: float = QUIET) -> int:
    """How many NOTIFYs on `outbox` arrive within `wait` seconds."""
    return sum(1 for _ in conn.notifies(timeout=wait))


def _reserve(database_url: str, external_id: str) -> None:
    """The receiver's accept statement, as it sends it, in a transaction of its own."""
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                RESERVE_KEY,
                {
                    "key": f"webform:crm.lead.created:{external_id}",
                    "payload_hash": f"hash-{external_id}",
                    "correlation_id": f"corr-{external_id}",
                    "source": "webform",
                    "event_type": "crm.lead.created",
                    "route": "crm",
                    "workflow_name": None,
                    "execution_id": None,
                    "ttl_seconds": 86_400,
                    "lane": None,
                    "lane_rank": None,
                    "external_id": external_id,
                    "version": None,
                    "payload": "{}",
                    "trace_context": None,
                    "task_name": PROCESS_TASK,
                },
            )
    finally:
        engine.dispose()


def test_the_accept_sends_no_notify_and_every_other_writer_still_does(
    own_database: str, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    """The accept statement writes its outbox row and commits without waking anyone (it
    leaves that to its receiver), and so does a repeat of the key, which writes no outbox row;
    an outbox row written any other way (a retry, a replay, a backfill) wakes the relay through
    the trigger as before."""
    _reserve(own_database, "quiet-1")
    assert _heard(listener) == 0
    _reserve(own_database, "quiet-1")
    assert query(own_database, "SELECT count(*), max(duplicate_count) FROM idempotency_keys") == [
        (1, 1)
    ]
    assert _heard(listener) == 0
    seed_due_outbox(own_database, 1)
    assert _heard(listener) == 1


def test_accepts_while_a_notify_is_in_flight_share_the_next_one(
    own_database: str, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    """Fifty accepts that commit before the first NOTIFY is sent get one; one that commits
    while that NOTIFY is in flight gets one more, sent after it; then it rests."""

    async def scenario() -> tuple[int, int]:
        engine = create_receiver_engine(Settings(database_url=own_database, db_pool_size=2))
        try:
            wake = RelayWakeup(engine)
            for _ in range(50):
                wake.after_commit()
            await wake.settled()
            burst = wake.sent
            wake.after_commit()
            await asyncio.sleep(0)  # the sender has taken the request and is sending
            wake.after_commit()
            await wake.settled()
            return burst, wake.sent - burst
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == (1, 2)
    assert _heard(listener) == 3


def test_a_notify_that_fails_is_dropped_and_the_next_accept_asks_again(
    own_database: str, listener: psycopg.Connection[tuple[object, ...]]
) -> None:
    """With the database unreachable (its connections cut and refused) the wake-up is logged
    and dropped (the relay's poll finds the rows) and nothing is left waiting, however many
    accepts ask meanwhile; once the database is back, the same process's next accept's NOTIFY
    goes."""
    proxy, url = proxied_database(own_database)

    async def scenario() -> tuple[int, int]:
        engine = create_receiver_engine(
            Settings(database_url=url, db_pool_size=1, db_timeout_seconds=1)
        )
        try:
            wake = wakeup.of(engine)
            assert wakeup.of(engine) is wake  # one per engine
            proxy.cut()
            for _ in range(2):
                wake.after_commit()
                await asyncio.wait_for(wake.settled(), 30)
            while_down = wake.sent
            proxy.start()
            wake.after_commit()
            await asyncio.wait_for(wake.settled(), 30)
            return while_down, wake.sent
        finally:
            await engine.dispose()

    try:
        assert asyncio.run(scenario()) == (0, 1)
    finally:
        proxy.stop()
    assert _heard(listener) == 1


def test_an_event_is_published_at_once_with_the_relays_poll_an_hour_away(
    private_stack: Stack,
) -> None:
    """With RELAY_POLL_SECONDS at an hour and no relays' lead to renew (the renewal bounds the
    relay's sleep), only a wake-up gets an event to the worker: each of three events posted
    one after another, the relay idle between them, finishes in seconds."""
    stack = private_stack
    stack.extra_env.update(RELAY_POLL_SECONDS="3600", RELAY_LEAD_SECONDS="0")
    stack.start_all()
    for number in range(3):
        time.sleep(1)  # the relay has gone back to its wait
        key = post_event(stack, envelope(f"wake-{number}"))
        assert finished(stack, key, timeout=15)["status"] == "succeeded"
