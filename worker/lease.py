"""Keeping the lease while an action runs.

Trust window: a claim gives `lease_seconds` from the database clock. The heartbeat renews at a
third of that, each renewal conditional on the fence and the claim's token, so two missed beats
still leave time. If a renewal matches no row, another holder has claimed the key with a newer
fence: the heartbeat sets the context's `cancelled` flag, wakes the attempt, and the late result
write would be rejected anyway. If the database cannot be reached, the worker fences itself:
`GIVE_UP_MARGIN` of a lease BEFORE its own monotonic clock says the lease may have run out, it
gives the attempt up too, so that in practice a late write never races a new holder (and in
theory the fence stops it). The clock starts when the renewal was sent, which is no later than
the database's `now()` that set the lease. A claim whose answer comes back after that window
has closed (held by the network, then delivered) is given up as the heartbeat begins, before the
action starts: found by the multi-host soak (docs/explanation/reliability.md), where such an action
sent a second write after another worker had taken the key over.

One keeper thread per process renews every lease the process holds. Most actions finish long
before their first renewal is due, so holding a lease costs a set insertion, not a thread
started and joined per attempt; the thread sleeps until the earliest renewal falls due.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import threading
import time
from types import TracebackType

from outbox.core.logs import get_logger
from worker.store import Claim, KeyStore

log = get_logger(__name__)


def holder() -> str:
    """Who holds a lease taken in this thread (host:pid:thread), for operators only: the
    claim's random token is what proves holding."""
    return f"{_host()}:{os.getpid()}:{threading.get_ident()}"


@functools.cache
def _host() -> str:
    """The host's name, asked once per process: a system call per attempt showed in the
    worker's profile (3 % of its samples), and a host's name does not change under it."""
    return socket.gethostname()


# How long before our own view of the lease's end the worker stops trusting it: a fifth of a
# lease (6 s of the default 30) covers a statement in flight and clock-rate drift.
GIVE_UP_MARGIN = 0.2


class Heartbeat:
    """Renews a lease, through the process's keeper, for the duration of a `with` block."""

    def __init__(
        self,
        store: KeyStore,
        claim: Claim,
        lease_seconds: float,
        cancelled: threading.Event,
        wake: threading.Event | None = None,
        since: float | None = None,
    ) -> None:
        self.store = store
        self.claim = claim
        self.lease = lease_seconds
        self.cancelled = cancelled
        # Set with `cancelled`, so the attempt waiting on its action stops waiting.
        self.wake = wake
        self.lost = False
        # Our own view of when to stop trusting the lease, on a clock no other machine skews,
        # counted from `since` (when the claim was sent: no later than the database's now()).
        start = time.monotonic() if since is None else since
        self.valid_until = start + self._trusted()
        self.due = start + lease_seconds / 3

    def _trusted(self) -> float:
        return self.lease * (1 - GIVE_UP_MARGIN)

    def give_up(self, reason: str) -> None:
        """Stop holding (the lease can no longer be proven): sets `cancelled` and `wake`."""
        _keeper().give_up(self, reason)

    def __enter__(self) -> Heartbeat:
        _keeper().hold(self)
        if time.monotonic() >= self.valid_until:
            # The claim's answer came after the trust window had closed (a network that held
            # it, then healed): the lease may be another's already. Given up here, before the
            # attempt starts its action, the action sees `cancelled` on its first look; given
            # up by the attempt's own wait, the action's thread could send first.
            self.give_up("lease_expired_unconfirmed")
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
            renewed = heartbeat.store.renew(heartbeat.claim, heartbeat.lease)
        except Exception as error:
            log.warning("lease.renew_failed", error=type(error).__name__)
            if time.monotonic() >= heartbeat.valid_until:
                self.give_up(heartbeat, "lease_expired_unconfirmed")
            else:
                # Try again in time to know before the lease stops being trusted.
                heartbeat.due = min(time.monotonic() + heartbeat.lease / 3, heartbeat.valid_until)
            return
        if renewed is None:
            self.give_up(heartbeat, "lease_lost")
            return
        heartbeat.valid_until = started + heartbeat._trusted()
        heartbeat.due = started + heartbeat.lease / 3

    def give_up(self, heartbeat: Heartbeat, reason: str) -> None:
        with self._lock:
            if heartbeat not in self._held:
                # The attempt ended while the renewal was on its way: its own write decided.
                return
            self._held.discard(heartbeat)
        heartbeat.lost = True
        heartbeat.cancelled.set()
        if heartbeat.wake is not None:
            heartbeat.wake.set()
        log.warning("lease.lost", reason=reason, fence=heartbeat.claim.fence)


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
