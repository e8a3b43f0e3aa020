"""The receiver wakes the relay after its accepts commit: one NOTIFY for the accepts of a moment.

The outbox's trigger sends the relay a NOTIFY for each statement that writes outbox rows. A
transaction that notifies holds one lock of the whole database from just before its commit
until the commit is on disk (PostgreSQL's notifications arrive in commit order), so when every
accept notified, the receivers' commits went one at a time, each waiting for a WAL flush of its
own instead of sharing one: under load the accept spent most of its time waiting for that lock
(`Lock`/`object` in pg_stat_activity). The accept statements tell the trigger to stay quiet
(`outbox.store.ingest`, migration 0020), and the process sends the NOTIFY here instead, in a
statement of its own after the accept committed.

As in a database's group commit, the first accept to commit sends one at once, and every accept
that commits while that one is in flight is covered by one more, sent when it is done. No
accept waits for a timer or for the NOTIFY, and after every accept's commit a NOTIFY starts, so
the relay wakes to find its row. Under load the NOTIFYs are a small fraction of the accepts.

A NOTIFY is only a wake-up, as it always was: one that fails (an outage, a pool with no free
connection) is logged and dropped, and the relay's poll (RELAY_POLL_SECONDS) finds the rows.
"""

from __future__ import annotations

import asyncio
import weakref

from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core.logs import get_logger
from outbox.store.driven import driven

log = get_logger(__name__)

NOTIFY_RELAY = text("SELECT pg_notify('outbox', '')")


class RelayWakeup:
    """One process's wake-ups of the relay, through one engine."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._wanted = False
        self._sender: asyncio.Task[None] | None = None
        self.sent = 0

    def after_commit(self) -> None:
        """An accept committed an outbox row: a NOTIFY starts after this call, now or when the
        one in flight is done."""
        self._wanted = True
        if self._sender is None:
            self._sender = asyncio.get_running_loop().create_task(self._send())

    async def settled(self) -> None:
        """Wait for the NOTIFY in flight and those it still owes (at the receiver's stop)."""
        while (sender := self._sender) is not None:
            await asyncio.shield(sender)

    async def _send(self) -> None:
        try:
            while self._wanted:
                self._wanted = False
                try:
                    async with driven(self._engine) as conn:
                        await conn.all(NOTIFY_RELAY, {})
                except (SQLAlchemyError, OSError) as error:
                    # The next accept asks again; meanwhile the relay's poll finds the rows.
                    log.warning("relay.wakeup_failed", error=type(error).__name__)
                    return
                self.sent += 1
        finally:
            self._sender = None


_WAKEUPS: weakref.WeakKeyDictionary[AsyncEngine, RelayWakeup] = weakref.WeakKeyDictionary()


def of(engine: AsyncEngine) -> RelayWakeup:
    """The wake-ups sent through `engine` (one per receiver engine, made at first use)."""
    found = _WAKEUPS.get(engine)
    if found is None:
        found = _WAKEUPS[engine] = RelayWakeup(engine)
    return found
