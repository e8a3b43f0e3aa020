"""The outbox's day partitions: which exist, which may go, and the DDL that makes or drops one.

The outbox is partitioned by `created_at`, a day (UTC) per partition, plus the partition of
everything before the first day (the table as it was before partitioning) and a DEFAULT one for
rows whose day has none (migrations/versions/0017_outbox_partitions.py). A day is dropped only
once nothing in it is still needed: no unpublished row, no row published within the retention.
Rows are never inserted with a `created_at` of their own, so a day that has ended gets no new
rows and the answer cannot change back.

The DDL names a partition, which a bind cannot do: names are made here from a date, or read
from the catalog and checked against `PARTITION_NAME` before they reach a statement.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta

from sqlalchemy import TextClause, text

# outbox_20261206 (a day), outbox_before_20261206 (everything before it), outbox_default.
PARTITION_NAME = re.compile(r"outbox_(before_)?[0-9]{8}|outbox_default")

LIST_PARTITIONS: TextClause = text(
    r"""
    -- The outbox's partitions with their bounds (starts NULL: from the beginning; both NULL:
    -- the DEFAULT partition), read from the catalog.
    SELECT c.relname AS name,
           CAST(substring(b.bound FROM 'FROM \(''([^'']+)''\)') AS timestamptz) AS starts,
           CAST(substring(b.bound FROM 'TO \(''([^'']+)''\)') AS timestamptz) AS ends
      FROM pg_inherits i
      JOIN pg_class c ON c.oid = i.inhrelid
     CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
     WHERE i.inhparent = CAST('outbox' AS regclass)
     ORDER BY ends NULLS LAST, name
    """
)

NOW: TextClause = text("SELECT now()")

# A partition's DDL waits this long for its lock, then gives up until the next pass: a drop
# or a creation queued behind a long transaction would hold every insert up behind it.
LOCK_TIMEOUT: TextClause = text("SELECT set_config('lock_timeout', :timeout, true)")

# Drop (and re-check under the lock) takes the whole outbox first, then the day: in the other
# order a relay reading every day could hold the outbox while waiting for the day we hold.
LOCK_OUTBOX: TextClause = text("LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")


def day_name(day: datetime) -> str:
    """The partition of the day that starts at `day` (midnight UTC)."""
    return f"outbox_{day:%Y%m%d}"


def create_day(day: datetime) -> TextClause:
    """Make the partition of the day that starts at `day` (midnight UTC)."""
    ends = day + timedelta(days=1)
    return text(
        f"CREATE TABLE {day_name(day)} PARTITION OF outbox"
        f" FOR VALUES FROM ('{day.isoformat()}') TO ('{ends.isoformat()}')"
    )


def still_needed(name: str) -> TextClause:
    """Whether any row of partition `name` must stay: unpublished (the relay has yet to send
    it), or published within :retention_seconds. Two index probes (the partial indexes of
    unpublished and of published rows), whatever the partition's size."""
    return text(
        f"""
        SELECT EXISTS (SELECT 1 FROM {_checked(name)} WHERE published_at IS NULL)
            OR EXISTS (SELECT 1 FROM {_checked(name)}
                        WHERE published_at >= now() - make_interval(secs => :retention_seconds))
        """
    )


def drop(name: str) -> TextClause:
    """Drop partition `name`, its rows with it (take `LOCK_OUTBOX` first)."""
    return text(f"DROP TABLE {_checked(name)}")


def _checked(name: str) -> str:
    if not PARTITION_NAME.fullmatch(name):
        raise ValueError(f"not an outbox partition: {name!r}")
    return name
