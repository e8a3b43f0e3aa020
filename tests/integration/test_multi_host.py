"""Every process reaches PostgreSQL through libpq's multi-host form, and a write refused by a
standby is an outage (the connection dropped, the step retried or answered 503), not a bug.

Patroni, a managed database's failover and any replicated PostgreSQL are reached with
`host=a,b,c ... target_session_attrs=read-write`: libpq tries the hosts in turn and keeps the
first one that accepts writes. Here the first host is a closed port (a dead node) and the
second the test database; the soak across real Patroni nodes is `make chaos-ha`.
"""

from __future__ import annotations

import asyncio
import threading

import psycopg
import pytest
from sqlalchemy import make_url, text
from sqlalchemy.exc import OperationalError

from outbox.core.conninfo import libpq_dsn
from outbox.core.settings import Settings
from outbox.relay.loop import Listener
from outbox.store.driven import driven, rows_once_more
from outbox.store.engines import create_receiver_engine, create_sync_engine
from outbox.store.migrate import upgrade
from tests.support import query

WRITE = text("INSERT INTO ha_probe (n) VALUES (1) RETURNING n")
DEAD_NODE = "127.0.0.1:1"


def _multi_host(database_url: str) -> str:
    """The test database as the second host of a libpq multi-host URL, after a dead node."""
    url = make_url(database_url)
    hosts = f"{DEAD_NODE},{url.host}:{url.port or 5432}"
    return f"postgresql://{url.username}@{hosts}/{url.database}?target_session_attrs=read-write"


def _settings(database_url: str) -> Settings:
    return Settings(database_url=database_url, redis_url="redis://unused", db_pool_size=1)


def test_every_kind_of_connection_finds_the_writable_host(own_database: str) -> None:
    settings = _settings(_multi_host(own_database))
    # Migrations (`idem migrate`, the CLI's start).
    upgrade(settings.database_url)
    # The worker's, relay's and sweeper's engine.
    engine = create_sync_engine(settings)
    try:
        assert rows_once_more(engine, text("SELECT 1 AS n"), {}) == [{"n": 1}]
    finally:
        engine.dispose()

    # The receiver's engine.
    async def receive() -> int:
        receiver = create_receiver_engine(settings)
        try:
            async with driven(receiver) as conn:
                row = await conn.first(text("SELECT 2 AS n"), {})
                assert row is not None
                return int(row["n"])
        finally:
            await receiver.dispose()

    assert asyncio.run(receive()) == 2
    # The relay's LISTEN connection, opened by libpq itself.
    with psycopg.connect(libpq_dsn(settings.sqlalchemy_url())) as conn:
        assert conn.execute("SELECT 3").fetchone() == (3,)


def test_the_relays_listener_hears_a_notify_through_the_multi_host_url(own_database: str) -> None:
    settings = _settings(_multi_host(own_database))
    listener = Listener(libpq_dsn(settings.sqlalchemy_url()), channel="ha_probe")
    try:
        listener.wait(0.1)  # connects and listens
        woke = threading.Event()
        waiter = threading.Thread(target=lambda: (listener.wait(30), woke.set()))
        waiter.start()
        query(own_database, "NOTIFY ha_probe")
        waiter.join(timeout=30)
        assert woke.is_set()
    finally:
        listener.close()


@pytest.fixture
def probe_table(own_database: str) -> str:
    query(own_database, "CREATE TABLE ha_probe (n integer)")
    return own_database


def _read_only(connection: psycopg.Connection) -> None:  # type: ignore[type-arg]
    """The connection now behaves as one to a standby: every write refused with 25006."""
    connection.execute("SET SESSION default_transaction_read_only = on")


def test_a_worker_step_refused_by_a_standby_is_sent_again_on_a_fresh_connection(
    probe_table: str,
) -> None:
    """A demoted primary refuses the write; the step is not lost to it: the connection is
    dropped and the step sent once more on a new one (libpq then finds the primary)."""
    engine = create_sync_engine(
        _settings(_multi_host(probe_table)), pool_size=1, max_overflow=0, autocommit=True
    )
    try:
        pooled = engine.raw_connection()
        _read_only(pooled.driver_connection)  # type: ignore[arg-type]
        pooled.close()
        assert rows_once_more(engine, WRITE, {}) == [{"n": 1}]
        assert query(probe_table, "SELECT count(*) FROM ha_probe") == [(1,)]
    finally:
        engine.dispose()


def test_a_standbys_refusal_is_an_outage_and_drops_the_connection(probe_table: str) -> None:
    """Through SQLAlchemy's own path, as through the driver's: OperationalError (the receiver's
    503 with Retry-After), the connection invalidated, the next statement on a fresh one."""
    engine = create_sync_engine(
        _settings(_multi_host(probe_table)), pool_size=1, max_overflow=0, autocommit=True
    )
    try:
        with engine.connect() as conn:
            _read_only(conn.connection.driver_connection)  # type: ignore[arg-type]
            with pytest.raises(OperationalError) as refused:
                conn.execute(WRITE)
            assert refused.value.connection_invalidated
        with engine.connect() as conn:
            assert conn.execute(WRITE).scalar() == 1
    finally:
        engine.dispose()


def test_a_standbys_refusal_on_the_receivers_path_is_an_outage(probe_table: str) -> None:
    async def scenario() -> None:
        engine = create_receiver_engine(_settings(_multi_host(probe_table)))
        try:
            async with driven(engine) as conn:
                await conn.all(text("SET SESSION default_transaction_read_only = on"), {})
            with pytest.raises(OperationalError) as refused:
                async with driven(engine) as conn:
                    await conn.first(WRITE, {})
            assert refused.value.connection_invalidated
            async with driven(engine) as conn:
                assert await conn.first(WRITE, {}) == {"n": 1}
        finally:
            await engine.dispose()

    asyncio.run(scenario())
