"""Engines for each execution model: async for the receiver, sync for the relay and workers."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.settings import Settings

# Errors that mean "the database is not there right now", as opposed to a bug in a statement.
UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53", "57")


def _connect_args(settings: Settings, statement_timeout: bool) -> dict[str, Any]:
    args: dict[str, Any] = {
        # libpq wants whole seconds, at least 2.
        "connect_timeout": max(2, math.ceil(settings.db_timeout_seconds)),
        "application_name": "idem",
    }
    if statement_timeout:
        args["options"] = f"-c statement_timeout={int(settings.db_timeout_seconds * 1000)}"
    return args


def create_receiver_engine(settings: Settings) -> AsyncEngine:
    """The receiver's pool: bounded waits everywhere, so an outage is a fast 503, not a hang."""
    return create_async_engine(
        settings.sqlalchemy_url(),
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_timeout=settings.db_timeout_seconds,
        pool_recycle=3600,
        connect_args=_connect_args(settings, statement_timeout=True),
    )


def create_sync_engine(settings: Settings, *, pool_size: int = 2) -> Engine:
    """A small pool for a relay or a worker process (one statement at a time per thread)."""
    return create_engine(
        settings.sqlalchemy_url(),
        pool_size=pool_size,
        max_overflow=2,
        pool_timeout=30,
        pool_pre_ping=True,
        pool_recycle=3600,
        connect_args=_connect_args(settings, statement_timeout=False),
    )
