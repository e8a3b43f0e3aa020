"""Attempts in flight in one worker process, at most `WORKER_CONCURRENCY` of them.

A message may carry several keys (an event's deliveries, or keys the relay packed because they
fell due together), and each key's attempt runs at once beside the others. Without a bound a
threads worker would then run up to its concurrency times the keys a message carries, and a
downstream that had been called by at most `WORKER_CONCURRENCY` attempts of a worker would be
called by eight times as many after a backlog. So a message takes a slot per key before its
keys are claimed, and waits, holding nothing and having claimed nothing, while too few are
free: no lease runs while it waits. A message never holds some slots while it waits for more,
so messages cannot block each other for good, and messages are served in the order they
asked: one needing eight slots is not passed for ever by single keys that each find one free.
A message with more keys than the process has slots runs them in parts of that many, each part
claimed when it starts (`worker.app`).

Each key gives its slot back when its attempt ends, not when its message does: a key that
hangs until its route's time limit holds one slot, as it did alone, and its message-mates'
slots are free for other messages meanwhile.
"""

from __future__ import annotations

import threading
from collections import deque


class Slots:
    """A count of free attempt slots (`size` None: no bound, nothing is ever waited for)."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self._free = size or 0
        self._changed = threading.Condition()
        # Messages waiting for slots, first come first served.
        self._queue: deque[object] = deque()

    def take(self, count: int) -> Taken:
        """Take `count` slots (at most all of them), waiting, holding none, while fewer are
        free; the slots are given back through what this returns."""
        if self.size is None:
            return Taken(self, 0)
        count = min(count, self.size)
        turn = object()
        with self._changed:
            self._queue.append(turn)
            self._changed.wait_for(lambda: self._queue[0] is turn and self._free >= count)
            self._queue.popleft()
            self._free -= count
            self._changed.notify_all()  # the next in line may fit in what is left
        return Taken(self, count)

    def _give(self, count: int) -> None:
        if count:
            with self._changed:
                self._free += count
                self._changed.notify_all()


class Taken:
    """Slots one message holds: each attempt gives one back as it ends, and the message
    gives back whatever is left when it ends (an attempt that never started)."""

    def __init__(self, slots: Slots, count: int) -> None:
        self._slots = slots
        self._left = count
        self._lock = threading.Lock()

    def give_one(self) -> None:
        self._give(1)

    def give_rest(self) -> None:
        self._give(self._left)

    def _give(self, most: int) -> None:
        with self._lock:
            count = min(most, self._left)
            self._left -= count
        self._slots._give(count)
