"""Unit tests for worker.backoff: exponential backoff with full jitter, Retry-After as a floor."""

from __future__ import annotations

import random

import pytest

from worker.backoff import next_delay

DRAWS = 2000
BASE = 1.0
CAP = 300.0


class TopOfRange(random.Random):
    """An rng whose uniform(a, b) is always b: shows the deterministic ceiling."""

    def uniform(self, a: float, b: float) -> float:
        return b


class BottomOfRange(random.Random):
    """An rng whose uniform(a, b) is always a: the smallest delay full jitter allows."""

    def uniform(self, a: float, b: float) -> float:
        return a


def ceiling(attempt: int, base: float = BASE, cap: float = CAP) -> float:
    return min(cap, base * 2.0 ** (attempt - 1))


@pytest.mark.parametrize(
    ("attempt", "expected"),
    [(1, 1), (2, 2), (3, 4), (4, 8), (5, 16), (6, 30), (7, 30), (20, 30)],
)
def test_ceiling_table(attempt: int, expected: float) -> None:
    """With jitter at its top, base 1 and cap 30 give 1, 2, 4, 8, 16, 30, 30, ... seconds."""
    assert next_delay(attempt, None, base=1, cap=30, rng=TopOfRange()) == expected


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "expected"),
    [
        (1, 0.5, 60, 0.5),
        (4, 0.5, 60, 4.0),
        (8, 0.5, 60, 60.0),
        (3, 2.0, 5.0, 5.0),
        (1, 10.0, 5.0, 5.0),  # the cap holds even on the first attempt
    ],
)
def test_ceiling_with_other_policies(
    attempt: int, base: float, cap: float, expected: float
) -> None:
    """The ceiling is min(cap, base * 2^(attempt-1)) for any base and cap."""
    assert next_delay(attempt, None, base=base, cap=cap, rng=TopOfRange()) == expected


def test_first_attempt_below_one_uses_base() -> None:
    """An attempt number below 1 is treated as the first attempt, never a fraction of base."""
    for attempt in (0, -3):
        assert next_delay(attempt, None, base=2, cap=30, rng=TopOfRange()) == 2


@pytest.mark.parametrize("attempt", range(1, 13))
def test_jittered_delay_stays_within_zero_and_ceiling(attempt: int) -> None:
    """Over many seeded draws every delay lies in [0, min(cap, base * 2^(attempt-1))]."""
    rng = random.Random(attempt)
    top = ceiling(attempt)
    delays = [next_delay(attempt, None, base=BASE, cap=CAP, rng=rng) for _ in range(DRAWS)]
    assert all(0 <= d <= top for d in delays)


@pytest.mark.parametrize("attempt", [1, 4, 9, 12])
def test_full_jitter_spans_the_whole_range(attempt: int) -> None:
    """Full jitter (not equal jitter): draws come near zero and near the ceiling alike."""
    rng = random.Random(1234 + attempt)
    top = ceiling(attempt)
    delays = [next_delay(attempt, None, base=BASE, cap=CAP, rng=rng) for _ in range(DRAWS)]
    # Equal jitter would never go below top / 2.
    assert min(delays) < 0.01 * top
    assert max(delays) > 0.99 * top
    assert sum(d < top / 2 for d in delays) > DRAWS // 4


def test_same_seed_same_delays() -> None:
    """Delays are a pure function of the inputs and the injected rng: one seed, one sequence."""
    first = [next_delay(a, None, base=BASE, cap=CAP, rng=random.Random(7)) for a in range(1, 9)]
    again = [next_delay(a, None, base=BASE, cap=CAP, rng=random.Random(7)) for a in range(1, 9)]
    assert first == again


@pytest.mark.parametrize("attempt", [30, 60, 200, 1000])
def test_cap_holds_for_large_attempts(attempt: int) -> None:
    """A large attempt number neither overflows nor exceeds the cap."""
    rng = random.Random(attempt)
    assert next_delay(attempt, None, base=BASE, cap=CAP, rng=TopOfRange()) == CAP
    delays = [next_delay(attempt, None, base=BASE, cap=CAP, rng=rng) for _ in range(200)]
    assert all(0 <= d <= CAP for d in delays)


def test_cap_holds_beyond_float_range() -> None:
    """An attempt number past 1024 (max_attempts has no upper bound) still yields the cap."""
    assert next_delay(1100, None, base=BASE, cap=CAP, rng=TopOfRange()) == CAP


@pytest.mark.parametrize("attempt", [1, 3, 6, 10])
@pytest.mark.parametrize("retry_after", [0.0, 0.5, 3.0, 45.0])
def test_retry_after_is_a_floor(attempt: int, retry_after: float) -> None:
    """The delay is never shorter than the server's Retry-After."""
    rng = random.Random(attempt * 1000 + int(retry_after * 10))
    for _ in range(500):
        delay = next_delay(attempt, retry_after, base=BASE, cap=30.0, rng=rng)
        assert delay >= retry_after
        assert delay <= max(retry_after, ceiling(attempt, cap=30.0))


@pytest.mark.parametrize(("attempt", "retry_after"), [(1, 5.0), (3, 120.0), (12, 301.0)])
def test_retry_after_above_ceiling_is_the_delay(attempt: int, retry_after: float) -> None:
    """A Retry-After beyond the backoff ceiling is taken exactly, even with jitter at its top."""
    assert retry_after > ceiling(attempt)
    assert next_delay(attempt, retry_after, base=BASE, cap=CAP, rng=TopOfRange()) == retry_after
    assert next_delay(attempt, retry_after, base=BASE, cap=CAP, rng=random.Random(3)) == retry_after


def test_retry_after_lifts_a_small_draw() -> None:
    """When jitter draws below Retry-After, Retry-After wins; when above, the draw wins."""
    assert next_delay(5, 3.0, base=BASE, cap=CAP, rng=BottomOfRange()) == 3.0
    assert next_delay(5, 3.0, base=BASE, cap=CAP, rng=TopOfRange()) == 16.0


def test_no_retry_after_means_zero_is_possible() -> None:
    """Without Retry-After the floor is zero: full jitter may retry at once."""
    assert next_delay(5, None, base=BASE, cap=CAP, rng=BottomOfRange()) == 0.0
