"""Engines for each execution model: async for the receiver, sync for the relay and workers."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.settings import Settings

# Errors that mean "the database is not there right now", as opposed to a bug in a statement.
UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53", "57")


def _connect_args(settings: Settings) -> dict[str, Any]:
    return {
        # libpq wants whole seconds, at least 2.
        "connect_timeout": max(2, math.ceil(settings.db_timeout_seconds)),
        "application_name": "idem",
        # No statement waits longer than a request may: a lock or a hung server is an error.
        "options": f"-c statement_timeout={int(settings.db_timeout_seconds * 1000)}",
    }


def create_receiver_engine(settings: Settings) -> AsyncEngine:
    """The receiver's pool: bounded waits everywhere, so an outage is a fast 503, not a hang.

    Every step the receiver takes (reserve a key, claim, heartbeat, complete, fail, look up) is
    ONE statement, atomic by itself, so the pool runs in autocommit: `begin()` then sends no
    BEGIN and no COMMIT, two round trips saved per request. A step that needs several
    statements in one transaction must not run on this engine.
    """
    return create_async_engine(
        settings.sqlalchemy_url(),
        isolation_level="AUTOCOMMIT",
        pool_size=settings.db_pool_size,
        max_overflow=0,
        pool_timeout=settings.db_timeout_seconds,
        pool_recycle=3600,
        connect_args=_connect_args(settings),
    )


def create_sync_engine(
    settings: Settings, *, pool_size: int = 2, pre_ping: bool = True, autocommit: bool = False
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
    return create_engine(
        settings.sqlalchemy_url(),
        isolation_level="AUTOCOMMIT" if autocommit else None,
        pool_size=pool_size,
        max_overflow=2,
        pool_timeout=30,
        pool_pre_ping=pre_ping,
        pool_recycle=3600,
        connect_args=_connect_args(settings),
    )
