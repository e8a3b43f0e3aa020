"""Several keys in one task: every attempt runs at once and ends before the task does; the
task's state is the outcome that most needs an operator's eye."""

from __future__ import annotations

import threading

import pytest

from worker.deliveries import report_all, run_each
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


def test_the_task_ends_failure_then_retry_then_success() -> None:
    done, blocked = Finished("succeeded"), Finished("blocked")
    retry, dead = Finished("retry", "http_503"), Finished("dead_letter", "http_422")
    with pytest.raises(DeadLettered, match=r"^http_422$"):
        report_all([done, retry, dead])
    with pytest.raises(RetryScheduled) as raised:
        report_all([done, retry, Finished("retry", "timeout")])
    assert raised.value.error_code == "http_503,timeout"
    assert report_all([done, blocked, done]) == "succeeded,blocked,succeeded"
