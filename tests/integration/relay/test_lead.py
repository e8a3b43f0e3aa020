"""The relays' lead on real PostgreSQL: one holder at a time, a standby that takes over when the
holder resigns, dies (its lease runs out, or its connection is gone) or cannot publish, and a
loop that runs no pass while it stands by.

Each relay's checks are driven by a clock of the test's own; the lease in the database runs on
PostgreSQL's clock, so a test that needs it to run out sleeps past it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.relay.lead import Lead
from outbox.relay.loop import run_relay
from outbox.relay.publisher import create_publisher
from outbox.store.engines import create_relay_engine
from tests.support import libpq, query, seed_due_outbox, statements_sent, wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def engine(own_database: str) -> Iterator[Engine]:
    engine = create_relay_engine(Settings(database_url=own_database))
    yield engine
    engine.dispose()


@pytest.fixture
def statements(engine: Engine) -> Iterator[list[str]]:
    """Every statement the engine sends, in order."""
    sent: list[str] = []

    def count(_cursor: Any, statement: str, _params: Any) -> None:
        sent.append(statement)

    with statements_sent(engine, count):
        yield sent


def _holder(db: str) -> str | None:
    rows = query(db, "SELECT holder FROM relay_lead WHERE held_until > now()")
    return rows[0][0] if rows else None


def test_one_relay_leads_and_a_standby_takes_over_at_its_next_check_once_it_resigns(
    own_database: str, engine: Engine, statements: list[str]
) -> None:
    clock = Clock()
    a = Lead(engine, 10.0, holder="a", clock=clock)
    b = Lead(engine, 10.0, holder="b", clock=clock)
    assert a.holds() is True
    assert b.holds() is False
    assert _holder(own_database) == "a"
    # Between checks nobody asks the database: the holder runs its passes, the standby rests.
    statements.clear()
    clock.now += 3.0
    assert (a.holds(), b.holds()) == (True, False)
    assert statements == []
    assert a.seconds_to_check() == pytest.approx(10.0 / 3 - 3.0)
    clock.now += 0.4  # both checks due: the holder renews, the standby finds it held
    assert (a.holds(), b.holds()) == (True, False)
    assert len(statements) == 2
    a.resign()
    # The lease had almost 10 s left in the database; the standby takes it at its next check.
    clock.now += 10.0 / 3
    assert b.holds() is True
    assert _holder(own_database) == "b"
    assert a.holds() is False


def test_a_holder_that_died_is_replaced_once_its_lease_has_run_out(
    own_database: str, engine: Engine
) -> None:
    clock = Clock()
    a = Lead(engine, 1.0, holder="a", clock=clock)
    b = Lead(engine, 1.0, holder="b", clock=clock)
    assert a.holds() is True
    clock.now += 0.34
    assert b.holds() is False  # the lease is still running
    time.sleep(1.1)  # "a" renews nothing: it is dead
    clock.now += 0.34
    assert b.holds() is True
    assert _holder(own_database) == "b"
    # "a" comes back (a pause, not a death): it finds the lead taken and stands by.
    clock.now += 0.34
    assert a.holds() is False


def test_a_holder_whose_connection_is_gone_is_replaced_before_its_lease_runs_out(
    own_database: str, engine: Engine
) -> None:
    """A relay killed (or its host rebooted, its connection reset) ends its server process:
    a standby or a restarted relay need not wait for the rest of its lease."""
    clock = Clock()
    own = create_relay_engine(Settings(database_url=own_database))
    a = Lead(own, 10.0, holder="a", clock=clock)
    b = Lead(engine, 10.0, holder="b", clock=clock)
    assert a.holds() is True
    assert b.holds() is False  # a's connection is open: its lease stands
    own.dispose()  # the connection closes, as a killed process's does
    clock.now += 10.0 / 3

    def taken() -> bool:
        clock.now += 10.0 / 3  # the server may take a moment to end the process
        return b.holds()

    wait_until(taken, timeout=5)  # half the lease: the lease did not run out
    assert _holder(own_database) == "b"


def test_a_holder_that_cannot_publish_lets_the_lead_run_out_and_a_standby_takes_it(
    own_database: str, engine: Engine, statements: list[str]
) -> None:
    """A relay cut off from the broker still reaches PostgreSQL: if it renewed its lead, no row
    would go out while a standby that can publish waits."""
    clock = Clock()
    a = Lead(engine, 1.0, holder="a", clock=clock)
    b = Lead(engine, 1.0, holder="b", clock=clock)
    assert a.holds() is True
    assert b.holds() is False
    statements.clear()
    clock.now += 0.34
    # Its passes fail: it goes on trying until its lease ends, and renews nothing.
    assert a.holds(publishing=False) is True
    clock.now += 0.7
    assert a.holds(publishing=False) is False
    assert statements == []
    time.sleep(1.1)  # the lease runs out in the database too
    assert b.holds() is True
    assert _holder(own_database) == "b"
    # "a" stands aside half a lease (every standby checks within a third of one), then finds
    # "b" holding the lead.
    clock.now += 0.3
    assert a.holds() is False
    assert len(statements) == 1  # b's take only
    clock.now += 0.3
    assert a.holds() is False
    assert len(statements) == 2
    assert b.holds() is True
    assert _holder(own_database) == "b"


def test_a_relay_alone_that_cannot_publish_takes_the_lead_again_after_half_a_lease(
    own_database: str, engine: Engine
) -> None:
    """With no standby to hand the rows to, standing aside only delays them: the relay tries
    again half a lease after its own ran out, through the broker's next node if it has one."""
    clock = Clock()
    a = Lead(engine, 1.0, holder="a", clock=clock)
    assert a.holds() is True
    clock.now += 1.04
    assert a.holds(publishing=False) is False
    time.sleep(1.1)  # the lease runs out in the database too
    clock.now += 0.4
    assert a.holds() is False  # not yet: a standby may still be about to check
    clock.now += 0.1
    assert a.holds() is True
    assert _holder(own_database) == "a"


def test_with_the_lead_off_every_relay_publishes_and_asks_nothing(
    engine: Engine, statements: list[str]
) -> None:
    a, b = Lead(engine, 0.0, holder="a"), Lead(engine, 0.0, holder="b")
    assert (a.holds(), b.holds(), a.holds(publishing=False)) == (True, True, True)
    assert a.seconds_to_check() == float("inf")
    a.resign()
    assert statements == []


class RestingWaiter:
    """Stands in for the LISTEN connection; counts waits and rests (a rest sleeps as the real
    one does), and stops the relay after `rests` rests or at its first wait."""

    def __init__(self, stop: threading.Event, rests: int) -> None:
        self.stop = stop
        self.rests: list[float] = []
        self.waits = 0
        self.limit = rests

    def wait(self, timeout: float) -> None:
        self.waits += 1  # only a holder waits on LISTEN: a standby that does is wrong
        self.stop.set()

    def rest(self, timeout: float) -> None:
        self.rests.append(timeout)
        time.sleep(timeout)
        if len(self.rests) >= self.limit:
            self.stop.set()

    def close(self) -> None:
        pass


def test_a_standby_relay_runs_no_pass_and_only_asks_for_the_lead(
    own_database: str, own_redis: str, engine: Engine, statements: list[str]
) -> None:
    """With another relay holding the lead, a relay takes no row (50 are due), listens to
    nothing and sends one statement per rest: its check."""
    db = own_database
    another = psycopg.connect(libpq(db), autocommit=True)  # the holder's live connection
    another.execute(
        "INSERT INTO relay_lead (id, holder, held_until, backend_pid)"
        " VALUES (1, 'another', now() + interval '1 hour', pg_backend_pid())",
    )
    seed_due_outbox(db, 50)
    # A check every lead/3 = 0.5 s: each rest is what is left of it after the check's
    # statement, so a check slower than the interval (a loaded machine) would leave none.
    settings = Settings(database_url=db, redis_url=own_redis, relay_lead_seconds=1.5)
    stop = threading.Event()
    waiter = RestingWaiter(stop, rests=4)
    try:
        run_relay(settings, engine, create_publisher(settings), stop, listener=waiter)
    finally:
        another.close()

    assert waiter.waits == 0
    assert len(waiter.rests) == 4
    assert all(0 < rest <= 0.5 + 1e-6 for rest in waiter.rests)
    assert len(statements) == 4 and all("relay_lead" in s for s in statements)
    assert query(db, "SELECT count(*) FROM outbox WHERE publish_attempts > 0") == [(0,)]
    assert _holder(db) == "another"
