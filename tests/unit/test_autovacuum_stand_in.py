"""The bench's stand-in for autovacuum decides as the launcher does, from the server's own
thresholds: dead rows past the vacuum threshold, changes past the analyze threshold."""

from __future__ import annotations

import pytest

from bench.autovacuum import POSTGRESQL_DEFAULTS as DEFAULTS


@pytest.mark.parametrize(
    ("dead", "changed", "rows", "expected"),
    [
        (0, 0, 0, []),
        (50, 50, 0, []),
        (51, 0, 0, ["VACUUM"]),
        (0, 51, 0, ["ANALYZE"]),
        (2_050, 1_050, 10_000, []),
        (2_051, 1_051, 10_000, ["VACUUM", "ANALYZE"]),
        (0, 20_000, 0, ["ANALYZE"]),  # a table filled since it was made: never analysed
    ],
)
def test_work_follows_the_thresholds(
    dead: int, changed: int, rows: float, expected: list[str]
) -> None:
    assert DEFAULTS.work(dead, changed, rows) == expected
