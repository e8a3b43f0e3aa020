"""The relays' lead: one relay publishes, the others stand by.

Relays that publish at once are safe (SKIP LOCKED and the claim lease keep them on disjoint
rows), but every one of them is woken by the same NOTIFY and sends the same statements: a
second relay doubled the relay's CPU per event and added a third to PostgreSQL's (bench section
12, docs/how-to/scaling-out.md). So the relays share a lease row, `relay_lead`. Its holder
publishes and
renews it every third of RELAY_LEAD_SECONDS; a standby closes its LISTEN connection and checks
as often, taking the lead once it is free, has run out, or its holder's server process has
ended. A relay that stops resigns, and one that dies has its connection closed by the server,
so a standby takes over within a check; a holder whose host went silent, once its lease runs out.

The lead is about cost, never correctness: a holder paused past its lease and a new holder may
both publish for a moment, which sends some rows twice, and the worker's claim refuses the
second message. What the lead must not do is keep rows back, so a holder renews only while it
can reach the broker: one cut off from it (it still reaches PostgreSQL) lets its lead run out,
and then stands aside half a lease, long enough for every standby to have checked once, before
it tries again: a standby that can publish wins, and a relay that is alone is back within half
a lease. A database that fails costs no lead: every relay fails alike, and the lead is in the
database, so the holder goes on trying and keeps it (the relay's loop tells the two apart).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable

from sqlalchemy import Engine

from outbox.core.logs import get_logger
from outbox.store import relay as sql
from outbox.store.driven import rows_once_more

log = get_logger(__name__)


def holder_name() -> str:
    """This process among relays: host and pid for the operator, a random tail so that a
    pid reused after a restart is a new holder."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Lead:
    """Whether this relay publishes now; it asks the database every third of `seconds`.

    `seconds` 0 turns the lead off: every relay publishes, as before the lead existed."""

    def __init__(
        self,
        engine: Engine,
        seconds: float,
        holder: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = seconds
        self.holder = holder or holder_name()
        self._engine = engine
        self._clock = clock
        self._leading = False
        self._held_until = 0.0  # by this process's clock, from before the statement was sent
        self._next_check = 0.0
        self._checked = False

    @property
    def enabled(self) -> bool:
        return self.seconds > 0

    def holds(self, publishing: bool = True) -> bool:
        """True when this relay should run a pass now. When its check is due it renews the
        lead (or takes a free one); `publishing` False (its last pass failed on the broker)
        makes a holder let the lead run out instead, and stand aside half a lease once it has."""
        if not self.enabled:
            return True
        now = self._clock()
        if now < self._next_check:
            return self._leading
        if self._leading and not publishing:
            if now < self._held_until:
                self._next_check = min(self._held_until, now + self.seconds / 3)
                return True
            self._leading = False
            self._next_check = now + self.seconds / 2
            log.warning("relay.lead_released", holder=self.holder, reason="publish_failing")
            return False
        params = {"holder": self.holder, "seconds": self.seconds}
        held = bool(rows_once_more(self._engine, sql.TAKE_OR_KEEP_LEAD, params))
        if held and not self._leading:
            log.info("relay.lead_taken", holder=self.holder)
        elif self._leading and not held:
            log.warning("relay.lead_lost", holder=self.holder)
        elif not held and not self._checked:
            log.info("relay.standing_by", holder=self.holder)
        self._checked = True
        self._leading = held
        self._held_until = now + self.seconds
        self._next_check = now + self.seconds / 3
        return held

    def seconds_to_check(self) -> float:
        """How long this relay may wait before its next check (a bound on any sleep)."""
        if not self.enabled:
            return float("inf")
        return max(0.0, self._next_check - self._clock())

    def resign(self) -> None:
        """Give the lead up (at stop), so a standby takes it at its next check. Best effort:
        if the database cannot be reached, the lease runs out by itself."""
        if not (self.enabled and self._leading):
            return
        self._leading = False
        with contextlib.suppress(Exception):
            rows_once_more(self._engine, sql.RESIGN_LEAD, {"holder": self.holder})
            log.info("relay.lead_resigned", holder=self.holder)
