"""The claims API's store: a workflow claims a key, acts itself, then completes or fails it.

Same table, same states, same statements and the same fence as the gateway's worker
(`outbox.store.lifecycle`), with one difference decided when the key is created: a key created here
belongs to the workflow (`actor = 'workflow'`), and a key created by an event belongs to the
worker. Neither side can claim, finish or re-drive the other's keys.

The lease token a caller gets is `<fence>.<128 random bits>`: both parts are checked in the same
WHERE of every later write, so a stale holder, or someone who knows only the number, changes
nothing (`outbox.claims.finish` ends a claim). Each function ends in one closed outcome; each
statement it sends is one atomic step, committed by itself (the receiver's engine is in
autocommit), and `claim` handles a key purged between its statements.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox.claims import lanes
from outbox.claims.finish import attempt_log
from outbox.store import lanes as lanes_store
from outbox.store import lifecycle


@dataclass(frozen=True)
class Claimed:
    lease_token: str
    locked_until: datetime
    correlation_id: str
    attempt: int
    # The previous holder's lease expired: it may have acted.
    reclaimed: bool
    # An earlier attempt may have had its effect: look it up before acting.
    uncertain: bool
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
class NotAClaimKey:
    """The key was created by an event: the gateway's worker acts on it, not a workflow."""


@dataclass(frozen=True)
class Finished:
    """The key ended without success (failed_final or quarantined): an operator decides."""

    status: str
    error_code: str | None


@dataclass(frozen=True)
class LaneBusy:
    """Another claim holds the key's lane: the key is given back (pending), claim it again."""

    retry_after: int


@dataclass(frozen=True)
class Superseded:
    """A newer version of the lane was applied, or waits or runs: this one never acts."""

    superseded_by: str
    correlation_id: str


ClaimOutcome = (
    Claimed
    | AlreadySucceeded
    | InProgress
    | PayloadMismatch
    | NotAClaimKey
    | Finished
    | LaneBusy
    | Superseded
)


def _lease_token(fence: int, token: str) -> str:
    return f"{fence}.{token}"


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
    lane: str | None = None,
    version: lanes.Version | None = None,
    in_flight_seconds: float = 0.0,
) -> ClaimOutcome:
    """Claim `key` for this caller, or say why not. A key with a lane then passes the lane
    step: it goes, waits (given back), or is superseded. `in_flight_seconds`: how long after
    the lease a request of the holder may still land; nobody claims the key before then."""
    token = lifecycle.new_lease_token()
    rank = None if version is None else version.rank
    async with engine.begin() as conn:
        created = (
            (
                await conn.execute(
                    lifecycle.CLAIM_NEW_KEY,
                    {
                        "key": key,
                        "token": token,
                        "lease_seconds": lease_seconds,
                        "in_flight_default": in_flight_seconds,
                        # A key first claimed without a payload is bound to "no payload".
                        "payload_hash": payload_hash or _NO_PAYLOAD_HASH,
                        "payload": json.dumps(payload, ensure_ascii=False, allow_nan=False),
                        "correlation_id": correlation_id,
                        "workflow": workflow,
                        "ttl_seconds": ttl_seconds,
                        "lane": lane,
                        "lane_rank": rank,
                        "version": None if version is None else version.text,
                    },
                )
            )
            .mappings()
            .first()
        )
        if created is not None:
            claimed = Claimed(
                _lease_token(created["fence"], token),
                created["locked_until"],
                created["correlation_id"],
                1,
                reclaimed=False,
                uncertain=False,
                previous_error_code=None,
            )
            return await _lane_step(conn, key, claimed, created, token, ttl_seconds, workflow)
        taken = (
            (
                await conn.execute(
                    lifecycle.CLAIM_KEY,
                    {
                        "key": key,
                        "actor": lifecycle.Actor.WORKFLOW.value,
                        "payload_hash": payload_hash,
                        "lane": lane,
                        "lane_rank": rank,
                        "token": token,
                        "owner": workflow,
                        "lease_seconds": lease_seconds,
                        "in_flight_default": in_flight_seconds,
                    },
                )
            )
            .mappings()
            .first()
        )
        if taken is not None:
            claimed = Claimed(
                _lease_token(taken["fence"], token),
                taken["locked_until"],
                taken["correlation_id"],
                taken["attempts"],
                reclaimed=taken["previous_status"] == "processing",
                uncertain=taken["uncertain"],
                previous_error_code=taken["previous_error_code"],
            )
            return await _lane_step(conn, key, claimed, taken, token, ttl_seconds, workflow)
        state = (
            (
                await conn.execute(
                    lifecycle.KEY_STATE,
                    {
                        "key": key,
                        "payload_hash": payload_hash,
                        "lane": lane,
                        "lane_rank": rank,
                        "refused_by": "claims",
                    },
                )
            )
            .mappings()
            .first()
        )
    if state is None:  # purged between the statements; the caller may simply try again
        return InProgress(retry_after=1)
    if state["actor"] != lifecycle.Actor.WORKFLOW:
        return NotAClaimKey()
    if state["payload_differs"]:
        return PayloadMismatch()
    if state["status"] == "succeeded":
        return AlreadySucceeded(state["result"], state["external_ref"], state["correlation_id"])
    if state["status"] == "superseded":
        return Superseded(state["superseded_by"], state["correlation_id"])
    if state["status"] in ("failed_final", "quarantined"):
        return Finished(state["status"], state["error_code"])
    if not state["lease_live"] and state["in_flight_remaining"]:
        # Its last holder's request may still land: asked back once it can no longer.
        return InProgress(retry_after=int(state["in_flight_remaining"]))
    return InProgress(busy_retry_after(state["lease_remaining"], state["held_seconds"]))


async def _lane_step(
    conn: AsyncConnection,
    key: str,
    claimed: Claimed,
    row: Any,
    token: str,
    ttl_seconds: float,
    workflow: str | None,
) -> ClaimOutcome:
    """The lane step of a claim just made (lane_admit, migration 0011), as the worker's
    attempt takes it: under the lane's lock, in the one call that decides and writes.

    A key with a version compares versions (`supersede`); one without only waits for the
    claim that holds its lane (`accepted`, and having no rank it never holds others back). A
    failed claim never blocks its lane (`skip`): the workflow that failed it decides what
    comes next, and a workflow told to wait may never come back. Completing or failing the
    holder hands the lane on by the migration's trigger; a workflow's parked key waits for
    its workflow's next claim, never for a delivery."""
    if row["lane"] is None:
        return claimed
    decision = (
        (
            await conn.execute(
                lanes_store.ADMIT,
                {
                    **attempt_log(None, attempt=claimed.attempt, worker=workflow),
                    "key": key,
                    "fence": row["fence"],
                    "token": token,
                    "ordering": "accepted" if row["version"] is None else "supersede",
                    "on_failure": "skip",
                    "ttl_seconds": ttl_seconds,
                },
            )
        )
        .mappings()
        .one()
    )
    match decision["decision"]:
        case "go":
            return claimed
        case "wait":
            return LaneBusy(max(1, decision["retry_after"]))
        case "superseded":
            return Superseded(decision["superseded_by"], claimed.correlation_id)
        case _:  # lost: the lease ran out between the statements and another claim took it
            return InProgress(retry_after=1)


def busy_retry_after(lease_remaining: Any, held_seconds: Any) -> int:
    """Retry-After for a key someone holds: an estimate of when its run ends, not the lease.

    A run that has lasted `held` seconds is expected to need about as long again (the longer
    it has run, the longer it tends to run), so the caller is asked back after ceil(held)
    seconds, at least 1, never past the lease's end (a holder that vanished frees the key
    then). Callers that keep asking wait about twice the run's length at worst, instead of the
    whole lease: a 5 s run under a 30 s lease is answered within about 6 s. Unknown held time
    (the key is no longer processing): the lease's remainder, as before."""
    remaining = max(1, math.ceil(float(lease_remaining or 0)))
    if held_seconds is None:
        return remaining
    return min(remaining, max(1, math.ceil(float(held_seconds))))


_NO_PAYLOAD_HASH = "no-payload"
