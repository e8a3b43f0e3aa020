"""How many rows one purge transaction takes: as many as fit well inside the statement timeout.

A batch's cost is not its row count. A key's cascade reaches its event, its outbox rows in
every day partition, its attempts and dead letters; on a warm cache a thousand keys go in a
tenth of a second, and on a cold one under a busy disk the same thousand took 25 s
(docs/explanation/performance.md, ten million keys). A batch the server cancels at the statement
timeout has done nothing, and the same batch tried again would be cancelled again: the purge would
never move, on the sweeper's schedule or from `idem purge`. So the size follows the time:

- halved when a batch took more than a third of the statement timeout, so the next one stays
  well inside it;
- halved and tried again when the server cancelled it (the transaction rolled back whole);
  given up, the error raised, only when a batch of one row is cancelled;
- doubled back towards the configured size when one took under a tenth of it.

A caller that purges again and again (the sweeper's passes, `idem purge`'s turns) keeps one
`BatchPace`, so what a pass learnt holds for the next.
"""

from __future__ import annotations

from dataclasses import dataclass

# Shares of the statement timeout a batch's transaction may take before the next is made
# smaller, and under which the next may be larger again.
SHRINK_ABOVE = 1 / 3
GROW_BELOW = 1 / 10


@dataclass
class BatchPace:
    """The next batch's size, between 1 and `ceiling` (the configured batch)."""

    ceiling: int
    size: int = 0
    # Batches the server cancelled so far (each rolled back and tried again smaller).
    cancellations: int = 0

    def __post_init__(self) -> None:
        if self.ceiling < 1:
            raise ValueError("a batch holds at least one row")
        self.size = min(self.size or self.ceiling, self.ceiling)

    def took(self, seconds: float, timeout_seconds: float | None) -> None:
        """A batch of `size` finished in `seconds`; no timeout (None) leaves the size."""
        if not timeout_seconds:
            return
        if seconds > timeout_seconds * SHRINK_ABOVE:
            self.size = max(1, self.size // 2)
        elif seconds < timeout_seconds * GROW_BELOW:
            self.size = min(self.ceiling, self.size * 2)

    def cancelled(self) -> bool:
        """The server cancelled a batch of `size`: halve it. False when it was one row
        already, so nothing smaller is left to try."""
        self.cancellations += 1
        if self.size == 1:
            return False
        self.size //= 2
        return True
