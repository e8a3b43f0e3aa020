"""Operator-friendly filter values: instants as ISO-8601 or relative ("2h" ago), globs."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

_RELATIVE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}
# The longest duration a filter may name: a century reaches past anything the gateway keeps
# (keys expire after a TTL counted in days) and stays far inside the calendar's range, so
# "that long ago" can never overflow into a 500.
MAX_DURATION = timedelta(days=36_525)


def parse_duration(value: str) -> timedelta:
    """`90s`, `5m`, `2h`, `7d`, `1w` as a duration, at most `MAX_DURATION`."""
    match = _RELATIVE.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a duration such as 30s, 5m, 2h or 7d")
    seconds = float(match.group(1)) * _UNITS[match.group(2)]
    # Written so that an overflow to infinity (a number of 400 digits) fails it too.
    if not seconds <= MAX_DURATION.total_seconds():
        raise ValueError(f"{value!r} is longer than {MAX_DURATION.days} days")
    return timedelta(seconds=seconds)


def parse_instant(value: str, now: datetime | None = None) -> datetime:
    """An ISO-8601 instant (UTC when no offset is given), or a duration meaning "that long ago"."""
    if _RELATIVE.match(value):
        return (now or datetime.now(UTC)) - parse_duration(value)
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError as error:
        raise ValueError(f"{value!r} is neither ISO-8601 nor a duration such as 2h") from error
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def iso(value: datetime | None) -> str | None:
    """An instant as ISO-8601 for a JSON answer (None stays None)."""
    return None if value is None else value.isoformat()


def glob_to_like(pattern: str) -> str:
    """A shell glob (`crm.*`, `order.?`) as a LIKE pattern, with LIKE's own wildcards escaped."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")
