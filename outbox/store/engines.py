"""Engines for each execution model: async for the receiver, sync for the relay and workers."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import psycopg
from sqlalchemy import Engine, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import ExceptionContext

from outbox.core.logs import get_logger
from outbox.core.settings import Settings

if TYPE_CHECKING:
    # Only the receiver runs async engines; SQLAlchemy's asyncio layer (and the ORM it loads)
    # adds about 0.1 s of CPU to the start of every other process and command.
    from sqlalchemy.ext.asyncio import AsyncEngine

log = get_logger(__name__)

# Errors that mean "the database is not there right now", as opposed to a bug in a statement.
UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53", "57")

# application_name of each process kind's connections (the worker's are plain "idem").
RECEIVER = "idem-receiver"
RELAY = "idem-relay"

# Every engine hides bound parameters from its errors' text. They hold full keys, payloads and
# stored results, and an error's text travels: into Celery's failure tracebacks, the relay's
# and sweeper's `detail` fields, a 500's traceback. An error keeps the SQL and the database's
# message, which is what a reader needs to find the cause.
HIDE_PARAMETERS = True


def on_standby(error: BaseException) -> bool:
    """A write refused because the server is a standby (SQLSTATE 25006): the node this
    connection reached was demoted by a failover or switchover, or a one-host URL names a
    replica. Not the statement's fault: an outage of the primary, as a dropped connection is.
    The connection is dropped (and the pool with it, as on any disconnect), so the next one is
    opened anew and, with `target_session_attrs=read-write`, finds the new primary."""
    return isinstance(error, psycopg.errors.ReadOnlySqlTransaction)


def _primary_message_only(context: ExceptionContext) -> sa_exc.DBAPIError | None:
    original = context.original_exception
    if isinstance(original, psycopg.Error):
        scrubbed(original, context.sqlalchemy_exception)
    if on_standby(original):
        context.is_disconnect = True
        return standby_error(context.statement or "", original)
    return None


def standby_error(statement: str, original: BaseException) -> sa_exc.OperationalError:
    """A standby's refusal raised as what it means to the caller: the database is unavailable
    (a receiver answers 503 with Retry-After, a worker retries)."""
    error = sa_exc.OperationalError(
        statement, None, original, hide_parameters=HIDE_PARAMETERS, connection_invalidated=True
    )
    if isinstance(original, psycopg.Error):
        scrubbed(original, error)
    return error


def scrubbed(original: psycopg.Error, wrapped: BaseException | None) -> None:
    """Drop PostgreSQL's DETAIL and CONTEXT from an error's text, for the reason above.

    They quote the data a statement carried: a constraint violation's "Failing row contains
    (…)" is the whole row, a JSON error's context is the text around the bad token. The primary
    message names what failed (the constraint, the type); the SQLSTATE and every diagnostic
    field stay on the driver's error (`orig.diag`, `orig.sqlstate`) for code that asks.
    """
    primary = original.diag.message_primary
    if not primary:
        return
    original.args = (primary,)
    if wrapped is not None:
        # The wrapper copied the driver's text when it was built: rebuilt in the same form.
        kind = type(original)
        wrapped.args = (f"({kind.__module__}.{kind.__name__}) {primary}",)


def _without_data_in_errors(engine: Engine) -> None:
    event.listen(engine, "handle_error", _primary_message_only)


# How long, in statement timeouts, a connection's link may stay silent before the client
# itself gives the connection up (see `_silent_link_bound`).
SILENT_LINK_TIMEOUTS = 2


def _silent_link_bound(settings: Settings) -> dict[str, Any]:
    """The client's own bound on a link that went silent (a partition that drops packets
    instead of refusing them). The statement timeout is the server's, and a server that never
    sees the statement never enforces it: without this a worker's step, and the process's
    lease keeper with it, waited until the link healed or TCP gave up (about 15 minutes).
    Data the server's kernel has not acknowledged after `tcp_user_timeout`, or keepalive probes
    unanswered while waiting for an answer, close the connection: the step fails as
    "database unavailable" after about twice the statement timeout, and is retried on a fresh
    connection. A healthy server acknowledges at once, however long its statement runs."""
    bound = SILENT_LINK_TIMEOUTS * settings.db_timeout_seconds
    return {
        "tcp_user_timeout": int(bound * 1000),
        "keepalives": 1,
        "keepalives_idle": max(1, math.ceil(settings.db_timeout_seconds)),
        "keepalives_interval": 1,
        "keepalives_count": 3,
    }


def _connect_args(settings: Settings, application_name: str, pooled: bool) -> dict[str, Any]:
    args: dict[str, Any] = {
        # libpq wants whole seconds, at least 2.
        "connect_timeout": max(2, math.ceil(settings.db_timeout_seconds)),
        # pg_stat_activity tells the process kinds apart (the connection budget of
        # docs/how-to/scaling-out.md).
        "application_name": application_name,
        **_silent_link_bound(settings),
    }
    if pooled:
        # A transaction pool hands each transaction any server connection: a statement
        # psycopg prepared on one is unknown to the next, and PgBouncer refuses the
        # `options` startup parameter (the timeout is the pooler's: `_pooled_timeout_check`).
        args["prepare_threshold"] = None
    else:
        # No statement waits longer than a request may: a lock or a hung server is an error.
        args["options"] = f"-c statement_timeout={int(settings.db_timeout_seconds * 1000)}"
    return args


NO_TIMEOUT_HINT = (
    "DATABASE_POOL_MODE=transaction and statements have no timeout: set one where the pooler "
    "connects (PgBouncer's connect_query = 'SET statement_timeout = 3000') or on the role "
    "(ALTER ROLE ... SET statement_timeout = '3s')"
)


class NoStatementTimeout(psycopg.OperationalError):
    """Statements through a transaction pool would wait forever on a lock or a hung server:
    the database is unusable as configured (a receiver answers 503 and logs why)."""


def _pooled_timeout_check(dbapi_connection: Any, _record: Any) -> None:
    """Through a transaction pool the statement timeout cannot be sent at connect: it must
    be set where the server connections are made (PgBouncer's `connect_query`, or `ALTER ROLE
    ... SET statement_timeout`). A connection that finds none is refused, loudly, rather than
    let a step wait without a bound."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SHOW statement_timeout")
        row = cursor.fetchone()
    finally:
        cursor.close()
        # Outside autocommit the SHOW opened a transaction: ended here, so the engine can still
        # set the connection's isolation level (a replay's dry run reads in REPEATABLE READ).
        dbapi_connection.rollback()
    if row is None or str(row[0]) == "0":
        log.error("database.no_statement_timeout", hint=NO_TIMEOUT_HINT)
        raise NoStatementTimeout(NO_TIMEOUT_HINT)


def _bounded_through_pools(engine: Engine, pooled: bool) -> None:
    if pooled:
        event.listen(engine, "connect", _pooled_timeout_check)


def create_receiver_engine(settings: Settings) -> AsyncEngine:
    """The receiver's pool: bounded waits everywhere, so an outage is a fast 503, not a hang.

    Every step the receiver takes (reserve a key, claim, heartbeat, complete, fail, look up) is
    ONE statement, atomic by itself, so the pool runs in autocommit: `begin()` then sends no
    BEGIN and no COMMIT, two round trips saved per request. A step that needs several
    statements in one transaction must not run on this engine.
    """
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(
        settings.sqlalchemy_url(),
        isolation_level="AUTOCOMMIT",
        pool_size=settings.db_pool_size,
        max_overflow=0,
        pool_timeout=settings.db_timeout_seconds,
        pool_recycle=3600,
        hide_parameters=HIDE_PARAMETERS,
        connect_args=_connect_args(settings, RECEIVER, settings.transaction_pooled),
    )
    _without_data_in_errors(engine.sync_engine)
    _bounded_through_pools(engine.sync_engine, settings.transaction_pooled)
    return engine


def create_sync_engine(
    settings: Settings,
    *,
    pool_size: int = 2,
    max_overflow: int = 2,
    pre_ping: bool = True,
    autocommit: bool = False,
    application_name: str = "idem",
    url: str | None = None,
) -> Engine:
    """A small pool for a relay or a worker process (one statement at a time per thread).

    Every statement is bounded by the statement timeout (DB_TIMEOUT_SECONDS): a hung renewal
    must not block the process's only lease keeper past the lease it is meant to keep, and a
    relay or sweeper must not wait on a lock forever.

    The worker's store turns both options around: every step it takes is one statement, atomic
    by itself, so its connections stay in autocommit (`begin()` then sends no BEGIN and no
    COMMIT), and instead of a pre-ping round trip before every step it sends a statement once
    more when it met a dead connection.
    """
    # A URL given is a session's (Settings.session_url): PostgreSQL itself.
    pooled = settings.transaction_pooled and url is None
    engine = create_engine(
        url or settings.sqlalchemy_url(),
        isolation_level="AUTOCOMMIT" if autocommit else None,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=30,
        pool_pre_ping=pre_ping,
        pool_recycle=3600,
        hide_parameters=HIDE_PARAMETERS,
        connect_args=_connect_args(settings, application_name, pooled),
    )
    _without_data_in_errors(engine)
    _bounded_through_pools(engine, pooled)
    return engine


def create_relay_engine(settings: Settings) -> Engine:
    """The relay's connection: one (its loop sends one statement at a time), in autocommit,
    because each of its steps is one statement and no transaction may be open while it
    publishes; the statement timeout bounds each step. No pre-ping: its steps go through
    `rows_once_more`, as the worker's do (a ping before every statement was a quarter of the
    relay's CPU samples under load, docs/explanation/performance.md)."""
    return create_sync_engine(
        settings,
        pool_size=1,
        max_overflow=0,
        pre_ping=False,
        autocommit=True,
        application_name=RELAY,
    )
