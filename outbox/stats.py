"""What an operator (or Prometheus) asks first: how many keys in which state, how far behind."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from outbox import keys, routestate
from outbox import operator_queries as q
from outbox.timewindow import iso

STATUSES = ("pending", "processing", "succeeded", "failed_retryable", "failed_final", "quarantined")
DEAD_LETTER_KINDS = ("permanent", "retries_exhausted", "quarantined")


def collect(engine: Engine) -> dict[str, Any]:
    """Keys by status, outbox backlog and lag, processing age, open dead letters, duplicates."""
    with engine.connect() as conn:
        by_status = {r.status: r for r in conn.execute(q.STATS_KEYS)}
        outbox = conn.execute(q.STATS_OUTBOX).one()
        processing = conn.execute(q.STATS_PROCESSING).one()
        open_dead = {r.kind: r.open for r in conn.execute(q.STATS_DEAD_LETTERS)}
    return {
        "keys_by_status": {s: int(by_status[s].keys) if s in by_status else 0 for s in STATUSES},
        "outbox": {
            "due": int(outbox.due),
            "unpublished": int(outbox.unpublished),
            "oldest_due_age_seconds": round(float(outbox.oldest_due_age), 3),
        },
        "processing": {
            "count": int(processing.processing),
            "oldest_age_seconds": round(float(processing.oldest_age), 3),
            "lease_expired": int(processing.lease_expired),
        },
        "open_dead_letters": {k: int(open_dead.get(k, 0)) for k in DEAD_LETTER_KINDS},
        "duplicates_blocked": {
            "receiver": sum(int(r.duplicates) for r in by_status.values()),
            "worker": sum(int(r.blocked) for r in by_status.values()),
        },
        "leases_reclaimed": sum(int(r.reclaimed) for r in by_status.values()),
        # Routes whose keys wait on them: paused, or a circuit not closed.
        "routes": routestate.held_routes(engine),
    }


def waiting_on_routes(engine: Engine) -> dict[str, int]:
    """Keys that wait on a paused route or an open circuit (not stuck: held on purpose)."""
    return {name: route["backlog"] for name, route in routestate.held_routes(engine).items()}


def stuck(engine: Engine, older_than_seconds: float, limit: int = 100) -> list[dict[str, Any]]:
    """Unfinished keys untouched for longer than `older_than_seconds` (a retry not yet due is
    not stuck, nor is a key that waits on a paused route or an open circuit)."""
    with engine.connect() as conn:
        rows = (
            conn.execute(q.STUCK_KEYS, {"older_than_seconds": older_than_seconds, "limit": limit})
            .mappings()
            .all()
        )
    return [
        {
            "key": keys.mask_key(r["idempotency_key"]),
            "status": r["status"],
            "event_type": r["event_type"],
            "attempts": r["attempts"],
            "updated_at": iso(r["updated_at"]),
            "age_seconds": round(float(r["age_seconds"]), 1),
        }
        for r in rows
    ]
