"""Statements on the driver's own connection (outbox/store/driven.py) give their connection back
to the engine's pool however they end: a statement the server refuses (the input's fault) must
not keep its connection, or a receiver would stop answering after as many bad requests as its
pool holds."""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import DataError, OperationalError

from outbox.core.settings import Settings
from outbox.store.driven import driven, rows_once_more
from outbox.store.engines import create_receiver_engine, create_sync_engine
from tests.support import libpq, query, wait_until

REFUSED = text("SELECT CAST(:value AS integer) AS n")
BACKEND = text("SELECT pg_backend_pid() AS pid")


def _settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, redis_url="redis://unused", db_pool_size=2)


def test_a_refused_statement_gives_its_connection_back_to_the_worker_pool(
    own_database: str,
) -> None:
    engine = create_sync_engine(_settings(own_database), pool_size=1, max_overflow=0)
    try:
        (first,) = rows_once_more(engine, BACKEND, {})
        for _ in range(5):
            with pytest.raises(DataError):
                rows_once_more(engine, REFUSED, {"value": "not a number"})
            assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        # The same connection, kept: it was given back, not dropped.
        assert rows_once_more(engine, BACKEND, {}) == [first]
    finally:
        engine.dispose()


def test_a_refused_statement_gives_its_connection_back_to_the_receiver_pool(
    own_database: str,
) -> None:
    async def scenario() -> None:
        engine = create_receiver_engine(_settings(own_database))
        try:
            async with driven(engine) as conn:
                first = await conn.first(BACKEND, {})
            for _ in range(5):
                with pytest.raises(DataError):
                    async with driven(engine) as conn:
                        await conn.first(REFUSED, {"value": "not a number"})
                assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
            async with driven(engine) as conn:
                assert await conn.first(BACKEND, {}) == first
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def _lock_waits(database_url: str) -> int:
    # This database's sessions only: the server may serve others.
    ((count,),) = query(
        database_url,
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    return int(count)


def test_a_statement_chosen_as_a_deadlocks_victim_is_run_again(own_database: str) -> None:
    """Two statements lock in opposite orders: the server rolls one back as the deadlock's
    victim; the store runs it again (it wrote nothing) and it succeeds once the other has
    finished, instead of raising DeadlockDetected as if the step had failed.

    The server checks a wait for a deadlock once, `deadlock_timeout` after it began, and the
    session whose check finds the cycle is the victim. So the store's statement is made to
    close the cycle: it takes a turn (advisory lock 999, shared) and row 2, and waits at a gate
    (an advisory lock the test holds) until the other transaction waits for the turn; then it
    goes for row 1, held by the other, and its check, 200 ms later, finds the cycle. The other's
    check comes after a minute. Whatever the machine's load, the store's statement is the
    victim.

    The turn makes the second run wait for the other. A lock like it is handed to the session
    queued for it by the one that lets it go, so the victim's rollback gives it to the other,
    and the second run queues behind. A row is not: a row whose updater rolled back is free to
    whoever comes first, and a second run that took row 2 before the other's process was
    scheduled closed the cycle again."""
    with psycopg.connect(libpq(own_database), autocommit=True) as setup:
        setup.execute("CREATE TABLE locks (id int PRIMARY KEY, n int NOT NULL)")
        setup.execute("INSERT INTO locks VALUES (1, 0), (2, 0)")
        name = make_url(own_database).database
        setup.execute(f"ALTER DATABASE \"{name}\" SET deadlock_timeout = '200ms'")
    engine = create_sync_engine(
        _settings(own_database), pool_size=1, max_overflow=0, autocommit=True
    )
    # The turn, row 2, the gate (its key made from row 2's id, so it is taken after row 2), row 1.
    both = text(
        "WITH turn AS (SELECT pg_advisory_xact_lock_shared(999)),"
        " first AS (UPDATE locks SET n = n + 1 WHERE id = 2 AND EXISTS (SELECT FROM turn)"
        "           RETURNING id),"
        " gated AS (SELECT first.id FROM first,"
        "           LATERAL pg_advisory_xact_lock(first.id + 1000) AS gate),"
        " second AS (UPDATE locks SET n = n + 1 WHERE id = (SELECT id - 1 FROM gated)"
        "            RETURNING id)"
        " SELECT count(*) AS done FROM second"
    )
    outcome: list[object] = []

    def run_it() -> None:
        try:
            outcome.append(rows_once_more(engine, both, {}))
        except Exception as error:  # the assertion below shows it
            outcome.append(error)

    try:
        with (
            psycopg.connect(libpq(own_database), autocommit=True) as gate,
            psycopg.connect(libpq(own_database)) as other,
        ):
            gate.execute("SELECT pg_advisory_lock(1002)")
            other.execute("SET deadlock_timeout = '1min'")
            other.execute("UPDATE locks SET n = n + 10 WHERE id = 1")
            thread = threading.Thread(target=run_it)
            thread.start()
            wait_until(lambda: _lock_waits(own_database) == 1, timeout=10, interval=0.02)
            # The turn is the thread's: the other transaction waits for it, then takes row 2.
            closer = threading.Thread(
                target=lambda: other.execute(
                    "SELECT pg_advisory_xact_lock(999); UPDATE locks SET n = n + 10 WHERE id = 2"
                )
            )
            closer.start()
            wait_until(lambda: _lock_waits(own_database) == 2, timeout=10, interval=0.02)
            # The gate opens: the thread's statement waits for row 1 and closes the cycle. It
            # is rolled back, the other takes the turn and row 2, and the thread's runs again.
            gate.execute("SELECT pg_advisory_unlock(1002)")
            closer.join(timeout=30)
            assert not closer.is_alive()
            other.commit()
            thread.join(timeout=30)
    finally:
        engine.dispose()
    assert outcome == [[{"done": 1}]]
    with psycopg.connect(libpq(own_database)) as check:
        assert check.execute("SELECT n FROM locks ORDER BY id").fetchall() == [(11,), (11,)]


def _end_own_connections(database_url: str, pids: set[int]) -> None:
    ended = query(
        database_url,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE pid = ANY(%s)",
        (list(pids),),
    )
    assert ended == [(len(pids),)]


def test_a_restart_costs_the_worker_pool_one_reconnect_not_one_per_connection(
    own_database: str,
) -> None:
    """Every pooled connection ended at once (a restart): the statement that finds one dead
    is sent once more and succeeds, because the pool drops all of them then, not only the one
    it found (with only that one dropped, the second try met the next dead connection)."""
    engine = create_sync_engine(
        _settings(own_database), pool_size=3, max_overflow=0, pre_ping=False, autocommit=True
    )
    try:
        held = [engine.raw_connection() for _ in range(3)]
        pids = {c.driver_connection.info.backend_pid for c in held}  # type: ignore[union-attr]
        for connection in held:
            connection.close()
        _end_own_connections(own_database, pids)
        (row,) = rows_once_more(engine, BACKEND, {})
        assert row["pid"] not in pids
        # The pool's other two are replaced as they are checked out, never handed out dead.
        again = [engine.raw_connection() for _ in range(3)]
        assert {c.driver_connection.info.backend_pid for c in again}.isdisjoint(pids)  # type: ignore[union-attr]
        for connection in again:
            connection.close()
    finally:
        engine.dispose()


def test_a_restart_costs_the_receiver_pool_one_request_not_one_per_connection(
    own_database: str,
) -> None:
    """The receiver's pool the same way: the one step that finds a connection dead fails (a
    503 to its caller, nothing stored); every step after it gets a live connection."""

    async def scenario() -> None:
        engine = create_receiver_engine(_settings(own_database))
        try:
            async with driven(engine) as one, driven(engine) as other:  # both in the pool
                pids = {(await c.first(BACKEND, {}) or {})["pid"] for c in (one, other)}
            _end_own_connections(own_database, pids)
            with pytest.raises(OperationalError) as found:
                async with driven(engine) as conn:
                    await conn.first(BACKEND, {})
            assert found.value.connection_invalidated
            for _ in range(4):
                async with driven(engine) as conn:
                    row = await conn.first(BACKEND, {})
                assert row is not None and row["pid"] not in pids
        finally:
            await engine.dispose()

    asyncio.run(scenario())
