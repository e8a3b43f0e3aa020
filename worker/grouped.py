"""Attempts of one process share their claim, lane step and success statements when they arrive
together.

Each attempt costs two statements at least, its claim and its outcome, and under load those
round trips (parse, plan, a lock, a WAL record, a reply; the driver's work on both ends) are
most of what the gateway adds to a message. Here, as in a database's group commit, an attempt
whose statement would wait for another attempt's already on its way joins the next one instead:
the first attempt to arrive sends its statement at once, and every attempt arriving while it is
in flight is sent, together, in the next (`CLAIM_KEYS`, `ADMIT_KEYS`, `SUCCEED_KEYS`). No
attempt waits for a timer: alone, an attempt sends the single-key statement it always sent; a
batch forms only behind a statement already in flight.

Nothing about a key changes. Each row of the shared statements is decided exactly as the
single-key statement decides it (`outbox.store.siblings`, `outbox.store.lanes`): its own fence,
token and lease (counted from when the shared claim was sent, no later than the database's
now()), a refused key asks why as one key does, and a success whose fence or token no longer
matches writes nothing. A key twice in one batch (delivered twice at once, or a stale holder's
success beside the new holder's) shares it once; the other is sent alone after it. Rows are
locked in key order, so two batches queue instead of deadlocking. The lane steps of ordered
keys lock their keys, then their lanes in lane order, and leave out a key whose row or lane
another transaction holds at that moment: it is sent alone, and waits there. A batch that
fails for any reason (a result the database refuses, a dropped connection) is not retried as a
batch: each of its attempts then sends its own statement, with a single key's handling.

Under load, about half the claims and successes share a statement, a few keys to each; the
worker's CPU per event fell by a sixth (docs/explanation/performance.md).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sqlalchemy import Engine

from worker.lanes import admit_keys
from worker.siblings import claim_keys, succeed_keys
from worker.store import Blocked, Claim, InFlight, KeyStore, success_params

Item = TypeVar("Item")
Answer = TypeVar("Answer")

# Attempts in one shared statement at most: its arrays, its locks and its reply stay small.
MAX_BATCH = 64


@dataclass(eq=False)
class _Slot(Generic[Item, Answer]):
    item: Item
    # Set when the answer is in, or when this attempt is to send the next statement.
    ready: threading.Event = field(default_factory=threading.Event)
    answered: bool = False
    # None once answered: send it alone (the shared statement failed, or left it out).
    answer: Answer | None = None
    error: Exception | None = None


class Combiner(Generic[Item, Answer]):
    """One statement in flight at a time; the attempts that arrive meanwhile go in the next.

    `alone(item)` sends one item's own statement: what an attempt that arrives with nothing in
    flight sends. `together(items)` sends two or more in one and answers each, in order; None
    for an item means it shares nothing (a key already in the batch), and a shared statement
    that raises answers None for all: each such item is then sent alone, in its own thread."""

    def __init__(
        self,
        alone: Callable[[Item], Answer],
        together: Callable[[Sequence[Item]], Sequence[Answer | None]],
        limit: int = MAX_BATCH,
    ) -> None:
        self._alone = alone
        self._together = together
        self._limit = limit
        self._lock = threading.Lock()
        self._queue: list[_Slot[Item, Answer]] = []
        # A statement is on its way, or the attempt at the queue's head has been told to send
        # the next: arrivals queue. Not busy means the queue is empty.
        self._busy = False

    def waiting(self) -> int:
        """Attempts not yet in a statement sent (for a test to know a batch has formed)."""
        with self._lock:
            return len(self._queue)

    def submit(self, item: Item) -> Answer:
        slot: _Slot[Item, Answer] = _Slot(item)
        with self._lock:
            self._queue.append(slot)
            lead, self._busy = not self._busy, True
        if not lead:
            slot.ready.wait()
        if not slot.answered:
            self._lead()
        if slot.error is not None:
            raise slot.error
        if slot.answer is None:
            return self._alone(item)
        return slot.answer

    def _lead(self) -> None:
        """Send the oldest waiting attempts' statement (this attempt's among them), then hand
        the next to the oldest attempt still waiting."""
        with self._lock:
            batch, self._queue = self._queue[: self._limit], self._queue[self._limit :]
        answers: Sequence[Answer | None] = [None] * len(batch)
        errors: list[Exception | None] = [None] * len(batch)
        try:
            if len(batch) == 1:
                try:
                    answers = [self._alone(batch[0].item)]
                except Exception as raised:  # the attempt's own, as if it had sent it
                    errors = [raised]
            else:
                # A shared statement that raises leaves every answer None: each alone.
                with contextlib.suppress(Exception):
                    answers = self._together([slot.item for slot in batch])
        finally:
            with self._lock:
                following = self._queue[0] if self._queue else None
                self._busy = following is not None
            for slot, answer, failed in zip(batch, answers, errors, strict=True):
                slot.answer, slot.error, slot.answered = answer, failed, True
                slot.ready.set()
            if following is not None:
                following.ready.set()


@dataclass(frozen=True)
class _Success:
    claim: Claim
    result: Any
    external_ref: str | None
    reconciled: bool | None


class GroupedStore(KeyStore):
    """The worker's store with claims and successes grouped (`Combiner`); every other step is
    the store's own, one statement per call."""

    def __init__(
        self, engine: Engine, lease_seconds: float, in_flight: InFlight | None = None
    ) -> None:
        super().__init__(engine, in_flight)
        self.lease_seconds = lease_seconds
        self._claims: Combiner[tuple[str, str], Claim | Blocked] = Combiner(
            lambda wanted: KeyStore.claim(self, *wanted, lease_seconds), self._claim_together
        )
        self._successes: Combiner[_Success, bool] = Combiner(
            self._succeed_alone, self._succeed_together
        )
        self._admits: Combiner[dict[str, Any], Mapping[str, Any]] = Combiner(
            lambda step: KeyStore.admit(self, step), self._admit_together
        )

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        if lease_seconds != self.lease_seconds:
            return super().claim(key, owner, lease_seconds)
        return self._claims.submit((key, owner))

    def _claim_together(self, wanted: Sequence[tuple[str, str]]) -> list[Claim | Blocked | None]:
        shared = _firsts(wanted, key=lambda one: one[0])
        claims = claim_keys(self, [wanted[i] for i in shared], self.lease_seconds)
        return [claims[one[0]] if i in shared else None for i, one in enumerate(wanted)]

    def succeed(
        self, claim: Claim, result: Any, external_ref: str | None, reconciled: bool | None = None
    ) -> bool:
        return self._successes.submit(_Success(claim, result, external_ref, reconciled))

    def _succeed_alone(self, success: _Success) -> bool:
        return KeyStore.succeed(
            self, success.claim, success.result, success.external_ref, success.reconciled
        )

    def admit(self, step: dict[str, Any]) -> Mapping[str, Any]:
        return self._admits.submit(step)

    def _admit_together(self, steps: Sequence[dict[str, Any]]) -> list[Mapping[str, Any] | None]:
        # `lane_admit_many` takes its locks in its own order (keys, then lanes), waiting for
        # none held elsewhere: a key it left out is sent alone.
        shared = _firsts(steps, key=lambda step: str(step["key"]))
        decided = admit_keys(self, [steps[i] for i in sorted(shared)])
        return [
            decided.get(str(step["key"])) if i in shared else None for i, step in enumerate(steps)
        ]

    def _succeed_together(self, successes: Sequence[_Success]) -> list[bool | None]:
        shared = _firsts(successes, key=lambda s: s.claim.key)
        # In key order, as claims lock rows: a batch never waits on another in a cycle.
        ordered = sorted((successes[i] for i in shared), key=lambda s: s.claim.key)
        done = succeed_keys(
            self, [success_params(s.claim, s.result, s.external_ref, s.reconciled) for s in ordered]
        )
        return [s.claim.key in done if i in shared else None for i, s in enumerate(successes)]


def _firsts(items: Sequence[Item], key: Callable[[Item], str]) -> set[int]:
    """The positions of each key's first item: a key twice in one statement (delivered twice
    at once, or a stale holder beside the new one) shares it once; the other goes alone."""
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        seen.setdefault(key(item), i)
    return set(seen.values())
