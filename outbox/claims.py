"""The claims API's store: a workflow claims a key, acts itself, then completes or fails it.

Same table, same states and same fencing as the event path: a key claimed here and a key posted
as an event are one key. Each function ends in one closed outcome; each statement it sends is
one atomic step, committed by itself (the receiver's engine is in autocommit), and `claim`
handles a key purged between its statements.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import claim_queries as q
from outbox.redaction import redact

MAX_DETAIL_CHARS = 2048


@dataclass(frozen=True)
class Claimed:
    lease_token: str
    locked_until: datetime
    correlation_id: str
    attempt: int
    # The previous holder's lease expired: it may have acted. Reconcile before acting.
    reclaimed: bool
    previous_error_code: str | None


@dataclass(frozen=True)
class AlreadySucceeded:
    result: Any
    external_ref: str | None
    correlation_id: str


@dataclass(frozen=True)
class InProgress:
    retry_after: int


@dataclass(frozen=True)
class PayloadMismatch:
    pass


@dataclass(frozen=True)
class Finished:
    """The key ended without success (failed_final or quarantined): an operator decides."""

    status: str
    error_code: str | None


ClaimOutcome = Claimed | AlreadySucceeded | InProgress | PayloadMismatch | Finished


async def claim(
    engine: AsyncEngine,
    key: str,
    *,
    payload_hash: str | None,
    payload: Any,
    correlation_id: str,
    workflow: str | None,
    lease_seconds: float,
    ttl_seconds: float,
) -> ClaimOutcome:
    """Claim `key` for this caller, or say why not."""
    token = secrets.token_urlsafe(24)
    params = {
        "key": key,
        "payload_hash": payload_hash,
        "token": token,
        "lease_seconds": lease_seconds,
    }
    async with engine.begin() as conn:
        created = (
            (
                await conn.execute(
                    q.CLAIM_NEW_KEY,
                    {
                        **params,
                        # A key first claimed without a payload is bound to "no payload".
                        "payload_hash": payload_hash or _NO_PAYLOAD_HASH,
                        "payload": json.dumps(payload, ensure_ascii=False, allow_nan=False),
                        "correlation_id": correlation_id,
                        "workflow": workflow,
                        "ttl_seconds": ttl_seconds,
                    },
                )
            )
            .mappings()
            .first()
        )
        if created is not None:
            return Claimed(
                token,
                created["locked_until"],
                created["correlation_id"],
                1,
                reclaimed=False,
                previous_error_code=None,
            )
        taken = (await conn.execute(q.CLAIM_KEY, params)).mappings().first()
        if taken is not None:
            return Claimed(
                token,
                taken["locked_until"],
                taken["correlation_id"],
                taken["attempts"],
                reclaimed=taken["previous_status"] == "processing",
                previous_error_code=taken["error_code"],
            )
        state = (
            (await conn.execute(q.KEY_STATE, {"key": key, "payload_hash": payload_hash}))
            .mappings()
            .first()
        )
    if state is None:  # purged between the statements; the caller may simply try again
        return InProgress(retry_after=1)
    if state["payload_differs"]:
        return PayloadMismatch()
    if state["status"] == "succeeded":
        return AlreadySucceeded(state["result"], state["external_ref"], state["correlation_id"])
    if state["status"] in ("failed_final", "quarantined"):
        return Finished(state["status"], state["error_code"])
    return InProgress(retry_after=max(1, int(state["lease_remaining"] or 1)))


async def heartbeat(
    engine: AsyncEngine, key: str, token: str, lease_seconds: float
) -> datetime | None:
    """Extend the lease; None when the token no longer holds the key."""
    async with engine.begin() as conn:
        value: datetime | None = (
            await conn.execute(
                q.HEARTBEAT, {"key": key, "token": token, "lease_seconds": lease_seconds}
            )
        ).scalar()
    return value


async def complete(
    engine: AsyncEngine, key: str, token: str, result: Any, external_ref: str | None
) -> bool:
    """Record success; False when the token no longer holds the key."""
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                q.COMPLETE,
                {
                    "key": key,
                    "token": token,
                    "external_ref": external_ref,
                    "result": json.dumps(result, ensure_ascii=False, allow_nan=False),
                },
            )
        ).first()
    return row is not None


async def fail(
    engine: AsyncEngine,
    key: str,
    token: str,
    *,
    error_code: str,
    retryable: bool,
    detail: str,
) -> bool:
    """Record a failure (a dead letter when not retryable); False for a stale token."""
    statement = q.FAIL_RETRYABLE if retryable else q.FAIL_FINAL
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                statement,
                {
                    "key": key,
                    "token": token,
                    "error_code": error_code,
                    "detail": redact(detail)[:MAX_DETAIL_CHARS],
                },
            )
        ).first()
    return row is not None


_NO_PAYLOAD_HASH = "no-payload"
