"""Attempts in flight in one worker process, at most `WORKER_CONCURRENCY` of them.

A message may carry several keys (an event's deliveries, or keys the relay packed because they
fell due together), and each key's attempt runs at once beside the others. Without a bound a
threads worker would then run up to its concurrency times the keys a message carries, and a
downstream that had been called by at most `WORKER_CONCURRENCY` attempts of a worker would be
called by eight times as many after a backlog. So a message takes a slot per key before its
keys are claimed, and waits, holding nothing and having claimed nothing, while too few are
free: no lease runs while it waits. A message never holds some slots while it waits for more,
so messages cannot block each other for good; one with more keys than the process has slots
runs them in parts of that many, each part claimed when it starts (`worker.app`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Slots:
    """A count of free attempt slots, taken and given back a message at a time."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._free = size
        self._changed = threading.Condition()

    @contextmanager
    def taken(self, count: int) -> Iterator[None]:
        """Hold `count` slots (at most all of them) for the `with` block; wait, holding none,
        while fewer are free."""
        count = min(count, self.size)
        with self._changed:
            self._changed.wait_for(lambda: self._free >= count)
            self._free -= count
        try:
            yield
        finally:
            with self._changed:
                self._free += count
                self._changed.notify_all()
