"""Keeping the lease while an action runs.

Trust window: a claim gives `lease_seconds` from the database clock. The heartbeat renews at a
third of that, each renewal conditional on the fence, so two missed beats still leave time. If a
renewal matches no row, another worker has claimed the key with a newer fence: the heartbeat
sets the context's `cancelled` flag and the late result write will be rejected anyway. If the
database cannot be reached, the worker fences itself: once its own monotonic clock says the
lease may have run out, it sets `cancelled` too, because it can no longer prove it holds the key.

One keeper thread per process renews every lease the process holds. Most actions finish long
before their first renewal is due, so holding a lease costs a set insertion, not a thread
started and joined per attempt; the thread sleeps until the earliest renewal falls due.
"""

from __future__ import annotations

import math
import os
import threading
import time
from types import TracebackType

from outbox.logs import get_logger
from worker.store import KeyStore

log = get_logger(__name__)


class Heartbeat:
    """Renews a lease, through the process's keeper, for the duration of a `with` block."""

    def __init__(
        self,
        store: KeyStore,
        key: str,
        fence: int,
        lease_seconds: float,
        cancelled: threading.Event,
    ) -> None:
        self.store = store
        self.key = key
        self.fence = fence
        self.lease = lease_seconds
        self.cancelled = cancelled
        self.lost = False
        # Our own view of the lease's end, on a clock no other machine can skew.
        self.valid_until = time.monotonic() + lease_seconds
        self.due = time.monotonic() + lease_seconds / 3

    def __enter__(self) -> Heartbeat:
        _keeper().hold(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _keeper().release(self)


class LeaseKeeper:
    """The one thread of a process that renews its leases when they fall due."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._lock = threading.Condition()
        self._held: set[Heartbeat] = set()
        self._thread: threading.Thread | None = None
        # When the thread will next look on its own; a lease due earlier must wake it.
        self._wakes_at = math.inf

    def hold(self, heartbeat: Heartbeat) -> None:
        with self._lock:
            self._held.add(heartbeat)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
                self._thread.start()
            if heartbeat.due < self._wakes_at:
                self._lock.notify()

    def release(self, heartbeat: Heartbeat) -> None:
        # No wake-up: the thread finds the set changed when it next looks.
        with self._lock:
            self._held.discard(heartbeat)

    def _run(self) -> None:
        while True:
            with self._lock:
                due = self._wait_for_due()
            for heartbeat in due:
                self._renew(heartbeat)

    def _wait_for_due(self) -> list[Heartbeat]:
        while True:
            now = time.monotonic()
            due = [h for h in self._held if h.due <= now]
            if due:
                self._wakes_at = math.inf
                return due
            self._wakes_at = min((h.due for h in self._held), default=math.inf)
            self._lock.wait(None if self._wakes_at == math.inf else self._wakes_at - now)

    def _renew(self, heartbeat: Heartbeat) -> None:
        started = time.monotonic()
        try:
            renewed = heartbeat.store.renew(heartbeat.key, heartbeat.fence, heartbeat.lease)
        except Exception as error:
            log.warning("lease.renew_failed", error=type(error).__name__)
            if time.monotonic() >= heartbeat.valid_until:
                self._give_up(heartbeat, "lease_expired_unconfirmed")
            else:
                heartbeat.due = time.monotonic() + heartbeat.lease / 3
            return
        if renewed is None:
            self._give_up(heartbeat, "lease_lost")
            return
        heartbeat.valid_until = started + heartbeat.lease
        heartbeat.due = started + heartbeat.lease / 3

    def _give_up(self, heartbeat: Heartbeat, reason: str) -> None:
        with self._lock:
            if heartbeat not in self._held:
                # The attempt ended while the renewal was on its way: its own write decided.
                return
            self._held.discard(heartbeat)
        heartbeat.lost = True
        heartbeat.cancelled.set()
        log.warning("lease.lost", reason=reason, fence=heartbeat.fence)


_process_keeper: LeaseKeeper | None = None
_keeper_lock = threading.Lock()


def _keeper() -> LeaseKeeper:
    """This process's keeper; a forked child starts its own (threads do not survive a fork)."""
    global _process_keeper
    keeper = _process_keeper
    if keeper is None or keeper.pid != os.getpid():
        with _keeper_lock:
            keeper = _process_keeper
            if keeper is None or keeper.pid != os.getpid():
                keeper = _process_keeper = LeaseKeeper()
    return keeper
