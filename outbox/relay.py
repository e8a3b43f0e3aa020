"""The relay: moves due outbox rows to the broker, at least once, and never loses one.

Loop: lock a batch of due rows (SKIP LOCKED keeps relays apart), publish them, mark them in the
same transaction, repeat while batches come back full; then sleep until a NOTIFY arrives, the
next scheduled row falls due, or the poll interval passes, whichever is first. NOTIFY is only a
wake-up (it is lost while disconnected), so the poll stays. While the broker or the database is
down the relay logs, backs off with jitter and keeps the rows.
"""

from __future__ import annotations

import random
import select
import threading
import time
from typing import Any

import psycopg
from celery import Celery
from sqlalchemy import Engine, make_url

from outbox import queries
from outbox.heartbeat import Heartbeat
from outbox.logs import get_logger
from outbox.publisher import OutboxMessage, publish
from outbox.settings import Settings

log = get_logger(__name__)

# Backoff while the broker or database is down: first retry within 0.5 s, never slower
# than every 15 s, so recovery after an outage is noticed quickly.
OUTAGE_BACKOFF_BASE = 0.5
OUTAGE_BACKOFF_CAP = 15.0


def publish_due_batch(engine: Engine, app: Celery, limit: int) -> int:
    """Publish one batch of due rows; returns how many were published and marked."""
    sent: list[int] = []
    with engine.begin() as conn:
        rows = conn.execute(queries.FETCH_DUE_OUTBOX, {"limit": limit}).all()
        if not rows:
            return 0
        messages = [
            OutboxMessage(r.id, r.idempotency_key, r.task_name, r.correlation_id) for r in rows
        ]
        try:
            publish(app, messages, sent)
        finally:
            # Mark what went out, even when the broker failed half-way: the rest stay due.
            if sent:
                conn.execute(queries.MARK_PUBLISHED, {"ids": sent})
    return len(sent)


def seconds_until_next_due(engine: Engine) -> float | None:
    """Seconds until the earliest unpublished row is due (negative: overdue); None if none."""
    with engine.connect() as conn:
        value = conn.execute(queries.SECONDS_UNTIL_NEXT_DUE).scalar()
    return None if value is None else float(value)


class Listener:
    """A LISTEN on a direct autocommit connection; reconnects lazily after a failure."""

    def __init__(self, dsn: str, channel: str = "outbox") -> None:
        self._dsn = dsn
        self._channel = channel
        self._conn: psycopg.Connection[Any] | None = None

    def wait(self, timeout: float) -> None:
        """Return on the first notification or after `timeout` seconds.

        A plain select() on the socket bounds the wait by the kernel's clock; libpq then reads
        whatever arrived, and every notification that came together is consumed at once.
        """
        timeout = max(0.0, timeout)
        try:
            if self._conn is None or self._conn.closed:
                self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=3)
                self._conn.execute(f"LISTEN {self._channel}")
            pgconn = self._conn.pgconn
            readable, _, _ = select.select([pgconn.socket], [], [], timeout)
            if readable:
                pgconn.consume_input()
                if pgconn.status != psycopg.pq.ConnStatus.OK:
                    raise psycopg.OperationalError("listen connection lost")
                while pgconn.notifies() is not None:
                    pass
        except psycopg.Error:
            self.close()
            time.sleep(timeout)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def libpq_dsn(sqlalchemy_url: str) -> str:
    """The same database as a plain libpq URL, for the LISTEN connection."""
    return (
        make_url(sqlalchemy_url).set(drivername="postgresql").render_as_string(hide_password=False)
    )


def run_relay(settings: Settings, engine: Engine, app: Celery, stop: threading.Event) -> None:
    """Run until `stop` is set."""
    listener = Listener(libpq_dsn(settings.sqlalchemy_url()))
    heartbeat = Heartbeat(settings.heartbeat_file)
    failures = 0
    log.info(
        "relay.started",
        batch_size=settings.relay_batch_size,
        poll_seconds=settings.relay_poll_seconds,
    )
    try:
        while not stop.is_set():
            heartbeat.beat()
            try:
                published = publish_due_batch(engine, app, settings.relay_batch_size)
                next_due = (
                    None
                    if published >= settings.relay_batch_size
                    else seconds_until_next_due(engine)
                )
            except Exception as error:
                failures += 1
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
            if published:
                log.debug("relay.published", rows=published)
            if published >= settings.relay_batch_size:
                continue
            wait = (
                settings.relay_poll_seconds
                if next_due is None
                else min(settings.relay_poll_seconds, next_due)
            )
            if wait > 0:
                listener.wait(wait)
    finally:
        listener.close()
        log.info("relay.stopped")
