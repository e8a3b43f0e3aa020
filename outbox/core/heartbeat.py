"""Liveness of the loops that serve no HTTP (the relay, the sweeper): a file touched each turn.

A container healthcheck (`idem alive`) calls the process alive while the file's modification
time is recent. The loops turn at least every few seconds (the relay's poll, at most 15 s of
outage backoff; the sweeper's interval), so a file older than a minute means a loop that hangs
(a statement without an answer, a deadlock), which a living PID alone would not show.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

# Touch at most this often: a relay turning hundreds of times a second pays one syscall a second.
BEAT_EVERY_SECONDS = 1.0


class Heartbeat:
    """Touches `path` on `beat()`, at most once per BEAT_EVERY_SECONDS; does nothing without a
    path."""

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._last: float | None = None

    def beat(self) -> None:
        if self.path is None:
            return
        now = self._clock()
        if self._last is not None and now - self._last < BEAT_EVERY_SECONDS:
            return
        self._last = now
        # Never stop the loop for its heartbeat: the healthcheck reports the stale file.
        with contextlib.suppress(OSError):
            self.path.touch()  # updates the modification time of an existing file


def age_seconds(path: Path) -> float | None:
    """Seconds since the file was last touched, or None when it does not exist."""
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
