"""Statements on the driver's own connection (outbox/store/driven.py) give their connection back
to the engine's pool however they end: a statement the server refuses (the input's fault) must
not keep its connection, or a receiver would stop answering after as many bad requests as its
pool holds."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DataError

from outbox.core.settings import Settings
from outbox.store.driven import driven, rows_once_more
from outbox.store.engines import create_receiver_engine, create_sync_engine

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
