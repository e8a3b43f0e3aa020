"""The hot statements, sent on the driver's own connection from the engine's pool.

Every event costs the receiver one statement, the relay a share of two per pass, and the worker
a share of its claim and success statements. Through SQLAlchemy's execution each cost the
process's CPU about twice what the statement itself does: the execution context, the parameter
processing, the result wrapper and, in the receiver, the greenlet hops around each (0.40 against
0.21 ms of the receiver's CPU per `RESERVE_KEY` with 16 in flight; 0.26 against 0.12 ms of a
worker's per statement; docs/explanation/performance.md). So these statements go to psycopg
directly, on a
connection checked out of the engine's own pool: the pool, its bounds, its pre-ping and its
connect-time checks stay the engine's.

What SQLAlchemy gave those statements is kept, so a caller sees no difference:
- a driver error is raised as the SQLAlchemy error the engine would have raised (an outage as
  `OperationalError`, a value PostgreSQL cannot store as `DataError`), with parameters hidden
  and the server's DETAIL dropped (`engines.scrubbed`), and `connection_invalidated` set when
  the error shows the connection dead;
- such a connection, or one left mid-statement by a cancelled step, is invalidated instead of
  going back to the pool; a dead one also marks every connection the pool opened before it for
  a fresh connect at its next checkout, as SQLAlchemy does on a disconnect: a restart or a
  failover ends them all, and a pool that dropped only the one it found would hand out the
  others, dead, to one request each;
- on an engine outside autocommit each statement is committed by itself, as `begin()` did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row
from sqlalchemy import Dialect, Engine, TextClause
from sqlalchemy.exc import DBAPIError, StatementError
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.util import greenlet_spawn

from outbox.core.logs import get_logger
from outbox.store.engines import HIDE_PARAMETERS, on_standby, scrubbed, standby_error

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

log = get_logger(__name__)

Rows = list[dict[str, Any]]

# What the server rolls back to resolve a conflict between statements, not a fault of the
# statement: run again, it meets the other one finished.
_TRANSIENT = (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure)


def rows_once_more(engine: Engine, statement: TextClause, params: dict[str, Any]) -> Rows:
    """Run one statement; its rows, as mappings. A statement that met a connection the server
    had dropped (PostgreSQL restarted, an idle connection cut) is sent once more on a fresh
    one, instead of pinging before every statement: one round trip per step, not two. So is
    one the server chose as a deadlock's victim (or a serialization failure): it was rolled
    back whole, so it wrote nothing, and the other transaction, no longer waiting for it, has
    usually gone on by its second run. Not always: a row the victim's rollback freed goes to
    whoever asks first, and a second run that asks before the other's process was scheduled
    can close the same cycle again; that second error is raised, as any other. Only for steps
    that are safe to repeat (each caller's docstring says why)."""
    for attempt in (1, 2):
        try:
            return _rows(engine, statement, params)
        except DBAPIError as error:
            if attempt == 2:
                raise
            if isinstance(error.orig, _TRANSIENT):
                log.warning("store.statement_retried", error=type(error.orig).__name__)
                continue
            if not error.connection_invalidated:
                raise
            log.warning("store.reconnect", error=type(error.orig).__name__)
    raise AssertionError("unreachable")


def _rows(engine: Engine, statement: TextClause, params: dict[str, Any]) -> Rows:
    compiled = _compiled(engine.dialect, statement)
    with _pooled(engine, compiled.text) as connection:
        with connection.cursor(row_factory=dict_row) as cursor:
            cursor.execute(compiled.text, compiled.params(params))
            rows = cursor.fetchall() if cursor.description else []
        if not connection.autocommit:
            connection.commit()
        return rows


@contextmanager
def _pooled(engine: Engine, statement: str) -> Iterator[psycopg.Connection[Any]]:
    try:
        pooled = engine.raw_connection()
    except psycopg.Error as error:
        raise _as_sqlalchemy(engine.dialect, error, "", False) from error
    connection: psycopg.Connection[Any] = pooled.driver_connection  # type: ignore[assignment]
    try:
        yield connection
    except psycopg.Error as error:
        dead = _dead(connection) or on_standby(error)
        if dead:
            _invalidate_generation(engine, pooled, error)
        else:
            pooled.close()  # a refused statement (bad input): the connection is fine
        raise _as_sqlalchemy(engine.dialect, error, statement, dead) from error
    except BaseException:
        pooled.invalidate()
        raise
    pooled.close()


class Driven:
    """A receiver's psycopg connection from the engine's pool, for statements written as
    `text()`."""

    def __init__(self, dialect: Dialect, connection: psycopg.AsyncConnection[Any]) -> None:
        self._dialect = dialect
        self._connection = connection
        self.statement = ""

    async def first(self, statement: TextClause, params: dict[str, Any]) -> dict[str, Any] | None:
        """The statement's first row as a mapping, or None."""
        rows = await self.all(statement, params)
        return rows[0] if rows else None

    async def all(self, statement: TextClause, params: dict[str, Any]) -> Rows:
        compiled = _compiled(self._dialect, statement)
        self.statement = compiled.text
        async with self._connection.cursor(row_factory=dict_row) as cursor:
            await cursor.execute(compiled.text, compiled.params(params))
            return await cursor.fetchall() if cursor.description else []


@asynccontextmanager
async def driven(engine: AsyncEngine) -> AsyncIterator[Driven]:
    """A pooled connection of the receiver's engine (autocommit: each statement commits by
    itself). Back to the pool at the end, or invalidated as the module's docstring says."""
    dialect = engine.dialect
    try:
        pooled = await engine.raw_connection()
    except psycopg.Error as error:
        raise _as_sqlalchemy(dialect, error, "", False) from error
    connection: psycopg.AsyncConnection[Any] = pooled.driver_connection  # type: ignore[assignment]
    step = Driven(dialect, connection)
    try:
        yield step
    except psycopg.Error as error:
        dead = _dead(connection) or on_standby(error)
        if dead:
            await greenlet_spawn(_invalidate_generation, engine.sync_engine, pooled, error)
        else:
            await greenlet_spawn(pooled.close)  # a refused statement: the connection is fine
        raise _as_sqlalchemy(dialect, error, step.statement, dead) from error
    except BaseException:
        # Cancelled mid-statement (the step's bound ran out): the connection's state is unknown.
        await greenlet_spawn(pooled.invalidate)
        raise
    await greenlet_spawn(pooled.close)


def _invalidate_generation(engine: Engine, pooled: PoolProxiedConnection, error: Exception) -> None:
    """Invalidate `pooled` and every connection opened before it (SQLAlchemy's own step on a
    disconnect, `Connection._handle_dbapi_exception`; those in use are replaced when they are
    next checked out)."""
    engine.pool._invalidate(pooled, error)


def _dead(connection: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    """The dialect's own test of an error that ended the connection (`is_disconnect`)."""
    return connection.broken or connection.closed


def _as_sqlalchemy(
    dialect: Dialect, error: psycopg.Error, statement: str, invalidated: bool
) -> StatementError:
    if on_standby(error):
        return standby_error(statement, error)
    wrapped = DBAPIError.instance(
        statement,
        None,
        error,
        psycopg.Error,
        hide_parameters=HIDE_PARAMETERS,
        connection_invalidated=invalidated,
        dialect=dialect,
    )
    scrubbed(error, wrapped)
    return wrapped


@dataclass(frozen=True)
class _Compiled:
    text: str
    # The values of the statement's own `bindparam`s with defaults, for callers that omit them.
    defaults: dict[str, Any]

    def params(self, given: dict[str, Any]) -> dict[str, Any]:
        return {**self.defaults, **given} if self.defaults else given


_COMPILED: dict[tuple[str, str], _Compiled] = {}


def _compiled(dialect: Dialect, statement: TextClause) -> _Compiled:
    """The statement in the driver's parameter style (`%(name)s`), compiled once per dialect.
    Only statements SQLAlchemy would pass on unchanged: none of their parameters' types may
    convert values on the way (a bind processor), which the driver's path would skip."""
    key = (dialect.name + dialect.driver, statement.text)
    found = _COMPILED.get(key)
    if found is None:
        compiled = statement.compile(dialect=dialect)
        if compiled._bind_processors:
            raise TypeError(f"parameters {sorted(compiled._bind_processors)} need converting")
        defaults = {name: bind.value for name, bind in compiled.binds.items() if not bind.required}
        found = _COMPILED[key] = _Compiled(str(compiled), defaults)
    return found
