"""Keeping the lease while an action runs.

Trust window: a claim gives `lease_seconds` from the database clock. The heartbeat renews at a
third of that, each renewal conditional on the fence, so two missed beats still leave time. If a
renewal matches no row, another worker has claimed the key with a newer fence: the heartbeat
sets the context's `cancelled` flag and the late result write will be rejected anyway. If the
database cannot be reached, the worker fences itself: once its own monotonic clock says the
lease may have run out, it sets `cancelled` too, because it can no longer prove it holds the key.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

from outbox.logs import get_logger
from worker.store import KeyStore

log = get_logger(__name__)


class Heartbeat:
    """Renews a lease in a background thread for the duration of a `with` block."""

    def __init__(
        self,
        store: KeyStore,
        key: str,
        fence: int,
        lease_seconds: float,
        cancelled: threading.Event,
    ) -> None:
        self._store = store
        self._key = key
        self._fence = fence
        self._lease = lease_seconds
        self._cancelled = cancelled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-heartbeat", daemon=True)
        self.lost = False
        # Our own view of the lease's end, on a clock no other machine can skew.
        self._valid_until = time.monotonic() + lease_seconds

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        interval = self._lease / 3
        while not self._stop.wait(interval):
            started = time.monotonic()
            try:
                renewed = self._store.renew(self._key, self._fence, self._lease)
            except Exception as error:
                log.warning("lease.renew_failed", error=type(error).__name__)
                if time.monotonic() >= self._valid_until:
                    self._give_up("lease_expired_unconfirmed")
                    return
                continue
            if renewed is None:
                self._give_up("lease_lost")
                return
            self._valid_until = started + self._lease

    def _give_up(self, reason: str) -> None:
        self.lost = True
        self._cancelled.set()
        log.warning("lease.lost", reason=reason, fence=self._fence)
