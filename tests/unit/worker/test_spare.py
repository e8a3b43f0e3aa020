"""Threads kept between attempts (`worker.spare`): reused when idle, started at once when none
is, never shared by two pieces of work at a time, and gone after their idle time."""

from __future__ import annotations

import threading

import pytest

from tests.support import wait_until
from worker.spare import Spare


def _run_and_wait(spare: Spare, name: str = "action") -> str:
    """Run one piece of work and wait for it; the name of the thread that ran it."""
    ran: list[str] = []
    done = threading.Event()

    def work() -> None:
        ran.append(threading.current_thread().name)
        done.set()

    spare.run(work, name)
    assert done.wait(10)
    return ran[0]


def test_a_thread_that_finished_runs_the_next_work_under_its_name() -> None:
    spare = Spare()
    names = [_run_and_wait(spare, f"delivery-{n}") for n in range(20)]
    wait_until(lambda: spare.idle() == 1)
    assert spare.started == 1
    assert names == [f"delivery-{n}" for n in range(20)]


def test_work_that_finds_no_idle_thread_starts_one_at_once() -> None:
    """A piece of work that hangs keeps its thread; the next runs beside it, not after it."""
    spare = Spare()
    hanging = threading.Event()
    # Longer than the wait below: queued behind it, the next work would not run in time.
    spare.run(lambda: (hanging.wait(60), None)[1], "action")
    assert _run_and_wait(spare) == "action"
    assert spare.started == 2
    hanging.set()
    wait_until(lambda: spare.idle() == 2)
    _run_and_wait(spare)
    assert spare.started == 2


def test_idle_threads_end_after_their_idle_time() -> None:
    spare = Spare(idle_seconds=0.2)
    _run_and_wait(spare)
    wait_until(lambda: spare.idle() == 0, timeout=10)
    _run_and_wait(spare)
    assert spare.started == 2


# The thread ends with the error, as any thread would: Python reports it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_whose_work_raised_is_never_offered_again() -> None:
    spare = Spare()
    failed = threading.Event()

    def raises() -> None:
        failed.set()
        raise RuntimeError("the work's own error")

    spare.run(raises, "raises")
    assert failed.wait(10)
    # Python reports the error before the thread ends: wait for the end, inside this test.
    wait_until(lambda: all(t.name != "raises" for t in threading.enumerate()), timeout=10)
    for _ in range(3):
        _run_and_wait(spare)
    assert spare.started == 2
