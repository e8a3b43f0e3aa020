"""The worker's side of the key store: claim, renew, and finish under the fence.

Each step is ONE statement from `outbox.queries`, atomic by itself, sent in autocommit: no
transaction is ever open across an external call, and a step costs one round trip instead of
four (pre-ping, BEGIN, statement, COMMIT). Every write after the claim names the fence and
reports whether a row matched; a holder whose lease was taken over changes nothing.

A statement that meets a connection the server has dropped (PostgreSQL restarted, an idle
connection cut) is sent once more on a fresh one. That is safe for every step: a repeated claim
of a key this worker already took finds its lease live and is blocked (the sweeper re-drives it
when the lease runs out), and a repeated fenced write matches no row once the first one landed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, RowMapping, TextClause
from sqlalchemy.exc import DBAPIError

from outbox import queries
from outbox.intake import PROCESS_TASK
from outbox.logs import get_logger
from outbox.redaction import redact

# Error details are for people reading a dead letter, not a place to keep response bodies.
MAX_DETAIL_CHARS = 2048

log = get_logger(__name__)


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
        # The worker's engine is in autocommit (`create_sync_engine(autocommit=True)`): then
        # `begin()` adds no round trip. On any other engine each step is its own transaction.
        self.engine = engine

    def _one(self, statement: TextClause, params: dict[str, Any]) -> RowMapping | None:
        """Run one statement; its first row, or None when it matched nothing."""
        for attempt in (1, 2):
            try:
                with self.engine.begin() as conn:
                    return conn.execute(statement, params).mappings().first()
            except DBAPIError as error:
                if attempt == 2 or not error.connection_invalidated:
                    raise
                log.warning("store.reconnect", error=type(error.orig).__name__)
        raise AssertionError("unreachable")

    def claim(self, key: str, owner: str, lease_seconds: float) -> Claim | Blocked:
        """Take the key with a fresh lease and fence, or say why not (counted as blocked)."""
        row = self._one(
            queries.CLAIM_KEY, {"key": key, "owner": owner, "lease_seconds": lease_seconds}
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
        blocked = self._one(queries.RECORD_BLOCKED_DELIVERY, {"key": key})
        if blocked is None:
            return Blocked(status=None, lease_live=False)
        return Blocked(status=blocked["status"], lease_live=bool(blocked["lease_live"]))

    def renew(self, key: str, fence: int, lease_seconds: float) -> datetime | None:
        """Extend the lease; None means it is lost (another holder has a newer fence)."""
        row = self._one(
            queries.RENEW_LEASE, {"key": key, "fence": fence, "lease_seconds": lease_seconds}
        )
        return None if row is None else row["locked_until"]

    def succeed(self, key: str, fence: int, result: Any, external_ref: str | None) -> bool:
        """Record the result; False when the fence rejected the write."""
        row = self._one(
            queries.FINISH_SUCCEEDED,
            {
                "key": key,
                "fence": fence,
                "result": json.dumps(result, ensure_ascii=False, allow_nan=False),
                "external_ref": external_ref,
            },
        )
        return row is not None

    def schedule_retry(
        self, key: str, fence: int, delay_seconds: float, error_code: str, detail: str
    ) -> bool:
        """Mark failed_retryable and queue the next attempt in the outbox, atomically."""
        row = self._one(
            queries.SCHEDULE_RETRY,
            {
                "key": key,
                "fence": fence,
                "delay_seconds": delay_seconds,
                "error_code": error_code,
                "error_detail": redact(detail)[:MAX_DETAIL_CHARS],
                "task_name": PROCESS_TASK,
            },
        )
        return row is not None

    def fail_final(self, key: str, fence: int, kind: str, error_code: str, detail: str) -> bool:
        """Mark failed_final (quarantined for a contract failure) and write the dead letter,
        atomically."""
        row = self._one(
            queries.FAIL_FINAL,
            {
                "key": key,
                "fence": fence,
                "kind": kind,
                "final_status": "quarantined" if kind == "quarantined" else "failed_final",
                "error_code": error_code,
                "error_detail": redact(detail)[:MAX_DETAIL_CHARS],
            },
        )
        return row is not None
