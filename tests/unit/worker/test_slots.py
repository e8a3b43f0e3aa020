"""A worker's attempt slots (`worker.slots`): taken a message at a time, first come first
served, each given back as its attempt ends."""

from __future__ import annotations

import threading
import time

from worker.slots import Slots


def _queued(slots: Slots, count: int) -> None:
    deadline = time.monotonic() + 5
    while len(slots._queue) < count:
        assert time.monotonic() < deadline, "the message never queued"
        time.sleep(0.005)


def test_a_message_needing_many_slots_is_not_passed_by_single_keys() -> None:
    """Three of four slots are busy; a message of four keys asks first, then a single key:
    the single key waits its turn although one slot is free, so the message is served first
    once the three end."""
    slots = Slots(4)
    busy = slots.take(3)
    order: list[str] = []

    def take(name: str, count: int) -> None:
        slots.take(count).give_rest()
        order.append(name)

    packed = threading.Thread(target=take, args=("packed", 4), daemon=True)
    packed.start()
    _queued(slots, 1)
    single = threading.Thread(target=take, args=("single", 1), daemon=True)
    single.start()
    _queued(slots, 2)
    assert order == []  # one slot is free, yet the single key waits behind the message

    busy.give_rest()
    packed.join(5)
    single.join(5)
    assert order == ["packed", "single"]


def test_each_attempt_gives_its_slot_back_and_the_rest_once() -> None:
    slots = Slots(4)
    held = slots.take(3)
    held.give_one()
    assert slots._free == 2
    held.give_rest()
    held.give_rest()
    assert slots._free == 4
    assert slots.take(9)._left == 4  # more keys than slots: all of them


def test_no_bound_takes_nothing() -> None:
    free = Slots(None)
    held = free.take(100)
    held.give_rest()
    assert free._free == 0 and not free._queue
