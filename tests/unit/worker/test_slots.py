"""A worker's attempt slots (`worker.slots`): a message takes the free ones, one at least,
first come first served; each is given back as its attempt ends."""

from __future__ import annotations

import threading
import time

from worker.slots import Slots


def _queued(slots: Slots, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(slots._queue) < count:
        assert time.monotonic() < deadline, "the message never queued"
        time.sleep(0.005)


def test_a_message_takes_the_free_slots_and_a_later_key_waits_its_turn() -> None:
    """Three of four slots are busy: a message of four keys takes the free one at once. Its
    other three ask again, then a single key asks: the first slot to come free goes to the
    message, which asked first, and the single key waits its turn."""
    slots = Slots(4)
    busy = [slots.take(1) for _ in range(3)]
    first = slots.take(4)
    assert first.count == 1 and slots._free == 0
    order: list[tuple[str, int]] = []

    def take(name: str, count: int) -> None:
        order.append((name, slots.take(count).count))

    rest = threading.Thread(target=take, args=("packed", 3), daemon=True)
    rest.start()
    _queued(slots, 1)
    single = threading.Thread(target=take, args=("single", 1), daemon=True)
    single.start()
    _queued(slots, 2)
    assert order == []  # no slot is free

    busy[0].give_rest()
    rest.join(5)
    assert order == [("packed", 1)]  # one free slot: the message's, though it wanted three
    busy[1].give_rest()
    single.join(5)
    assert order == [("packed", 1), ("single", 1)]


def test_a_slot_given_back_wakes_only_the_message_at_the_head_of_the_line() -> None:
    """Behind a slow downstream up to the worker's concurrency of messages wait here: a slot
    given back wakes the first of them, not every one."""
    slots = Slots(1)
    held = slots.take(1)
    taken: list[int] = []
    waiting = [
        threading.Thread(target=lambda: taken.append(slots.take(1).count), daemon=True)
        for _ in range(3)
    ]
    for count, thread in enumerate(waiting, start=1):
        thread.start()
        _queued(slots, count)
    held.give_rest()
    waiting[0].join(5)
    assert taken == [1]
    assert len(slots._queue) == 2 and not any(turn.is_set() for turn in slots._queue)
    slots._give(2)  # the other two go, in their turn
    for thread in waiting[1:]:
        thread.join(5)
    assert taken == [1, 1, 1]


def test_each_attempt_gives_its_slot_back_and_the_rest_once() -> None:
    slots = Slots(4)
    held = slots.take(3)
    held.give_one()
    assert slots._free == 2
    held.give_rest()
    held.give_rest()
    assert slots._free == 4
    held = slots.take(9)
    assert held.count == held._left == 4  # more keys than slots: all of them


def test_no_bound_takes_nothing() -> None:
    free = Slots(None)
    held = free.take(100)
    assert held.count == 100
    held.give_rest()
    assert free._free == 0 and not free._queue
