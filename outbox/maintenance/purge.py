"""Forgetting on schedule: expired keys (with their events) and old published outbox rows.

A key's TTL comes from its route (`ttl_days`, 30 by default; `CLAIMS_TTL_DAYS` for claims
keys) and counts from the key's last change, so a workflow key retried for weeks is not
forgotten a TTL after its first claim. Purging works in bounded batches (each its own
transaction, well inside the statement timeout), so a large backlog never holds long locks and
an interrupted purge goes on at the next run. It removes finished keys and workflow keys
waiting for a claim that never came (the workflow gave up); never a key whose effect may exist
(`uncertain`: forgetting it would let the next claim answer "safe to act"), never a processing
key (a live lease, or an expired one whose holder may have acted), never a worker key still on
its way to an end (removing it would lose the event), never a key with an open dead letter.
A lane (`lanes`) goes once its time is up and none of its keys is left, a sent notice after
the outbox's retention.

The outbox's published rows mostly go a day at a time: each purge first keeps its day
partitions (`outbox.maintenance.partitions`: the next days made, the days nobody needs
dropped whole); the row-by-row prune only reaches what a drop could not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from psycopg.errors import QueryCanceled
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import OperationalError

from outbox.core.logs import get_logger
from outbox.maintenance.pace import BatchPace
from outbox.maintenance.partitions import upkeep
from outbox.store import lanes, notify
from outbox.store import maintenance as q

log = get_logger(__name__)

# Published outbox rows are kept a week: enough to answer "was it sent, and when?"
OUTBOX_RETENTION_SECONDS = 7 * 86_400
# Rows deleted per statement: small enough to keep each transaction short.
PURGE_BATCH = 1000


@dataclass(frozen=True)
class PurgeReport:
    expired_keys: int
    published_outbox_rows: int
    dry_run: bool
    # Day partitions of the outbox dropped whole (or, in a dry run, that would be), and those
    # whose day has ended but which still hold a row somebody needs.
    outbox_days_dropped: tuple[str, ...] = ()
    outbox_days_waiting: tuple[str, ...] = ()
    # The last batch's size (what `pace` came to), and whether it came back full: more may
    # be waiting.
    batch: int = PURGE_BATCH
    full: bool = False


def purge(
    engine: Engine,
    *,
    dry_run: bool,
    retention_seconds: float = OUTBOX_RETENTION_SECONDS,
    batch: int = PURGE_BATCH,
    max_batches: int | None = None,
    days: bool = True,
    pace: BatchPace | None = None,
) -> PurgeReport:
    """Count (dry run) or delete what has expired; `max_batches` bounds one call's work (the
    partitions' upkeep, a few catalog reads and index probes, comes first unless `days` is
    False: a caller that loops over batches keeps its days once). Each batch's size follows
    its time against the statement timeout (`pace`, a caller's own to keep across calls; one
    starting at `batch` otherwise)."""
    dropped: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    if days:
        kept = upkeep(engine, retention_seconds=retention_seconds, dry_run=dry_run)
        dropped, waiting = tuple(kept.dropped), tuple(kept.waiting)
    if dry_run:
        with engine.connect() as conn:
            keys = conn.execute(q.COUNT_PURGEABLE).scalar_one()
            rows = conn.execute(
                q.COUNT_PRUNABLE_OUTBOX,
                {"retention_seconds": retention_seconds, "dropping": list(dropped)},
            ).scalar_one()
        return PurgeReport(int(keys), int(rows), True, dropped, waiting, batch)
    pace = pace or BatchPace(batch)
    with engine.connect() as conn:
        timeout = conn.execute(q.STATEMENT_TIMEOUT_SECONDS).scalar_one()
    keys = rows = batches = 0
    size, full = pace.size, False
    while max_batches is None or batches < max_batches:
        size, began = pace.size, time.monotonic()
        try:
            with engine.begin() as conn:
                deleted_keys, deleted_rows = _one_batch(conn, size, retention_seconds)
        except OperationalError as error:
            # Cancelled at the statement timeout: rolled back whole, tried again smaller.
            if not isinstance(error.orig, QueryCanceled) or not pace.cancelled():
                raise
            log.warning("purge.batch_cancelled", batch=size, next_batch=pace.size)
            continue
        pace.took(time.monotonic() - began, timeout)
        keys += deleted_keys
        rows += deleted_rows
        batches += 1
        full = deleted_keys >= size or deleted_rows >= size
        if not full:
            break
    return PurgeReport(keys, rows, False, dropped, waiting, size, full)


def _one_batch(conn: Connection, size: int, retention_seconds: float) -> tuple[int, int]:
    """One transaction's work: up to `size` expired keys (with what cascades from them) and
    `size` old published outbox rows; the keys and rows it removed."""
    deleted_keys = len(conn.execute(q.PURGE_EXPIRED_KEYS, {"limit": size}).all())
    deleted_rows = len(
        conn.execute(
            q.PRUNE_PUBLISHED_OUTBOX, {"retention_seconds": retention_seconds, "limit": size}
        ).all()
    )
    # Lanes whose keys are all gone go too, and notices sent longer ago than the outbox's
    # retention; no count of their own (they are small).
    conn.execute(lanes.PURGE_IDLE_LANES, {"limit": size})
    conn.execute(notify.PURGE_SENT_NOTICES, {"retention_seconds": retention_seconds, "limit": size})
    return deleted_keys, deleted_rows
