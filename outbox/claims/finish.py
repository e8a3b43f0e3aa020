"""Ending a claim: heartbeat, complete and fail, each one statement under the key's fence and
the claim's token (`outbox.store.lifecycle`), so a stale holder, or someone who knows only the
fence number, changes nothing.

A complete or fail whose write matched nothing may be the same call sent again because its
answer was lost: a workflow's key keeps the token that finished it until its next claim, and
such a repeat is answered with what it recorded (`Recorded.repeated`) rather than refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core.redaction import redact
from outbox.store import attempts, lifecycle

MAX_DETAIL_CHARS = 2048
# What a workflow says of the effect when it fails: `none` only when it knows nothing was done.
Effect = Literal["none", "unknown"]


def _parse_lease_token(lease_token: str) -> tuple[int, str] | None:
    fence, _, token = lease_token.partition(".")
    if not fence.isdigit() or len(fence) > 18 or not token:
        return None
    return int(fence), token


async def _fenced(
    engine: AsyncEngine, statement: Any, key: str, lease_token: str, params: dict[str, Any]
) -> Any:
    """Run a write that names the key's fence and token; its first row, None when stale."""
    parsed = _parse_lease_token(lease_token)
    if parsed is None:
        return None
    fence, token = parsed
    async with engine.begin() as conn:
        return (
            (await conn.execute(statement, {"key": key, "fence": fence, "token": token, **params}))
            .mappings()
            .first()
        )


async def heartbeat(
    engine: AsyncEngine, key: str, lease_token: str, lease_seconds: float
) -> datetime | None:
    """Extend the lease; None when the token no longer holds the key."""
    row = await _fenced(
        engine, lifecycle.RENEW_LEASE, key, lease_token, {"lease_seconds": lease_seconds}
    )
    return None if row is None else row["locked_until"]


@dataclass(frozen=True)
class Recorded:
    """What a complete or fail left on the key; `repeated`: recorded by an earlier call with
    the same token (this one's answer was lost), and this call changed nothing."""

    status: str
    external_ref: str | None = None
    repeated: bool = False


async def _finished_by(
    engine: AsyncEngine, key: str, lease_token: str, expected: str
) -> Recorded | None:
    """A fenced write that matched nothing: was it this token's own earlier call? Confirmed
    only when the key still holds that token and the outcome this call asks for; anything else
    (another holder since, a different outcome) is a stale token's call (None)."""
    row = await _fenced(engine, lifecycle.FINISHED_BY, key, lease_token, {})
    if row is None or row["status"] != expected:
        return None
    return Recorded(row["status"], row["external_ref"], repeated=True)


async def complete(
    engine: AsyncEngine, key: str, lease_token: str, result: Any, external_ref: str | None
) -> Recorded | None:
    """Record success; None when the token no longer holds the key and did not finish it."""
    row = await _fenced(
        engine,
        lifecycle.SUCCEED,
        key,
        lease_token,
        {
            **attempt_log("completed"),
            "external_ref": external_ref,
            "result": json.dumps(result, ensure_ascii=False, allow_nan=False),
        },
    )
    if row is None:
        return await _finished_by(engine, key, lease_token, "succeeded")
    return Recorded("succeeded", external_ref)


async def fail(
    engine: AsyncEngine,
    key: str,
    lease_token: str,
    *,
    error_code: str,
    retryable: bool,
    detail: str,
    effect: Effect,
    in_flight_seconds: float = 0.0,
) -> Recorded | None:
    """Record a failure (a dead letter when not retryable); None for a stale token.

    Unless the workflow says the effect is absent, the key becomes uncertain: the next claim
    answers `uncertain: true` and the workflow looks before acting again, once its request
    can no longer land (`in_flight_seconds`, the in-flight rule).
    """
    params: dict[str, Any] = {
        **attempt_log("failed", error_code=error_code, detail=redact(detail)),
        "error_code": error_code,
        "error_detail": redact(detail)[:MAX_DETAIL_CHARS],
        "uncertain": effect == "unknown",
        "reconciled_absent": False,
        "in_flight_seconds": in_flight_seconds if effect == "unknown" else 0.0,
    }
    if retryable:
        statement, status = lifecycle.SCHEDULE_RETRY, "failed_retryable"
        params.update(delay_seconds=0, task_name="")
    else:
        statement, status = lifecycle.FAIL_FINAL, "failed_final"
        params.update(kind="permanent", final_status=status)
    row = await _fenced(engine, statement, key, lease_token, params)
    if row is None:
        return await _finished_by(engine, key, lease_token, status)
    return Recorded(status)


def attempt_log(
    outcome: str | None,
    *,
    attempt: int | None = None,
    worker: str | None = None,
    error_code: str | None = None,
    detail: str | None = None,
) -> dict[str, Any]:
    """The attempt log's parameters (`outbox.store.attempts`): a complete or fail starts at
    its claim's row, counts as the key's current attempt, and names the claim's workflow."""
    return {
        "attempt": attempt,
        "started_at": None,
        "worker": worker,
        "outcome": outcome,
        "reconciled": None,
        "status_code": None,
        "log_error_code": error_code,
        "log_detail": None if detail is None else detail[: attempts.DETAIL_CHARS],
    }
