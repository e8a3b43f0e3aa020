"""Several keys in one task: every attempt runs at once and ends before the task does; the
task's state is the outcome that most needs an operator's eye."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from worker import spare
from worker.deliveries import report_all, run_each, run_in_parts
from worker.slots import Slots, Taken
from worker.task_state import DeadLettered, Finished, RetryScheduled


def test_every_attempt_runs_at_once_and_their_outcomes_keep_the_keys_order() -> None:
    started = threading.Barrier(3, timeout=5)

    def attempt(key: str) -> Finished:
        started.wait()  # only passes once all three run together
        return Finished("succeeded" if key != "b" else "blocked")

    assert run_each(["a", "b", "c"], attempt) == ["succeeded", "blocked", "succeeded"]


def test_an_attempts_error_is_raised_once_the_others_have_ended() -> None:
    ended: list[str] = []

    def attempt(key: str) -> Finished:
        if key == "a":
            raise ConnectionError("database away")
        ended.append(key)
        return Finished("succeeded")

    with pytest.raises(ConnectionError):
        run_each(["a", "b", "c"], attempt)
    assert sorted(ended) == ["b", "c"]


def test_a_part_starts_as_its_slots_free_not_when_the_part_before_it_ends() -> None:
    """Two slots, five keys: "b" hangs until "d" has started. "d" needs only the slot "a"
    gives back, so it starts while "b" still runs; parts run one after another would wait
    for "b" and fail here. The outcomes keep the keys' order."""
    slots = Slots(2)
    d_started = threading.Event()
    parts: list[list[str]] = []

    def run_part(part: Sequence[str], held: Taken) -> list[Finished]:
        parts.append(list(part))

        def attempt(key: str) -> Finished:
            try:
                if key == "d":
                    d_started.set()
                if key == "b":
                    assert d_started.wait(5), "d waited for b"
                return Finished("succeeded" if key != "c" else "blocked")
            finally:
                held.give_one()

        try:
            return run_each(part, attempt)
        finally:
            held.give_rest()

    outcomes = run_in_parts(["a", "b", "c", "d", "e"], slots.take, run_part)
    assert outcomes == ["succeeded", "succeeded", "blocked", "succeeded", "succeeded"]
    assert parts[0] == ["a", "b"]
    assert sorted(key for part in parts for key in part) == ["a", "b", "c", "d", "e"]
    assert slots._free == 2


def test_a_parts_error_is_raised_once_every_part_has_ended() -> None:
    slots = Slots(1)
    ended: list[str] = []

    def run_part(part: Sequence[str], held: Taken) -> list[Finished]:
        try:
            if part[0] == "a":
                raise ConnectionError("database away")
            ended.append(part[0])
            return [Finished("succeeded")]
        finally:
            held.give_rest()

    with pytest.raises(ConnectionError):
        run_in_parts(["a", "b", "c"], slots.take, run_part)
    assert ended == ["b", "c"]


def test_a_part_that_finds_no_thread_gives_its_slots_back(monkeypatch: pytest.MonkeyPatch) -> None:
    slots = Slots(2)

    def no_thread(work: object, name: str) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(spare, "run", no_thread)
    with pytest.raises(RuntimeError):
        run_in_parts(["a", "b", "c"], slots.take, lambda part, held: [])
    assert slots._free == 2


def test_the_task_ends_failure_then_retry_then_success() -> None:
    done, blocked = Finished("succeeded"), Finished("blocked")
    retry, dead = Finished("retry", "http_503"), Finished("dead_letter", "http_422")
    with pytest.raises(DeadLettered, match=r"^http_422$"):
        report_all([done, retry, dead])
    with pytest.raises(RetryScheduled) as raised:
        report_all([done, retry, Finished("retry", "timeout")])
    assert raised.value.error_code == "http_503,timeout"
    assert report_all([done, blocked, done]) == "succeeded,blocked,succeeded"
