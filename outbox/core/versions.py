"""A version's rank: where an event stands in its lane when the route compares versions.

Versions travel as text (an envelope's `version`, a provider's `created` or `updated_at`, a
claim's `version`); a lane compares them as numbers. Integers rank as themselves; RFC 3339
timestamps as microseconds since the Unix epoch, so two spellings of one instant (`Z` and
`+00:00`, another offset) rank the same. Anything else is refused at intake (422), never
guessed at: a version that sorts wrongly would apply a stale update over a newer one.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Literal

VersionFormat = Literal["integer", "timestamp"]

# 38 digits: any integer a sender uses (epoch nanoseconds, a 64-bit counter) and far inside
# PostgreSQL's numeric.
_INTEGER = re.compile(r"[+-]?[0-9]{1,38}")
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class VersionInvalid(ValueError):
    """The version does not read as the route's format; the message says what was expected."""


def version_rank(version: str, version_format: VersionFormat) -> int:
    """The number a lane orders `version` by."""
    text = version.strip()
    if version_format == "integer":
        if not _INTEGER.fullmatch(text):
            raise VersionInvalid("an integer (digits, at most 38) is expected")
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError as error:
        raise VersionInvalid(
            'an RFC 3339 timestamp with its offset is expected ("2026-12-01T09:30:00Z")'
        ) from error
    if moment.tzinfo is None or "T" not in text.upper():
        raise VersionInvalid(
            'an RFC 3339 timestamp with its offset is expected ("2026-12-01T09:30:00Z")'
        )
    return (moment - _EPOCH) // _MICROSECOND
