"""Two relay processes and their lead, against a broker of the test's own with no worker, so
every message published stays in the queue to be counted: one relay publishes while the other
stands by; a SIGKILLed holder is replaced without waiting for its lease; a holder cut off
from the broker hands the rows to the standby instead of holding them back; a database that
fails for longer than a lease costs no lead."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis as redis_client

from outbox.core.settings import Settings
from outbox.operate import stats
from outbox.store.engines import create_relay_engine
from tests.support import (
    Stack,
    TcpProxy,
    proxied_database,
    query,
    queued_keys,
    seed_due_outbox,
    wait_until,
)

# Checks every 0.5 s; a holder that stops renewing loses the lead 1.5 s later.
LEAD_SECONDS = "1.5"


@pytest.fixture
def broker(own_redis: str) -> Iterator[redis_client.Redis[Any]]:
    client: redis_client.Redis[Any] = redis_client.Redis.from_url(own_redis)
    yield client
    client.close()


@pytest.fixture
def stack(own_database: str, own_redis: str, routes_file: Path, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(
        own_database,
        own_redis,
        routes_file,
        tmp_path,
        extra_env={
            "RELAY_LEAD_SECONDS": LEAD_SECONDS,
            "LOG_LEVEL": "DEBUG",  # each pass that publishes logs `relay.published`
            "RELAY_BATCH_SIZE": "20",
            "RELAY_CLAIM_SECONDS": "3",
            "BROKER_TIMEOUT_SECONDS": "1",
        },
    )
    yield stack
    stack.stop_all()


def _unpublished(db: str) -> int:
    return int(query(db, "SELECT count(*) FROM outbox WHERE published_at IS NULL")[0][0])


def _keys(broker: redis_client.Redis[Any]) -> Counter[str]:
    """How many messages the queue holds for each key."""
    return Counter(queued_keys(broker))


def _holder_pid(db: str) -> int | None:
    """The publishing relay's pid, read from what an operator's `idem stats` shows
    (`relay_lead`: host:pid:tag); None while no relay holds the lead."""
    engine = create_relay_engine(Settings(database_url=db))
    try:
        holder: str | None = stats.collect(engine)["outbox"]["relay_lead"]
    finally:
        engine.dispose()
    return None if holder is None else int(holder.split(":")[-2])


def _start_two(stack: Stack) -> None:
    """relay-a first, holding the lead; relay-b then, standing by."""
    stack.start_relay("relay-a")
    wait_until(lambda: '"relay.lead_taken"' in stack.logs("relay-a"), timeout=30)
    stack.start_relay("relay-b")
    wait_until(lambda: '"relay.standing_by"' in stack.logs("relay-b"), timeout=30)


def test_one_relay_publishes_and_a_killed_holder_is_replaced_at_the_standbys_next_check(
    own_database: str, stack: Stack, broker: redis_client.Redis[Any]
) -> None:
    db = own_database
    _start_two(stack)
    seed_due_outbox(db, 200)
    query(db, "NOTIFY outbox")
    wait_until(lambda: _unpublished(db) == 0, timeout=60)
    assert '"relay.published"' in stack.logs("relay-a")
    assert '"relay.published"' not in stack.logs("relay-b")
    assert _holder_pid(db) == stack.processes["relay-a"].pid

    # SIGKILL: no resign. The server ends the holder's connection, and the standby takes the
    # lead at its next check, long before the lease in the row (renewed a moment ago) is over.
    stack.processes["relay-a"].send_signal(signal.SIGKILL)
    stack.processes["relay-a"].wait(timeout=10)
    wait_until(lambda: '"relay.lead_taken"' in stack.logs("relay-b"), timeout=30)
    seed_due_outbox(db, 200, first=201)
    query(db, "NOTIFY outbox")
    wait_until(lambda: _unpublished(db) == 0, timeout=60)
    assert '"relay.published"' in stack.logs("relay-b")
    assert _holder_pid(db) == stack.processes["relay-b"].pid
    stack.stop_all()  # a relay that stops gives its lead up
    assert _holder_pid(db) is None

    keys = _keys(broker)
    assert set(keys) == {f"k-{n}" for n in range(1, 401)}
    assert max(keys.values()) == 1  # a's last pass had ended (every row marked) when it died


def test_a_holder_cut_off_from_the_broker_hands_the_rows_to_the_standby(
    own_database: str, own_redis: str, stack: Stack, broker: redis_client.Redis[Any]
) -> None:
    """relay-a reaches the broker through a forwarder the test cuts; it still reaches
    PostgreSQL, so only its failing passes can tell it to let the lead go. A lead of 6 s, longer
    than a failing publish takes (about 2 s here), so the lead is not lost by a pass that
    outlasts it: renewing it between failed passes would keep it until the backoff grew past
    the lease."""
    db = own_database
    stack.extra_env["RELAY_LEAD_SECONDS"] = "6"
    port = int(own_redis.rsplit(":", 1)[1].split("/")[0])
    proxy = TcpProxy(port).start()
    direct = stack.broker_url
    try:
        stack.broker_url = direct.replace(f":{port}", f":{proxy.port}")
        stack.start_relay("relay-a")
        wait_until(lambda: '"relay.lead_taken"' in stack.logs("relay-a"), timeout=30)
        stack.broker_url = direct
        stack.start_relay("relay-b")
        wait_until(lambda: '"relay.standing_by"' in stack.logs("relay-b"), timeout=30)

        proxy.cut()
        seed_due_outbox(db, 100)
        query(db, "NOTIFY outbox")
        wait_until(lambda: _unpublished(db) == 0, timeout=60)
        assert _holder_pid(db) == stack.processes["relay-b"].pid
        # relay-a let the lead go by itself: its lease may have run out while it waited out a
        # backoff, and it says so at its next turn (renewing between failures, it never would).
        wait_until(lambda: '"relay.lead_released"' in stack.logs("relay-a"), timeout=30)
    finally:
        stack.stop_all()
        proxy.stop()
    assert '"relay.publish_failed"' in stack.logs("relay-a")
    assert '"relay.lead_taken"' in stack.logs("relay-b")
    assert '"relay.published"' not in stack.logs("relay-a")
    keys = _keys(broker)
    assert set(keys) == {f"k-{n}" for n in range(1, 101)}
    assert max(keys.values()) == 1


def test_a_database_outage_longer_than_the_lead_costs_no_lead(
    own_database: str, stack: Stack, broker: redis_client.Redis[Any]
) -> None:
    """A failover leaves every relay without a database for 10 to 15 s. The lead lives there,
    so no standby can take it meanwhile; a holder that gave it up for failing passes stood
    aside a lease after the database was back, with rows due (the first publish came 10 s
    after intake's in a Patroni failover). Its failures on PostgreSQL keep the lead: the rows
    go out at its first pass once the database answers."""
    db = own_database
    proxy, through = proxied_database(db)
    try:
        stack.database_url = through
        stack.start_relay("relay-a")
        wait_until(lambda: '"relay.lead_taken"' in stack.logs("relay-a"), timeout=30)
        proxy.cut()
        seed_due_outbox(db, 50)  # due while the relay cannot reach them
        # Three leases of failures (1.5 s each): its own lease ran out long ago.
        wait_until(lambda: stack.logs("relay-a").count('"relay.publish_failed"') >= 3, timeout=30)
        wait_until(lambda: _lease_over(db), timeout=30)
        proxy.start()
        wait_until(lambda: _unpublished(db) == 0, timeout=60)
    finally:
        stack.stop_all()
        proxy.stop()
    logs = stack.logs("relay-a")
    assert '"relay.lead_released"' not in logs
    assert logs.count('"relay.lead_taken"') == 1
    keys = _keys(broker)
    assert set(keys) == {f"k-{n}" for n in range(1, 51)}


def _lease_over(db: str) -> bool:
    return bool(query(db, "SELECT held_until < now() FROM relay_lead")[0][0])
