"""Unit tests for the claims API's busy Retry-After: an estimate from the time held, bounded by
the lease."""

from __future__ import annotations

from decimal import Decimal

import pytest

from outbox.claims.service import busy_retry_after


@pytest.mark.parametrize(
    ("lease_remaining", "held", "expected"),
    [
        (30, Decimal("0.2"), 1),  # just claimed: ask again in a second
        (30, Decimal("0"), 1),  # never 0
        (30, Decimal("4.3"), 5),  # about as long again as it has run
        (25, Decimal("40"), 25),  # never past the lease's end
        (0, Decimal("3"), 1),  # a lease ending now: still at least a second
        (12, None, 12),  # not processing: the lease's remainder, as before
        (None, None, 1),
    ],
)
def test_busy_retry_after_table(lease_remaining: object, held: object, expected: int) -> None:
    """The estimate is ceil(held), at least 1 s and at most the lease's remainder."""
    assert busy_retry_after(lease_remaining, held) == expected
