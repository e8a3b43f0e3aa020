"""A claim's lane and version: what the lane step compares, read once at the request's door.

A claim may name a `lane` (any label: the business object the effect is about) and a
`version`. With a version the lane keeps only the newest (supersede); without one it lets one
claim hold it at a time. A claim has no route to say how its versions compare, so the JSON
type says it: an integer is an integer version, a string an RFC 3339 timestamp with an
explicit offset (`outbox.core.versions`: ranked in microseconds since the epoch, so
`2026-12-01T11:00:00+01:00` and `2026-12-01T10:00:00Z` are one version). Its text is what
`superseded_by` later reports: the integer's digits, or the timestamp in UTC (`…Z`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from outbox.core.versions import VersionInvalid, version_rank

# numeric holds any integer, but an integer version wider than 64 bits is a mistake upstream
# (a hash, an amount in the wrong field), not a version.
_INT_LIMIT = 2**63
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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
    try:
        rank = version_rank(value, "timestamp")
    except VersionInvalid as error:
        raise InvalidVersion(f"a string version is {error}") from error
    utc = _EPOCH + timedelta(microseconds=rank)
    return Version(utc.isoformat().replace("+00:00", "Z"), rank)
