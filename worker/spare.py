"""Threads kept between attempts, for the work that needs a thread of its own.

An attempt runs its action in a thread of its own (so the attempt can stop waiting at the
route's time limit or when its lease is lost), and a message of several keys runs each key's
attempt in a thread of its own. Starting a thread and letting it end cost the worker about
0.1 ms of CPU each time, against about 0.03 ms to hand work to a thread that waits for it, and
a packed message of eight keys started fifteen.

So a thread that finished its work waits for the next, and one that waited `IDLE_SECONDS`
with nothing to do ends. There is no bound and no queue: work that finds no idle thread starts
a new one at once, as before, so an action hanging until its time limit (or past it, its
result ignored) only keeps its own thread, never delays another's work. The threads are
daemons, so one stuck in an action does not hold the process's exit, and a forked child
starts with none (threads do not survive a fork).
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

# Long enough to outlast the gaps between messages under load; short enough that a burst's
# threads do not linger for long after it.
IDLE_SECONDS = 30.0


class Spare:
    """Threads that run one piece of work at a time and wait for the next."""

    def __init__(self, idle_seconds: float = IDLE_SECONDS) -> None:
        self.idle_seconds = idle_seconds
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[tuple[Callable[[], None], str]]] = []
        self.started = 0

    def run(self, work: Callable[[], None], name: str) -> None:
        """Run `work` in a thread of its own: an idle one, or a new one."""
        with self._lock:
            waiting = self._idle.pop() if self._idle else None
            if waiting is None:
                self.started += 1
        if waiting is not None:
            waiting.put((work, name))
            return
        inbox: queue.SimpleQueue[tuple[Callable[[], None], str]] = queue.SimpleQueue()
        inbox.put((work, name))
        threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()

    def idle(self) -> int:
        with self._lock:
            return len(self._idle)

    def _serve(self, inbox: queue.SimpleQueue[tuple[Callable[[], None], str]]) -> None:
        while True:
            try:
                work, name = inbox.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:
                        self._idle.remove(inbox)
                        return
                # Taken from the idle list just now: its work is on the way.
                continue
            threading.current_thread().name = name
            # Work that raises ends its thread, which was never offered again (the callers'
            # work catches its own errors).
            work()
            del work  # nothing of the last piece of work kept alive while idle
            with self._lock:
                self._idle.append(inbox)


_spare = Spare()


def _forget_after_fork() -> None:
    global _spare
    _spare = Spare()


os.register_at_fork(after_in_child=_forget_after_fork)


def run(work: Callable[[], None], name: str) -> None:
    """Run `work` in a thread of this process's own (`Spare.run`)."""
    _spare.run(work, name)
