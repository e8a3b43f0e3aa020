"""Is this receiver ready to take traffic: database reachable, schema at this code's head (or a
later release's, migrated first in a rolling upgrade), broker reachable.

`/readyz` is public (load balancers and orchestrators probe it without credentials), so a flood
of probes must cost the receiver next to nothing and learn nothing:

- one broker connection per process, kept between checks (a connection per probe once made 16
  flooding clients slow every other endpoint down tenfold): on Redis a client named
  `idem-readyz` in `CLIENT LIST` whose pool keeps the one connection, answering PING; on
  RabbitMQ an AMQP connection on which a check opens and closes a channel;
- the database through the receiver's own synchronous pool, and the schema's head revisions read
  from the migration files once, not on every probe;
- one check at a time per process, and its answer kept for `CACHE_SECONDS`: probes meanwhile get
  that answer, probes arriving while a check runs wait for it in the event loop (no thread held);
- the caller gets ready or not ready; which check failed, and why, goes to the log.

Each check is bounded (the engine's timeouts, `BROKER_TIMEOUT_SECONDS` for the broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import redis
from kombu.connection import Connection
from sqlalchemy import Engine

from outbox.core.broker import broker_kind
from outbox.core.logs import get_logger
from outbox.store.migrate import head_revisions, known_revisions, schema_serves

log = get_logger(__name__)

# A flood costs at most one check a second per process; an orchestrator probing every few
# seconds still sees the state of the last second.
CACHE_SECONDS = 1.0
# Longer than a healthy broker ever takes to answer; short enough for a probe's timeout.
BROKER_TIMEOUT_SECONDS = 2.0
# How the probe's connection shows in Redis's CLIENT LIST.
CLIENT_NAME = "idem-readyz"


class BrokerPing(Protocol):
    def ping(self) -> bool: ...

    def close(self) -> None: ...


class AmqpPing:
    """RabbitMQ's answer: a channel opened and closed on a kept connection (two round trips).
    A kept connection found broken (the broker restarted) is dropped and one new connection
    tried at once, so a restart costs no "not ready"; the broker's own answer decides."""

    def __init__(self, url: str) -> None:
        timeouts = {"read_timeout": BROKER_TIMEOUT_SECONDS, "write_timeout": BROKER_TIMEOUT_SECONDS}
        # kombu's signatures carry no types.
        self._connection: Any = Connection(  # type: ignore[no-untyped-call]
            url, connect_timeout=BROKER_TIMEOUT_SECONDS, transport_options=timeouts
        )

    def ping(self) -> bool:
        if self._connection.connected:
            # A kept connection may have died with a broker restart: a fresh one decides.
            with contextlib.suppress(Exception):
                self._round_trip()
                return True
        self._round_trip()
        return True

    def _round_trip(self) -> None:
        try:
            # No retries and no sleep inside the check: the next probe is the retry.
            self._connection.ensure_connection(max_retries=0)
            self._connection.channel().close()
        except Exception:
            # Dropped without a close handshake: its socket may be dead.
            self._connection.collect()
            raise

    def close(self) -> None:
        self._connection.release()


def broker_ping(url: str) -> BrokerPing:
    """The readiness check's broker client for the broker `url` names."""
    if broker_kind(url) == "amqp":
        return AmqpPing(url)
    client: redis.Redis = redis.Redis.from_url(
        url,
        socket_connect_timeout=BROKER_TIMEOUT_SECONDS,
        socket_timeout=BROKER_TIMEOUT_SECONDS,
        client_name=CLIENT_NAME,
    )
    return client


class Readiness:
    """The receiver's readiness, checked at most once per `cache_seconds` over reused
    connections. Create it in the running event loop; `close()` releases the broker's
    connection."""

    def __init__(
        self,
        engine: Engine,
        broker_url: str,
        *,
        cache_seconds: float = CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._broker = broker_ping(broker_url)
        self._heads = head_revisions()
        self._known = known_revisions()
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._lock = asyncio.Lock()
        self._ready = False
        self._checked_at = -math.inf

    async def ready(self) -> bool:
        """The last answer if it is recent enough, else a new check's (run in a thread)."""
        async with self._lock:
            if self._clock() - self._checked_at >= self._cache_seconds:
                self._ready = await asyncio.to_thread(self.check)
                self._checked_at = self._clock()
            return self._ready

    def check(self) -> bool:
        """Check every dependency now; log the ones that failed."""
        checks = self.checks()
        failed = sorted(name for name, ok in checks.items() if not ok)
        if failed:
            log.warning("readyz.not_ready", failed=failed)
        return not failed

    def checks(self) -> dict[str, bool]:
        """Each dependency's state: reachable database, a schema this code runs on (at its
        head or past it), reachable broker."""
        checks = {"database": False, "migrations": False, "broker": False}
        try:
            with self._engine.connect() as conn:
                checks["database"] = True
                checks["migrations"] = schema_serves(conn, self._heads, self._known)
        except Exception as error:
            log.warning("readyz.database", error=type(error).__name__)
        try:
            checks["broker"] = bool(self._broker.ping())
        except Exception as error:
            log.warning("readyz.broker", error=type(error).__name__)
        return checks

    def close(self) -> None:
        self._broker.close()
