"""The relay: moves due outbox rows to the broker, at least once, and never loses one.

Loop: take a batch of due rows by giving them a short lease (`claimed_until`, one committed
statement: SKIP LOCKED and the lease keep relays apart), publish them with no transaction
open, mark them published, repeat while batches come back full; after a pass that published
rows, let the next ones gather for RELAY_GATHER_SECONDS (`gather_wait`); then sleep until a
NOTIFY arrives, the next scheduled row falls due, or the poll interval passes, whichever is
first.
NOTIFY is only a wake-up (it is lost while disconnected), so the poll stays. A pass that found
nothing to take always waits, even when rows are due but held by another relay, so relays
never spin against each other. A relay killed between the publish and the mark leaves rows
that any relay publishes again once the lease has ended: a second message for a key is
harmless (the worker's claim refuses a finished or held key), a lost one is not possible.
Of several relays only one runs this loop's passes at a time, the holder of the relays' lead
(`outbox.relay.lead`); the others stand by without a LISTEN connection and take over once it
stops, dies or cannot publish.

Pacing: rows that have already waited longer than RELAY_BACKLOG_AGE_SECONDS are a backlog (an
outage, a flood), not a fresh event someone is waiting on; those are published at no more than
RELAY_BACKLOG_RATE rows per second, so a drain does not take the CPU the receivers need.
While the broker or the database is down the relay logs, backs off with jitter and keeps the
rows.
"""

from __future__ import annotations

import contextlib
import functools
import random
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from celery import Celery
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError

from outbox.core import tracing
from outbox.core.conninfo import libpq_dsn
from outbox.core.heartbeat import Heartbeat
from outbox.core.logs import get_logger
from outbox.core.settings import Settings
from outbox.relay.lead import Lead
from outbox.relay.publisher import OutboxMessage, publish
from outbox.store import relay as sql
from outbox.store.driven import rows_once_more
from outbox.store.engines import RELAY

log = get_logger(__name__)

# Backoff while the broker or database is down: first retry within 0.5 s, never slower
# than every 5 s, so the end of an outage (a failover takes 10 to 15 s) is noticed within
# seconds; only the publishing relay retries, one statement or connection at a time.
OUTAGE_BACKOFF_BASE = 0.5
OUTAGE_BACKOFF_CAP = 5.0
# The least a pass that took nothing waits although rows are due: they are locked by a
# statement in progress elsewhere, which ends within milliseconds. Bounds such passes to ten
# a second instead of a spin (about 800 a second were measured before this floor).
IDLE_FLOOR_SECONDS = 0.1

Send = Callable[[Celery, list[OutboxMessage], list[int]], None]


@dataclass(frozen=True)
class Batch:
    """What one pass did: rows taken, rows published, and how long the oldest had waited."""

    taken: int
    published: int
    oldest_waited_seconds: float
    # The idle check's answer, when the marking statement gave it (every row of the batch went
    # out): seconds until the next row nobody holds falls due, None if none. Unknown otherwise.
    next_due: float | None = None
    knows_next_due: bool = False


NOTHING = Batch(0, 0, 0.0)


def publish_due_batch(
    engine: Engine, app: Celery, limit: int, claim_seconds: float, send: Send = publish
) -> Batch:
    """Take, publish and mark one batch of due rows; no transaction is open during the send.

    Each step may be sent twice (`rows_once_more`): a claim repeated after a lost answer takes
    other rows, and the first ones are taken again when their claim runs out (a message sent
    twice, which the worker's claim makes harmless); marking and releasing are idempotent."""
    rows = rows_once_more(
        engine,
        sql.CLAIM_DUE_OUTBOX,
        {"limit": limit, "lease_seconds": claim_seconds, "traced": tracing.enabled()},
    )
    if not rows:
        return NOTHING
    # The statement's RETURNING has no order; publish oldest first, as selected.
    rows = sorted(rows, key=lambda r: (r["available_at"], r["id"]))
    messages = [
        OutboxMessage(
            r["id"],
            r["idempotency_key"],
            r["task_name"],
            r["correlation_id"],
            r["trace_context"],
            r["event_key"],
        )
        for r in rows
    ]
    sent: list[int] = []
    marked: list[dict[str, Any]] = []
    try:
        send(app, messages, sent)
    finally:
        # Mark what went out, even when the broker failed half-way; give the rest back.
        unsent = sorted({m.outbox_id for m in messages} - set(sent))
        span = {
            "oldest": min(r["created_at"] for r in rows),
            "newest": max(r["created_at"] for r in rows),
        }
        if sent:
            marked = rows_once_more(engine, sql.MARK_PUBLISHED, {"ids": sent, **span})
        if unsent:
            rows_once_more(engine, sql.RELEASE_OUTBOX_CLAIM, {"ids": unsent, **span})
    waited = max(float(r["waited_seconds"]) for r in rows)
    if not marked or unsent:
        # Rows given back are due again: the marking statement could not count them.
        return Batch(len(rows), len(sent), waited)
    next_due = marked[0]["seconds"]
    due = None if next_due is None else float(next_due)
    return Batch(len(rows), len(sent), waited, due, knows_next_due=True)


def seconds_until_next_due(engine: Engine) -> float | None:
    """Seconds until the earliest row nobody holds is due (negative: overdue); None if none."""
    value = rows_once_more(engine, sql.SECONDS_UNTIL_NEXT_DUE, {})[0]["seconds"]
    return None if value is None else float(value)


@dataclass(frozen=True)
class Pacer:
    """Bounds the publish rate of a backlog; fresh rows always go out at once.

    `rate` rows per second (0: unbounded) once a batch's oldest row has waited `age_seconds`.
    """

    rate: float
    age_seconds: float

    def pause(self, batch: Batch, elapsed: float) -> float:
        """Seconds to wait after `batch`, which took `elapsed` seconds, before the next one."""
        if self.rate <= 0 or batch.published == 0:
            return 0.0
        if batch.oldest_waited_seconds < self.age_seconds:
            return 0.0
        return max(0.0, batch.published / self.rate - elapsed)


def gather_wait(batch: Batch, full: bool, seconds: float) -> float:
    """How long to let fresh rows gather after a pass before the next (0: go on).

    After a pass that published rows without filling its batch, the relay waits `seconds`
    before it looks again, so that the rows accepted meanwhile go out together: in fewer
    messages (up to RELAY_KEYS_PER_MESSAGE keys each), whose keys a worker claims and records
    in shared statements. A message costs the broker and the worker about the same whatever
    it carries (at 320 noop events/s the worker spent a third less CPU per event with the
    wait: docs/explanation/performance.md). A row that comes while the relay idles goes out
    at once; only one accepted within `seconds` after a publish waits, and at most that long.
    A full batch goes on at once: there is more to take already.
    """
    if full or batch.published == 0:
        return 0.0
    return seconds


def idle_wait(batch: Batch, next_due: float | None, poll_seconds: float) -> float:
    """How long to sleep after a pass that did not fill its batch (0: go on at once).

    A pass that published something goes on while rows are due; one that took nothing waits at
    least IDLE_FLOOR_SECONDS even then (the due rows are locked elsewhere), and otherwise until
    the next row nobody holds falls due, within the poll interval.
    """
    if next_due is None:
        return poll_seconds
    if next_due <= 0 and batch.taken:
        return 0.0
    return min(poll_seconds, max(next_due, IDLE_FLOOR_SECONDS))


class Waiter(Protocol):
    def wait(self, timeout: float) -> None: ...

    def rest(self, timeout: float) -> None: ...

    def close(self) -> None: ...


class Listener:
    """A LISTEN on a direct autocommit connection; reconnects lazily after a failure. With no
    `dsn` (no session to listen on: DATABASE_URL is a transaction pool and no direct URL is
    set) it only waits, and the relay finds rows by its poll.

    A signal (SIGTERM from a supervisor, Ctrl-C) ends a wait at once: in the main thread the
    listener is the process's signal wake-up fd, so the relay stops in milliseconds instead of
    at the end of its poll interval."""

    def __init__(self, dsn: str | None, channel: str = "outbox") -> None:
        self._dsn = dsn
        self._channel = channel
        self._conn: psycopg.Connection[Any] | None = None
        self._wake, wake_write = socket.socketpair()
        self._wake_write = wake_write
        for end in (self._wake, wake_write):
            end.setblocking(False)
        self._previous_wakeup_fd: int | None = None
        with contextlib.suppress(ValueError):  # not the main thread: no signal wake-ups
            self._previous_wakeup_fd = signal.set_wakeup_fd(
                wake_write.fileno(), warn_on_full_buffer=False
            )

    def wait(self, timeout: float) -> None:
        """Return on the first notification, on a signal, or after `timeout` seconds.

        A plain select() on the socket bounds the wait by the kernel's clock; libpq then reads
        whatever arrived, and every notification that came together is consumed at once.
        """
        timeout = max(0.0, timeout)
        if self._dsn is None:
            if select.select([self._wake], [], [], timeout)[0]:
                self._drain_wake()
            return
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(
                    self._dsn, autocommit=True, connect_timeout=3, application_name=RELAY
                )
                self._conn.execute(f"LISTEN {self._channel}")
            pgconn = self._conn.pgconn
            wake = self._wake.fileno()
            readable, _, _ = select.select([pgconn.socket, wake], [], [], timeout)
            if wake in readable:
                self._drain_wake()
            if pgconn.socket in readable:
                pgconn.consume_input()
                if pgconn.status != psycopg.pq.ConnStatus.OK:
                    raise psycopg.OperationalError("listen connection lost")
                while pgconn.notifies() is not None:
                    pass
        except psycopg.Error:
            self._disconnect()
            if select.select([self._wake], [], [], timeout)[0]:
                self._drain_wake()

    def rest(self, timeout: float) -> None:
        """A standby's wait: no LISTEN connection (a standby has nothing to do with a
        NOTIFY), only a signal or the end of `timeout` ends it."""
        self._disconnect()
        if select.select([self._wake], [], [], max(0.0, timeout))[0]:
            self._drain_wake()

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake.recv(512):
                pass

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        self._disconnect()
        if self._previous_wakeup_fd is not None:
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_wakeup_fd)
            self._previous_wakeup_fd = None
        self._wake.close()
        self._wake_write.close()


def is_database_error(error: BaseException) -> bool:
    """Whether a pass failed on PostgreSQL (a statement, a connection, a standby that refused
    a write) rather than on the broker."""
    return isinstance(error, (SQLAlchemyError, psycopg.Error))


def run_relay(
    settings: Settings,
    engine: Engine,
    app: Celery,
    stop: threading.Event,
    listener: Waiter | None = None,
    send: Send | None = None,
) -> None:
    """Run until `stop` is set (`listener` and `send` are replaceable for tests). With
    several relays only the holder of the lead (`outbox.relay.lead`) runs passes."""
    session = settings.session_url()
    waiter: Waiter = listener or Listener(libpq_dsn(session) if session else None)
    heartbeat = Heartbeat(settings.heartbeat_file)
    pacer = Pacer(settings.relay_backlog_rate, settings.relay_backlog_age_seconds)
    lead = Lead(engine, settings.relay_lead_seconds)
    limit = settings.relay_batch_size
    send = send or functools.partial(publish, keys_per_message=settings.relay_keys_per_message)
    failures = 0
    broker_failing = False
    log.info(
        "relay.started",
        batch_size=limit,
        poll_seconds=settings.relay_poll_seconds,
        backlog_rate=settings.relay_backlog_rate,
        # Through a transaction pool without DATABASE_DIRECT_URL there is no LISTEN: polling.
        listens=session is not None,
        lead_seconds=settings.relay_lead_seconds,
        keys_per_message=settings.relay_keys_per_message,
        gather_seconds=settings.relay_gather_seconds,
    )
    try:
        while not stop.is_set():
            heartbeat.beat()
            began = time.monotonic()
            try:
                if not lead.holds(publishing=not broker_failing):
                    waiter.rest(lead.seconds_to_check())
                    continue
                batch = publish_due_batch(engine, app, limit, settings.relay_claim_seconds, send)
                full = batch.taken >= limit
                if full:
                    next_due = None
                elif batch.knows_next_due:
                    next_due = batch.next_due  # told by the marking statement
                else:
                    next_due = seconds_until_next_due(engine)
            except Exception as error:
                failures += 1
                # Only the broker's failures cost the lead: the lead lives in the database, so
                # while the database fails every relay fails alike, and one that gave the lead
                # up would be back only a lease after the new primary took office.
                broker_failing = not is_database_error(error)
                delay = random.uniform(
                    0, min(OUTAGE_BACKOFF_CAP, OUTAGE_BACKOFF_BASE * 2**failures)
                )
                log.warning(
                    "relay.publish_failed",
                    error=type(error).__name__,
                    detail=str(error)[:200],
                    failures=failures,
                    retry_in=round(delay, 2),
                )
                stop.wait(delay)
                continue
            if failures:
                log.info("relay.recovered", after_failures=failures)
                failures = 0
                broker_failing = False
            if batch.published:
                log.debug("relay.published", rows=batch.published)
            pause = max(
                pacer.pause(batch, time.monotonic() - began),
                gather_wait(batch, full, settings.relay_gather_seconds),
            )
            if pause > 0:
                stop.wait(pause)
            if full:
                continue
            # A holder wakes for its lead's renewal too, however long the rows let it sleep.
            wait = min(
                idle_wait(batch, next_due, settings.relay_poll_seconds), lead.seconds_to_check()
            )
            if wait > 0:
                waiter.wait(wait)
    finally:
        lead.resign()
        waiter.close()
        log.info("relay.stopped")
