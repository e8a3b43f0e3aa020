"""Dead letters for operators: list with filters and a cursor, show one, discard one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import Engine

from outbox.core import keys
from outbox.core.redaction import mask_secrets
from outbox.core.timewindow import glob_to_like, iso
from outbox.store import operate as q

MAX_PAGE = 500


@dataclass(frozen=True)
class DeadLetterFilter:
    event_type: str | None = None  # a glob
    source: str | None = None
    kind: Literal["permanent", "retries_exhausted", "quarantined"] | None = None
    # `superseded`: closed by a newer version of its lane (resolved_by "lane").
    status: Literal["open", "replayed", "discarded", "superseded"] | None = None
    since: datetime | None = None
    until: datetime | None = None
    # A fan-out route's destination: its deliveries' dead letters only.
    destination: str | None = None


def list_dead_letters(
    engine: Engine, where: DeadLetterFilter, limit: int = 50, cursor: int | None = None
) -> tuple[list[dict[str, Any]], int | None]:
    """A page of dead letters, newest first, and the cursor of the next page (None at the end)."""
    limit = max(1, min(limit, MAX_PAGE))
    with engine.connect() as conn:
        rows = (
            conn.execute(
                q.LIST_DEAD_LETTERS,
                {
                    "event_type_like": glob_to_like(where.event_type) if where.event_type else None,
                    "source": where.source,
                    "destination": where.destination,
                    "kind": where.kind,
                    "resolution": where.status,
                    "since": where.since,
                    "until": where.until,
                    "before_id": cursor,
                    "limit": limit + 1,
                },
            )
            .mappings()
            .all()
        )
    page = [_summary(dict(r)) for r in rows[:limit]]
    next_cursor = page[-1]["id"] if len(rows) > limit else None
    return page, next_cursor


def get_dead_letter(engine: Engine, dead_letter_id: int) -> dict[str, Any] | None:
    """One dead letter with the event (secrets masked), its history and the last error."""
    with engine.connect() as conn:
        row = conn.execute(q.GET_DEAD_LETTER, {"id": dead_letter_id}).mappings().first()
        if row is None:
            return None
        history = (
            conn.execute(q.DEAD_LETTER_HISTORY, {"key": row["idempotency_key"]}).mappings().all()
        )
    found = dict(row)
    return {
        **_summary(found),
        "correlation_id": found["correlation_id"],
        "external_id": found["external_id"],
        "version": found["version"],
        "payload": mask_secrets(found["payload"]),
        "last_error": {"error_code": found["error_code"], "detail": found["error_detail"]},
        "resolution_note": found["resolution_note"],
        "key_status": found["status"],
        "event_key": found["event_key"],
        "accepted_at": iso(found["accepted_at"]),
        "reclaimed_count": found["reclaimed_count"],
        "blocked_deliveries": found["blocked_deliveries"],
        "duplicate_count": found["duplicate_count"],
        "history": [
            {
                **dict(h),
                **{k: iso(h[k]) for k in ("first_failed_at", "last_failed_at", "resolved_at")},
            }
            for h in history
        ],
    }


def discard_dead_letter(engine: Engine, dead_letter_id: int, reason: str, by: str) -> bool:
    """Close an open dead letter without replaying it; False when it was not open."""
    with engine.begin() as conn:
        row = conn.execute(
            q.DISCARD_DEAD_LETTER, {"id": dead_letter_id, "reason": reason, "by": by}
        ).first()
    return row is not None


def _summary(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "key": row["idempotency_key"],
        "masked_key": keys.mask_key(row["idempotency_key"]),
        "kind": row["kind"],
        "error_code": row["error_code"],
        "attempts": row["attempts"],
        "source": row["source"],
        "event_type": row["event_type"],
        "route": row["route"],
        "destination": row["destination"],
        "status": row["resolution"],
        "resolved_by": row["resolved_by"],
        "first_failed_at": iso(row["first_failed_at"]),
        "last_failed_at": iso(row["last_failed_at"]),
        "resolved_at": iso(row["resolved_at"]),
        "created_at": iso(row["created_at"]),
    }
