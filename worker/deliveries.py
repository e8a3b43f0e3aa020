"""Several keys in one task message (`PROCESS_KEYS_TASK`).

The relay sends an event's deliveries taken in one batch as one message, and packs deliveries
that fell due together up to RELAY_KEYS_PER_MESSAGE, so they share what each message costs the
worker (its fetch from the broker, its ack, one claim statement). Nothing else is shared: each
key runs its own attempt, exactly as a `PROCESS_TASK` message of that key would (its claim,
fence, lease, outcome and span), each in a thread of its own (`worker.spare`), so a slow or
hanging destination never holds its siblings back. The task ends when every attempt has ended,
and reports the outcome that most needs an operator's eye (`report_all`).

A redelivered copy of such a message is as harmless as a single one: each key's claim refuses a
finished or held key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from worker import spare
from worker.slots import Taken
from worker.task_state import DeadLettered, Finished, RetryScheduled

T = TypeVar("T")


def run_each(keys: Sequence[str], attempt: Callable[[str], Finished]) -> list[Finished]:
    """Run `attempt(key)` for every key at once (the first in the calling thread), wait for all
    and return their outcomes in the keys' order; an attempt's error is raised once every other
    attempt has ended."""
    outcomes: list[Finished | None] = [None] * len(keys)
    errors: list[BaseException] = []
    ended = threading.Semaphore(0)

    def one(index: int) -> None:
        try:
            outcomes[index] = attempt(keys[index])
        except BaseException as error:  # raised in the task's thread, after the others
            errors.append(error)

    def elsewhere(index: int) -> None:
        try:
            one(index)
        finally:
            ended.release()

    for index in range(1, len(keys)):
        spare.run(partial(elsewhere, index), f"delivery-{index}")
    if keys:
        one(0)
    for _ in range(1, len(keys)):
        ended.acquire()
    if errors:
        raise errors[0]
    return [outcome for outcome in outcomes if outcome is not None]


def run_in_parts(
    keys: Sequence[str],
    take: Callable[[int], Taken],
    run_part: Callable[[Sequence[str], Taken], list[Finished]],
) -> list[Finished]:
    """Run `keys` in parts as slots come free (`worker.slots`): each part is as many of the
    next keys as `take` gave slots for, and starts at once, in a thread of its own while keys
    are left to wait for theirs (the last part in the calling thread), so a part never waits
    for the one before it to end. Waits for every part and returns the outcomes in the keys'
    order; an error is raised once every part has ended."""
    parts: list[list[Finished]] = []
    errors: list[BaseException] = []
    ended = threading.Semaphore(0)
    started = 0

    def one(index: int, part: Sequence[str], held: Taken) -> None:
        try:
            parts[index] = run_part(part, held)
        except BaseException as error:  # raised in the task's thread, after the others
            errors.append(error)

    def elsewhere(index: int, part: Sequence[str], held: Taken) -> None:
        try:
            one(index, part, held)
        finally:
            ended.release()

    while started < len(keys):
        held = take(len(keys) - started)
        part = keys[started : started + held.count]
        started += len(part)
        parts.append([])
        if started < len(keys):
            try:
                spare.run(partial(elsewhere, len(parts) - 1, part, held), f"part-{len(parts)}")
            except BaseException:  # no thread for it (the process is out of threads)
                held.give_rest()  # slots that no attempt will give back
                raise
        else:
            one(len(parts) - 1, part, held)
    for _ in range(len(parts) - 1):
        ended.acquire()
    if errors:
        raise errors[0]
    return [outcome for outcomes in parts for outcome in outcomes]


def run_in_turn(items: Sequence[T], run: Callable[[T], list[Finished]]) -> list[Finished]:
    """Run `run(item)` for every item one after another, in order, and return all their
    outcomes; an error is raised once every other item has run.

    A prefork worker runs a message of unrelated keys this way, one key at a time, as that
    pool promises (an event's deliveries still run at once), each key claimed only when its
    turn comes, so that no lease runs out while it waits behind a slow one."""
    outcomes: list[Finished] = []
    errors: list[BaseException] = []
    for item in items:
        try:
            outcomes.extend(run(item))
        except BaseException as error:  # raised after the others, as run_each does
            errors.append(error)
    if errors:
        raise errors[0]
    return outcomes


def report_all(outcomes: Sequence[Finished]) -> str:
    """The task's state for several attempts: FAILURE (`DeadLettered`) if any ended in a dead
    letter, else RETRY (`RetryScheduled`) if any scheduled a retry, each naming the error codes
    of those attempts; else SUCCESS, returning the outcomes' names in the keys' order. As for one
    key, only error codes leave the worker, and nothing is asked of Celery: each retry waits in
    its own key's outbox row."""
    for outcome, error in (("dead_letter", DeadLettered), ("retry", RetryScheduled)):
        codes = sorted({f.error_code or "unknown" for f in outcomes if f == outcome})
        if codes:
            raise error(",".join(codes))
    return ",".join(outcomes)
