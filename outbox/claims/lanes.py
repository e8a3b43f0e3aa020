"""A claim's lane and version: what the lane step compares, read once at the request's door.

A claim may name a `lane` (any label: the business object the effect is about) and a
`version`. With a version the lane keeps only the newest (supersede); without one it lets one
claim hold it at a time. A version is an integer, or an RFC 3339 timestamp with an explicit
offset; its rank is the number the database compares: the integer itself, or the timestamp in
microseconds since the epoch, so `2026-12-01T11:00:00+01:00` and `2026-12-01T10:00:00Z` are
one version. Its text is what `superseded_by` later reports: the integer's digits, or the
timestamp in UTC (`…Z`).
"""

from __future__ import annotations

import calendar
from dataclasses import dataclass
from datetime import datetime

from outbox.core import keys

# numeric holds any integer, but an integer version wider than 64 bits is a mistake upstream
# (a hash, an amount in the wrong field), not a version.
_INT_LIMIT = 2**63


class InvalidVersion(ValueError):
    """The version is neither a 64-bit integer nor an RFC 3339 timestamp with an offset."""


@dataclass(frozen=True)
class Version:
    text: str
    rank: int


def parse_version(value: int | str) -> Version:
    """The version's text and rank, or InvalidVersion."""
    if isinstance(value, bool):  # a JSON true is not a version, though Python calls it an int
        raise InvalidVersion("a version is an integer or an RFC 3339 timestamp")
    if isinstance(value, int):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise InvalidVersion("an integer version fits in 64 bits")
        return Version(str(value), value)
    utc = keys.utc_timestamp(value.strip())
    if utc is None:
        raise InvalidVersion(
            "a string version is an RFC 3339 timestamp with an offset, such as 2026-12-01T10:00:00Z"
        )
    # The UTC form's seconds and fraction, read as digits (never a float): microseconds exact,
    # finer digits dropped.
    whole, _, fraction = utc[:-1].partition(".")
    seconds = calendar.timegm(datetime.fromisoformat(whole).timetuple())
    return Version(utc, seconds * 1_000_000 + int(fraction[:6].ljust(6, "0")))
