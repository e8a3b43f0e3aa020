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


def test_a_statement_chosen_as_a_deadlocks_victim_is_run_again(own_database: str) -> None:
    """Two statements lock two rows in opposite orders: the server rolls one back as the
    deadlock's victim; the store runs it again (it wrote nothing) and it succeeds once the
    other has finished, instead of raising DeadlockDetected as if the step had failed."""
    with psycopg.connect(libpq(own_database), autocommit=True) as setup:
        setup.execute("CREATE TABLE locks (id int PRIMARY KEY, n int NOT NULL)")
        setup.execute("INSERT INTO locks VALUES (1, 0), (2, 0)")
        name = make_url(own_database).database
        setup.execute(f"ALTER DATABASE \"{name}\" SET deadlock_timeout = '200ms'")
    engine = create_sync_engine(
        _settings(own_database), pool_size=1, max_overflow=0, autocommit=True
    )
    # Row 2, then row 1 (which the other transaction holds): this statement waits first,
    # so its deadlock check fires first and it is the victim.
    both = text(
        "WITH first AS (UPDATE locks SET n = n + 1 WHERE id = 2 RETURNING id),"
        " second AS (UPDATE locks SET n = n + 1 WHERE id = (SELECT id - 1 FROM first)"
        "            RETURNING id)"
        " SELECT count(*) AS done FROM second"
    )
    outcome: list[object] = []
    try:
        with psycopg.connect(libpq(own_database)) as other:
            other.execute("UPDATE locks SET n = n + 10 WHERE id = 1")
            thread = threading.Thread(
                target=lambda: outcome.append(rows_once_more(engine, both, {}))
            )
            thread.start()
            # Once the thread's statement holds row 2 and waits for row 1, it waits first,
            # whatever the machine's load, so its deadlock check fires first.
            wait_until(
                lambda: (
                    query(
                        own_database,
                        # This database's sessions only: the server may serve others.
                        "SELECT count(*) FROM pg_stat_activity"
                        " WHERE datname = current_database() AND wait_event_type = 'Lock'",
                    )
                    == [(1,)]
                ),
                timeout=10,
                interval=0.02,
            )
            # Row 2 is the thread's; waiting for it closes the cycle. The thread's statement
            # is rolled back, this one goes on, and the thread's runs again.
            other.execute("UPDATE locks SET n = n + 10 WHERE id = 2")
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
