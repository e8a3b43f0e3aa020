"""The receiver's accept statements, sent on the driver's own connection.

Every event costs the receiver one statement, and through SQLAlchemy's async execution that
statement cost the receiver's CPU twice what the statement itself does: the execution context,
the parameter processing, the result wrapper and the greenlet hops around each (0.40 against
0.21 ms of the receiver's CPU per `RESERVE_KEY`, 16 in flight; docs/performance.md). So the
hot statements go to psycopg directly, on a connection checked out of the engine's own pool:
the pool, its bounds and its connect-time checks stay the engine's.

What SQLAlchemy gave those statements is kept here, so a caller sees no difference:
- a driver error is raised as the SQLAlchemy error the engine would have raised (an outage as
  `OperationalError`, a value PostgreSQL cannot store as `DataError`), with parameters hidden
  and the server's DETAIL dropped (`scrubbed`);
- a connection the error shows dead, or one left mid-statement by a cancelled step, is
  invalidated instead of going back to the pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import TextClause
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.util import greenlet_spawn

from outbox.store.engines import HIDE_PARAMETERS, scrubbed


class Driven:
    """A psycopg connection from the engine's pool, for statements written as `text()`."""

    def __init__(self, engine: AsyncEngine, connection: psycopg.AsyncConnection[Any]) -> None:
        self._engine = engine
        self._connection = connection
        self._statement = ""

    async def first(self, statement: TextClause, params: dict[str, Any]) -> dict[str, Any] | None:
        """The statement's first row as a mapping, or None."""
        rows = await self._execute(statement, params)
        return rows[0] if rows else None

    async def all(self, statement: TextClause, params: dict[str, Any]) -> list[dict[str, Any]]:
        return await self._execute(statement, params)

    async def _execute(self, statement: TextClause, params: dict[str, Any]) -> list[dict[str, Any]]:
        self._statement = _compiled(self._engine, statement)
        async with self._connection.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(self._statement, params)
            return await cursor.fetchall() if cursor.description else []


@asynccontextmanager
async def driven(engine: AsyncEngine) -> AsyncIterator[Driven]:
    """A pooled connection for `Driven` statements, each committed by itself (the receiver's
    engine runs in autocommit). Back to the pool at the end, or invalidated as said above."""
    try:
        pooled = await engine.raw_connection()
    except psycopg.Error as error:
        raise _as_sqlalchemy(engine, error, "", _disconnect(engine, error)) from error
    connection: psycopg.AsyncConnection[Any] = pooled.driver_connection  # type: ignore[assignment]
    driven_connection = Driven(engine, connection)
    try:
        yield driven_connection
    except psycopg.Error as error:
        dead = connection.broken or connection.closed or _disconnect(engine, error)
        if dead:
            await greenlet_spawn(pooled.invalidate, error)
        raise _as_sqlalchemy(engine, error, driven_connection._statement, dead) from error
    except BaseException:
        # Cancelled mid-statement (the step's bound ran out): the connection's state is unknown.
        await greenlet_spawn(pooled.invalidate)
        raise
    await greenlet_spawn(pooled.close)


def _disconnect(engine: AsyncEngine, error: psycopg.Error) -> bool:
    return bool(engine.dialect.is_disconnect(error, None, None))  # type: ignore[arg-type]


def _as_sqlalchemy(
    engine: AsyncEngine, error: psycopg.Error, statement: str, invalidated: bool
) -> StatementError:
    wrapped = DBAPIError.instance(
        statement,
        None,
        error,
        psycopg.Error,
        hide_parameters=HIDE_PARAMETERS,
        connection_invalidated=invalidated,
        dialect=engine.dialect,
    )
    scrubbed(error, wrapped)
    return wrapped


_COMPILED: dict[tuple[str, str], str] = {}


def _compiled(engine: AsyncEngine, statement: TextClause) -> str:
    """The statement in the driver's parameter style (`%(name)s`), compiled once per dialect."""
    key = (engine.dialect.name + engine.dialect.driver, statement.text)
    found = _COMPILED.get(key)
    if found is None:
        found = _COMPILED[key] = str(statement.compile(dialect=engine.dialect))
    return found
