"""Attempts in flight in one worker process, at most `WORKER_CONCURRENCY` of them.

A message may carry several keys (an event's deliveries, or keys the relay packed because they
fell due together), and each key's attempt runs at once beside the others. Without a bound a
threads worker would then run up to its concurrency times the keys a message carries, and a
downstream that had been called by at most `WORKER_CONCURRENCY` attempts of a worker would be
called by that many times more after a backlog. So a message takes a slot per key before its
keys are claimed. It takes the slots that are free, one at least, and starts that many keys at
once; the rest ask again, each part claimed only when it starts (`worker.deliveries`), so no
lease runs while a key waits. A slot a message holds is always a running attempt's: it is
given back when that attempt ends, so messages that each wait for more cannot block each other.
Messages are served in the order they asked, so a free slot goes to the message that has waited
longest, and a message of many keys is not passed for ever by single keys.

Waiting for a whole message's slots at once would leave slots idle: under a backlog against a
1 s downstream, with messages of eight keys, the message at the head of the line would hold
back slots that had come free until enough more did (docs/explanation/performance.md, "Parts
started as slots free").

Each key gives its slot back when its attempt ends, not when its message does: a key that
hangs until its route's time limit holds one slot, as it did alone, and its message-mates'
slots are free for other messages meanwhile.
"""

from __future__ import annotations

import threading
from collections import deque


class Slots:
    """A count of free attempt slots (`size` None: no bound, nothing is ever waited for).

    Each waiting message waits on an event of its own, and a slot given back wakes only the
    message at the head of the line: up to the worker's concurrency of Celery's threads may
    wait here behind a slow downstream, and waking them all to find the one that may go cost
    about a millisecond of CPU per attempt (docs/explanation/performance.md)."""

    def __init__(self, size: int | None) -> None:
        self.size = size
        self._free = size or 0
        self._lock = threading.Lock()
        # Messages waiting for slots, first come first served.
        self._queue: deque[threading.Event] = deque()

    def take(self, most: int) -> Taken:
        """Take the slots that are free, one at least and at most `most`, waiting in line,
        holding none, while none is; `Taken.count` says how many (with no bound: `most`)."""
        if self.size is None:
            return Taken(self, 0, granted=most)
        with self._lock:
            if not self._queue and self._free > 0:
                return Taken(self, self._take(most))
            turn = threading.Event()
            self._queue.append(turn)
        turn.wait()  # set once this message is at the head of the line and a slot is free
        with self._lock:
            self._queue.popleft()
            count = self._take(most)
            self._wake_head()  # the next in line may take what is left
        return Taken(self, count)

    def _take(self, most: int) -> int:
        count = min(most, self._free)
        self._free -= count
        return count

    def _give(self, count: int) -> None:
        if count:
            with self._lock:
                self._free += count
                self._wake_head()

    def _wake_head(self) -> None:
        if self._queue and self._free > 0:
            self._queue[0].set()


class Taken:
    """Slots one part of a message holds: each attempt gives one back as it ends, and the
    part gives back whatever is left when it ends (an attempt that never started)."""

    def __init__(self, slots: Slots, count: int, granted: int | None = None) -> None:
        self._slots = slots
        # Keys this may start now: the slots taken, or what was asked with no bound.
        self.count = count if granted is None else granted
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
