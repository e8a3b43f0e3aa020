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
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine

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


def purge(
    engine: Engine,
    *,
    dry_run: bool,
    retention_seconds: float = OUTBOX_RETENTION_SECONDS,
    batch: int = PURGE_BATCH,
    max_batches: int | None = None,
) -> PurgeReport:
    """Count (dry run) or delete what has expired; `max_batches` bounds one call's work."""
    if dry_run:
        with engine.connect() as conn:
            keys = conn.execute(q.COUNT_PURGEABLE).scalar_one()
            rows = conn.execute(
                q.COUNT_PRUNABLE_OUTBOX, {"retention_seconds": retention_seconds}
            ).scalar_one()
        return PurgeReport(int(keys), int(rows), dry_run=True)
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
    return PurgeReport(keys, rows, dry_run=False)
