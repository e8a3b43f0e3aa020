"""Upkeep of the outbox's day partitions: make the next days, drop the days nobody needs.

Part of every purge (`outbox.maintenance.purge`), so the sweeper does it on its passes:

- the days from today to `AHEAD_DAYS` ahead get a partition each, so rows land in their day and
  not in the DEFAULT partition (which only stands in while the sweeper is away);
- a day that has ended goes whole (`DROP TABLE`, milliseconds) once every row in it is
  published and past the retention. A day with a row still unpublished (a route paused for
  longer than the retention, a relay down) waits for it; the purge's row-by-row prune reaches
  such a day's published rows a day after it would have been dropped, so a lingering row keeps
  its day's disk for no longer than that.

Each DDL statement gives up after `LOCK_TIMEOUT_MS` rather than queue behind a long transaction
(an exclusive lock waiting in line holds every insert up behind it); what it did not do is done
at the next pass. Each step is its own transaction; an interrupted upkeep leaves nothing half
done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from psycopg import errors as pg_errors
from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from outbox.core.logs import get_logger
from outbox.store import partitions as q

log = get_logger(__name__)

# Partitions exist for today and this many days after it.
AHEAD_DAYS = 3
LOCK_TIMEOUT_MS = 500
# A DDL statement that met one of these is left for the next pass: its lock was not free, or
# another upkeep (an operator's `idem purge` beside the sweeper's) got there first.
_RETRY_LATER = (pg_errors.LockNotAvailable, pg_errors.DuplicateTable, pg_errors.UndefinedTable)


@dataclass(frozen=True)
class Partition:
    name: str
    starts: datetime | None  # None: from the beginning (or the DEFAULT partition)
    ends: datetime | None  # None: the DEFAULT partition

    def covers(self, day: datetime) -> bool:
        return (
            self.ends is not None
            and self.ends > day
            and (self.starts is None or self.starts <= day)
        )


@dataclass
class PartitionReport:
    created: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    # Days that have ended but still hold a row somebody needs.
    waiting: list[str] = field(default_factory=list)


def upkeep(engine: Engine, *, retention_seconds: float, dry_run: bool = False) -> PartitionReport:
    """Make the days ahead and drop the days past; a dry run only says what it would do."""
    report = PartitionReport()
    partitions, now = _partitions(engine)
    today = datetime(now.year, now.month, now.day, tzinfo=UTC)
    for n in range(AHEAD_DAYS + 1):
        day = today + timedelta(days=n)
        if any(p.covers(day) for p in partitions):
            continue
        if dry_run or _create(engine, day):
            report.created.append(q.day_name(day))
    for partition in partitions:
        if partition.ends is None or partition.ends > now:
            continue
        needed = _needed(engine, partition.name, retention_seconds)
        if needed:
            report.waiting.append(partition.name)
        elif needed is False and (dry_run or _drop(engine, partition.name, retention_seconds)):
            report.dropped.append(partition.name)
    return report


def _partitions(engine: Engine) -> tuple[list[Partition], datetime]:
    with engine.connect() as conn:
        rows = conn.execute(q.LIST_PARTITIONS).all()
        now = conn.execute(q.NOW).scalar_one()
    found = [Partition(r.name, r.starts, r.ends) for r in rows]
    return found, now.astimezone(UTC)


def _needed(engine: Engine, name: str, retention_seconds: float) -> bool | None:
    """Whether partition `name` still holds a row somebody needs; None when it is gone."""
    params = {"retention_seconds": retention_seconds}
    try:
        with engine.connect() as conn:
            return bool(conn.execute(q.still_needed(name), params).scalar())
    except DBAPIError as error:
        if isinstance(error.orig, pg_errors.UndefinedTable):
            return None
        raise


def _create(engine: Engine, day: datetime) -> bool:
    """Make `day`'s partition; False when it must wait. A DEFAULT partition that already holds
    rows of that day refuses it (they would be in the wrong place): the day stays in DEFAULT,
    whose rows the row-by-row prune removes, and the next days get theirs."""
    try:
        with engine.begin() as conn:
            conn.execute(q.LOCK_TIMEOUT, {"timeout": f"{LOCK_TIMEOUT_MS}ms"})
            conn.execute(q.create_day(day))
    except DBAPIError as error:
        if isinstance(error.orig, pg_errors.CheckViolation):
            log.warning("outbox.partition_skipped", day=f"{day:%Y-%m-%d}", reason="default_rows")
            return False
        if isinstance(error.orig, _RETRY_LATER):
            log.info("outbox.partition_deferred", day=f"{day:%Y-%m-%d}", reason=_reason(error))
            return False
        raise
    log.info("outbox.partition_created", partition=q.day_name(day))
    return True


def _drop(engine: Engine, name: str, retention_seconds: float) -> bool:
    """Drop partition `name` if, under the outbox's lock, it still holds nothing needed."""
    try:
        with engine.begin() as conn:
            conn.execute(q.LOCK_TIMEOUT, {"timeout": f"{LOCK_TIMEOUT_MS}ms"})
            conn.execute(q.LOCK_OUTBOX)
            params = {"retention_seconds": retention_seconds}
            if conn.execute(q.still_needed(name), params).scalar():
                return False
            conn.execute(q.drop(name))
    except DBAPIError as error:
        if isinstance(error.orig, _RETRY_LATER):
            log.info("outbox.partition_deferred", partition=name, reason=_reason(error))
            return False
        raise
    log.info("outbox.partition_dropped", partition=name)
    return True


def _reason(error: DBAPIError) -> str:
    if isinstance(error.orig, pg_errors.LockNotAvailable):
        return "lock_timeout"
    return "done_elsewhere"
