"""The worker's side of the key store: claim, renew, and finish under the fence.

Each method is one short transaction running one statement from `outbox.queries`, so no
transaction is ever open across an external call. Every write after the claim names the fence
and reports whether a row matched; a holder whose lease was taken over changes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine

from outbox import queries
from outbox.intake import PROCESS_TASK
from outbox.redaction import redact

# Error details are for people reading a dead letter, not a place to keep response bodies.
MAX_DETAIL_CHARS = 2048


@dataclass(frozen=True)
class Claim:
    """A key this worker now holds, with the event to act on."""

    key: str
    fence: int
    attempt: int
    correlation_id: str
    route: str
    source: str
    event_type: str
    external_id: str
    version: str | None
    payload: dict[str, Any]
    locked_until: datetime
    claimed_at: datetime
    first_failed_at: datetime | None
    previous_status: str
    previous_error_code: str | None


@dataclass(frozen=True)
class Blocked:
    """A delivery that found the key finished, held, or not yet due."""

    status: str | None
    lease_live: bool


class KeyStore:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        """Take the key with a fresh lease and fence, or say why not (counted as blocked)."""
        with self.engine.begin() as conn:
            row = (
                conn.execute(
                    queries.CLAIM_KEY, {"key": key, "owner": owner, "lease_seconds": lease_seconds}
                )
                .mappings()
                .first()
            )
            if row is not None:
                return Claim(
                    key=key,
                    fence=row["fence"],
                    attempt=row["attempts"],
                    correlation_id=row["correlation_id"],
                    route=row["route"],
                    source=row["source"],
                    event_type=row["event_type"],
                    external_id=row["external_id"],
                    version=row["version"],
                    payload=row["payload"],
                    locked_until=row["locked_until"],
                    claimed_at=row["claimed_at"],
                    first_failed_at=row["first_failed_at"],
                    previous_status=row["previous_status"],
                    previous_error_code=row["previous_error_code"],
                )
            blocked = conn.execute(queries.RECORD_BLOCKED_DELIVERY, {"key": key}).first()
        if blocked is None:
            return Blocked(status=None, lease_live=False)
        return Blocked(status=blocked.status, lease_live=bool(blocked.lease_live))

    def renew(self, key: str, fence: int, lease_seconds: float) -> datetime | None:
        """Extend the lease; None means it is lost (another holder has a newer fence)."""
        with self.engine.begin() as conn:
            value: datetime | None = conn.execute(
                queries.RENEW_LEASE, {"key": key, "fence": fence, "lease_seconds": lease_seconds}
            ).scalar()
        return value

    def succeed(self, key: str, fence: int, result: Any, external_ref: str | None) -> bool:
        """Record the result; False when the fence rejected the write."""
        with self.engine.begin() as conn:
            row = conn.execute(
                queries.FINISH_SUCCEEDED,
                {
                    "key": key,
                    "fence": fence,
                    "result": json.dumps(result, ensure_ascii=False, allow_nan=False),
                    "external_ref": external_ref,
                },
            ).first()
        return row is not None

    def schedule_retry(
        self, key: str, fence: int, delay_seconds: float, error_code: str, detail: str
    ) -> bool:
        """Mark failed_retryable and queue the next attempt in the outbox, atomically."""
        with self.engine.begin() as conn:
            row = conn.execute(
                queries.SCHEDULE_RETRY,
                {
                    "key": key,
                    "fence": fence,
                    "delay_seconds": delay_seconds,
                    "error_code": error_code,
                    "error_detail": redact(detail)[:MAX_DETAIL_CHARS],
                    "task_name": PROCESS_TASK,
                },
            ).first()
        return row is not None

    def fail_final(self, key: str, fence: int, kind: str, error_code: str, detail: str) -> bool:
        """Mark failed_final (quarantined for a contract failure) and write the dead letter,
        atomically."""
        with self.engine.begin() as conn:
            row = conn.execute(
                queries.FAIL_FINAL,
                {
                    "key": key,
                    "fence": fence,
                    "kind": kind,
                    "final_status": "quarantined" if kind == "quarantined" else "failed_final",
                    "error_code": error_code,
                    "error_detail": redact(detail)[:MAX_DETAIL_CHARS],
                },
            ).first()
        return row is not None
