"""The purge's batch size against the statement timeout (outbox/maintenance/pace.py)."""

from __future__ import annotations

import pytest

from outbox.maintenance.pace import BatchPace


def test_a_slow_batch_halves_the_next_and_fast_ones_grow_it_back_to_the_ceiling() -> None:
    pace = BatchPace(1000)
    pace.took(1.5, timeout_seconds=3.0)  # more than a third: halve
    assert pace.size == 500
    pace.took(0.5, timeout_seconds=3.0)  # between a tenth and a third: keep
    assert pace.size == 500
    for _ in range(3):
        pace.took(0.1, timeout_seconds=3.0)  # under a tenth: double, up to the ceiling
    assert pace.size == 1000
    pace.took(10.0, timeout_seconds=None)  # no timeout: nothing to measure against
    assert pace.size == 1000


def test_cancellations_halve_down_to_one_then_give_up() -> None:
    pace = BatchPace(5)
    assert [pace.cancelled(), pace.size, pace.cancelled(), pace.size] == [True, 2, True, 1]
    assert pace.cancelled() is False
    assert (pace.size, pace.cancellations) == (1, 3)
    for _ in range(5):
        pace.took(3.0, timeout_seconds=3.0)
    assert pace.size == 1


def test_a_size_is_kept_inside_its_ceiling_and_a_batch_holds_a_row() -> None:
    assert BatchPace(100, size=250).size == 100
    assert BatchPace(100, size=30).size == 30
    with pytest.raises(ValueError):
        BatchPace(0)
