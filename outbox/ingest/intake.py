"""Accepting an event: the receiver's store. One statement per request, one closed outcome.

The request is a small state machine (see rocket-rides-atomic): one statement reserves the key
with the event and its outbox row, or counts a repeat of the same payload and returns the key's
state; only when it returns nothing does a second look tell a payload conflict from a key purged
in between (then the loop tries again). The receiver's engine commits each statement by itself
(`create_receiver_engine`), so a new event costs one round trip, and goes to the driver
directly (`outbox.store.driven`), so it costs the receiver little more CPU than the statement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core import fanout, tracing
from outbox.core.wire import PROCESS_TASK
from outbox.ingest import wakeup
from outbox.ingest.fanout import Delivery
from outbox.store import ingest as sql
from outbox.store.driven import Driven, driven


@dataclass(frozen=True)
class NewEvent:
    key: str
    payload_hash: str
    correlation_id: str
    source: str
    event_type: str
    external_id: str
    version: str | None
    # The payload's JSON text (canonical: the same text its hash was taken over).
    payload_json: str
    route: str
    ttl_seconds: float
    workflow_name: str | None
    execution_id: str | None
    # Why the event breaks its route's contract; empty when it keeps it.
    contract_violations: tuple[str, ...] = ()
    # Its lane on a route with `order_by` (outbox.ingest.lanes), and its rank there when the
    # route compares versions (None: the database numbers it in order of acceptance).
    lane: str | None = None
    lane_rank: int | None = None
    # On a fan-out route, one per destination (outbox.ingest.fanout); else empty.
    deliveries: tuple[Delivery, ...] = ()


@dataclass(frozen=True)
class Accepted:
    """The key was new: event and outbox row are committed."""

    key: str
    correlation_id: str
    created_at: datetime
    status: str


@dataclass(frozen=True)
class Repeated:
    """The key was known with the same payload: the caller gets its current state."""

    key: str
    status: str
    correlation_id: str
    result: Any
    external_ref: str | None
    error_code: str | None
    attempts: int
    # The version that superseded the event (status `superseded`), else None.
    superseded_by: str | None = None
    # A fan-out event's deliveries (its status is theirs, outbox.core.fanout); else empty.
    deliveries: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class PayloadConflict:
    """The key was known with another payload: nothing changed."""

    key: str


Outcome = Accepted | Repeated | PayloadConflict


async def accept(engine: AsyncEngine, event: NewEvent) -> Outcome:
    """Store a new event atomically, or describe the existing key."""
    params: dict[str, Any] = {
        "key": event.key,
        "payload_hash": event.payload_hash,
        "correlation_id": event.correlation_id,
        "source": event.source,
        "event_type": event.event_type,
        "external_id": event.external_id,
        "version": event.version,
        "payload": event.payload_json,
        "route": event.route,
        "ttl_seconds": event.ttl_seconds,
        "workflow_name": event.workflow_name,
        "execution_id": event.execution_id,
        "task_name": PROCESS_TASK,
        "lane": event.lane,
        "lane_rank": event.lane_rank,
        # The request's span (tracing on), under which the relay and every attempt go on.
        "trace_context": tracing.context_to_store(),
    }
    reserve = sql.RESERVE_KEY
    if event.deliveries:
        reserve = sql.RESERVE_FANNED_OUT
        params.update(_deliveries_params(event.deliveries))
    if event.contract_violations:
        reserve = sql.RESERVE_KEY_QUARANTINED
        params["error_detail"] = "; ".join(event.contract_violations)[:2048]
    # Two rounds cover the only race: the key purged between RESERVE_KEY and KEY_EXISTS.
    for _ in range(2):
        async with driven(engine) as conn:
            row = await conn.first(reserve, params)
            if row is not None and row["inserted"]:
                if reserve is not sql.RESERVE_KEY_QUARANTINED:  # its outbox row is committed
                    wakeup.of(engine).after_commit()
                return Accepted(event.key, row["correlation_id"], row["created_at"], row["status"])
            if row is not None:
                deliveries: tuple[dict[str, Any], ...] = ()
                status = row["status"]
                if status == "fanned_out":
                    deliveries = await _deliveries(conn, event.key, event.deliveries)
                    status = fanout.event_status(d["status"] for d in deliveries)
                return Repeated(
                    key=event.key,
                    status=status,
                    correlation_id=row["correlation_id"],
                    result=row["result"],
                    external_ref=row["external_ref"],
                    error_code=row["error_code"],
                    attempts=row["attempts"],
                    superseded_by=row["superseded_by"],
                    deliveries=deliveries,
                )
            if await conn.first(sql.KEY_EXISTS, {"key": event.key}) is not None:
                return PayloadConflict(event.key)
    raise RuntimeError("key vanished twice while being accepted")


async def get_key(
    engine: AsyncEngine, key: str, destinations: Sequence[str] = ()
) -> dict[str, Any] | None:
    """The public view of one key, or None. A fan-out event's carries its deliveries (in the
    order of `destinations`) and the status they make."""
    async with driven(engine) as conn:
        found = await conn.first(sql.GET_KEY, {"key": key})
        if found is None:
            return None
        if found["status"] == "fanned_out":
            found["deliveries"] = await _deliveries(conn, key, destinations)
            found["status"] = fanout.event_status(d["status"] for d in found["deliveries"])
    return found


def _deliveries_params(deliveries: Sequence[Delivery]) -> dict[str, list[Any]]:
    return {
        "delivery_keys": [d.key for d in deliveries],
        "destinations": [d.destination for d in deliveries],
        "delivery_lanes": [d.lane for d in deliveries],
        "delivery_ranks": [d.lane_rank for d in deliveries],
    }


async def _deliveries(
    conn: Driven, key: str, order: Sequence[Delivery] | Sequence[str]
) -> tuple[dict[str, Any], ...]:
    names = [d if isinstance(d, str) else d.destination for d in order]
    return tuple(await conn.all(sql.DELIVERIES_OF, {"key": key, "destinations": names}))
