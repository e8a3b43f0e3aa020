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

from dataclasses import dataclass

from sqlalchemy import Engine

from outbox.maintenance.partitions import upkeep
from outbox.store import lanes, notify
from outbox.store import maintenance as q

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


def purge(
    engine: Engine,
    *,
    dry_run: bool,
    retention_seconds: float = OUTBOX_RETENTION_SECONDS,
    batch: int = PURGE_BATCH,
    max_batches: int | None = None,
    days: bool = True,
) -> PurgeReport:
    """Count (dry run) or delete what has expired; `max_batches` bounds one call's work (the
    partitions' upkeep, a few catalog reads and index probes, comes first unless `days` is
    False: a caller that loops over batches keeps its days once)."""
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
        return PurgeReport(int(keys), int(rows), True, dropped, waiting)
    keys = rows = 0
    batches = 0
    while max_batches is None or batches < max_batches:
        with engine.begin() as conn:
            deleted_keys = len(conn.execute(q.PURGE_EXPIRED_KEYS, {"limit": batch}).all())
            deleted_rows = len(
                conn.execute(
                    q.PRUNE_PUBLISHED_OUTBOX,
                    {"retention_seconds": retention_seconds, "limit": batch},
                ).all()
            )
            # Lanes whose keys are all gone go too, and notices sent longer ago than the
            # outbox's retention; no count of their own (they are small).
            conn.execute(lanes.PURGE_IDLE_LANES, {"limit": batch})
            conn.execute(
                notify.PURGE_SENT_NOTICES,
                {"retention_seconds": retention_seconds, "limit": batch},
            )
        keys += deleted_keys
        rows += deleted_rows
        batches += 1
        if deleted_keys < batch and deleted_rows < batch:
            break
    return PurgeReport(keys, rows, False, dropped, waiting)
