"""The Dedupe operation (`POST /v1/claims/dedupe`): test-and-mark a key for a time, for a
workflow that only needs "have I seen this?" and does its side effect itself, with no lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.store import dedupe as sql


@dataclass(frozen=True)
class New:
    """The key was not seen within its TTL: it is marked seen now."""


@dataclass(frozen=True)
class Seen:
    first_seen_at: datetime
    expires_at: datetime


@dataclass(frozen=True)
class OtherUse:
    """The key belongs to an event or to a claim: a Dedupe call never marks nor reads it."""

    actor: str
    status: str


DedupeOutcome = New | Seen | OtherUse


async def dedupe(
    engine: AsyncEngine,
    key: str,
    *,
    ttl_seconds: float,
    correlation_id: str,
    workflow: str | None,
) -> DedupeOutcome:
    """Test-and-mark `key` for `ttl_seconds`: New the first time (and after the TTL), Seen
    while the mark lives."""
    params = {
        "key": key,
        "ttl_seconds": ttl_seconds,
        "correlation_id": correlation_id,
        "workflow": workflow,
    }
    for _ in range(3):  # a key purged or renewed between the statements: look again
        async with engine.begin() as conn:
            if (await conn.execute(sql.DEDUPE_NEW_KEY, params)).first() is not None:
                return New()
            if (await conn.execute(sql.DEDUPE_RENEW_EXPIRED, params)).first() is not None:
                return New()
            state = (await conn.execute(sql.DEDUPE_KEY_STATE, {"key": key})).mappings().first()
        if state is None:
            continue
        if not state["is_dedupe"]:
            return OtherUse(state["actor"], state["status"])
        if state["expired"]:
            continue
        return Seen(state["created_at"], state["expires_at"])
    # Three rounds lost to purge and renewals in a row: someone else marked it just now.
    return Seen(datetime.now(UTC), datetime.now(UTC))
