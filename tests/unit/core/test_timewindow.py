"""Unit tests for outbox.core.timewindow: operator filter values parse or are refused, never
crash."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from outbox.core.timewindow import MAX_DURATION, parse_duration, parse_instant

NOW = datetime(2026, 1, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("90s", timedelta(seconds=90)), ("1.5h", timedelta(minutes=90)), ("36525d", MAX_DURATION)],
)
def test_durations_up_to_a_century_parse(text: str, expected: timedelta) -> None:
    """Durations in each unit parse, up to and including MAX_DURATION."""
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["36526d", "1000000w", "9" * 400 + "s", "99999999999999999999d"])
def test_a_duration_beyond_a_century_is_a_value_error(text: str) -> None:
    """Too long a window (even one whose number overflows a float) is a ValueError, which every
    caller turns into a refusal, never an OverflowError."""
    with pytest.raises(ValueError, match="longer than"):
        parse_duration(text)
    with pytest.raises(ValueError, match="longer than"):
        parse_instant(text, now=NOW)


def test_a_relative_instant_counts_back_from_now() -> None:
    """`2h` as an instant is two hours before `now`."""
    assert parse_instant("2h", now=NOW) == NOW - timedelta(hours=2)
