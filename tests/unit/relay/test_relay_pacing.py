"""The relay's pacing, gathering and idle waits, as pure functions of what a pass did."""

from __future__ import annotations

import pytest

from outbox.relay.loop import IDLE_FLOOR_SECONDS, Batch, Pacer, gather_wait, idle_wait

PACER = Pacer(rate=2000.0, age_seconds=5.0)


@pytest.mark.parametrize(
    ("batch", "elapsed", "pause"),
    [
        (Batch(500, 500, 0.2), 0.01, 0.0),  # fresh rows: at once
        (Batch(500, 500, 60.0), 0.05, 0.2),  # a backlog: 500 rows at 2000/s take 0.25 s
        (Batch(500, 500, 60.0), 0.3, 0.0),  # the pass itself took longer than its share
        (Batch(500, 0, 60.0), 0.01, 0.0),  # nothing went out: nothing to pace
        (Batch(0, 0, 0.0), 0.0, 0.0),
    ],
)
def test_only_a_backlog_is_paced(batch: Batch, elapsed: float, pause: float) -> None:
    """Rows older than the age are published at the rate; fresh rows and empty passes are not
    held back."""
    assert PACER.pause(batch, elapsed) == pytest.approx(pause)


def test_rate_zero_is_unbounded() -> None:
    """RELAY_BACKLOG_RATE=0 never pauses."""
    assert Pacer(rate=0.0, age_seconds=0.0).pause(Batch(500, 500, 3600.0), 0.0) == 0.0


@pytest.mark.parametrize(
    ("batch", "next_due", "wait"),
    [
        (Batch(0, 0, 0.0), None, 1.0),  # nothing unpublished: the poll interval
        (Batch(3, 3, 0.0), -0.5, 0.0),  # progress and more due: go on
        (Batch(0, 0, 0.0), -0.5, IDLE_FLOOR_SECONDS),  # due but locked elsewhere: the floor
        (Batch(0, 0, 0.0), 0.4, 0.4),  # a retry falls due soon
        (Batch(0, 0, 0.0), 30.0, 1.0),  # a retry far off: the poll interval
    ],
)
def test_an_idle_pass_never_spins(batch: Batch, next_due: float | None, wait: float) -> None:
    """A pass that took nothing always waits; one that made progress goes on while rows are
    due."""
    assert idle_wait(batch, next_due, poll_seconds=1.0) == pytest.approx(wait)


@pytest.mark.parametrize(
    ("batch", "full", "wait"),
    [
        (Batch(3, 3, 0.01), False, 0.01),  # published, room left: let the next rows gather
        (Batch(500, 500, 0.2), True, 0.0),  # a full batch: more is due already, go on
        (Batch(0, 0, 0.0), False, 0.0),  # took nothing: the idle wait, woken by a NOTIFY
        (Batch(2, 0, 0.0), False, 0.0),  # took rows but sent none (refused): nothing to pack
    ],
)
def test_only_a_pass_that_published_lets_rows_gather(batch: Batch, full: bool, wait: float) -> None:
    """A row that comes to an idle relay goes out at once; only after a publish does the
    relay wait RELAY_GATHER_SECONDS, and never when its batch came back full."""
    assert gather_wait(batch, full, seconds=0.01) == pytest.approx(wait)


def test_gather_zero_goes_on_at_once() -> None:
    """RELAY_GATHER_SECONDS=0: each pass takes what came during the last, as it comes."""
    assert gather_wait(Batch(3, 3, 0.01), False, seconds=0.0) == 0.0
