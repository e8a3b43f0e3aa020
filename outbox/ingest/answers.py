"""The answer to an accepted request, the same for an envelope and a provider's webhook:
202 for a new event, the first answer for a repeat (`Idempotent-Replayed: true`), 422 for a key
reused with another payload. One log line and one metric per request."""

from __future__ import annotations

from typing import Any, assert_never

from fastapi.responses import JSONResponse

from outbox.core import fanout, keys
from outbox.core.logs import get_logger
from outbox.core.problems import Problem
from outbox.core.timewindow import iso
from outbox.ingest import intake
from outbox.ingest.metrics import EventCounters
from outbox.store.lifecycle import TERMINAL

log = get_logger(__name__)

# A repeat of a key in one of these is answered 200: its first answer will not change (the
# states' one owner lists them).
TERMINAL_STATUSES: frozenset[str] = frozenset(TERMINAL)


def respond(
    outcome: intake.Outcome,
    event: intake.NewEvent,
    metrics: EventCounters,
    *,
    repeat_status: int | None = None,
) -> JSONResponse:
    """Render `outcome`. A repeat answers 200 once the event finished and 202 while it is in
    flight, unless `repeat_status` fixes it (providers are told 200 for every repeat)."""
    key, event_type = event.key, event.event_type
    bound = log.bind(
        key=keys.mask_key(key), event_type=event_type, correlation_id=event.correlation_id
    )
    match outcome:
        case intake.Accepted():
            if outcome.status == "quarantined":
                metrics.quarantined.inc()
                bound.warning(
                    "event.quarantined",
                    transition="-> quarantined",
                    route=event.route,
                    violations=list(event.contract_violations),
                )
            else:
                metrics.accepted.labels(metrics.event_type_label(event_type)).inc()
                bound.info(
                    "event.accepted",
                    transition=f"-> {outcome.status}",
                    route=event.route,
                    **({"deliveries": len(event.deliveries)} if event.deliveries else {}),
                )
            accepted: dict[str, Any] = {
                "key": key,
                "status": "pending" if outcome.status == "fanned_out" else outcome.status,
                "duplicate": False,
                "correlation_id": outcome.correlation_id,
                "event_type": event_type,
                "created_at": outcome.created_at.isoformat(),
            }
            if outcome.status == "fanned_out":
                accepted["deliveries"] = [
                    {"destination": d.destination, "key": d.key, "status": "pending"}
                    for d in event.deliveries
                ]
            return JSONResponse(accepted, status_code=202)
        case intake.Repeated():
            metrics.duplicates.inc()
            bound.info(
                "event.duplicate",
                status=outcome.status,
                original_correlation_id=outcome.correlation_id,
            )
            finished = outcome.status in TERMINAL_STATUSES
            if outcome.deliveries:
                finished = outcome.status in fanout.FINISHED
            answer: dict[str, Any] = {
                "key": key,
                "status": outcome.status,
                "duplicate": True,
                "correlation_id": outcome.correlation_id,
                "event_type": event_type,
                "result": outcome.result,
                "external_ref": outcome.external_ref,
                "error_code": outcome.error_code,
                "attempts": outcome.attempts,
            }
            if outcome.status == "superseded":
                # Never acted on: the caller learns which version of its lane won instead.
                answer["superseded_by"] = outcome.superseded_by
            if outcome.deliveries:
                # Each destination's own answer: a caller sees which had the effect.
                answer["deliveries"] = [delivery_view(d) for d in outcome.deliveries]
            return JSONResponse(
                answer,
                status_code=repeat_status or (200 if finished else 202),
                headers={"Idempotent-Replayed": "true"},
            )
        case intake.PayloadConflict():
            metrics.conflicts.inc()
            bound.warning("event.payload_conflict")
            raise Problem(
                422,
                "idempotency_key_reused",
                "This key was first used with a different payload; nothing was changed.",
                key=key,
            )
        case _:
            assert_never(outcome)


def delivery_view(row: dict[str, Any]) -> dict[str, Any]:
    """One delivery as callers see it (a duplicate's answer, `GET /v1/events/{key}`)."""
    view = {
        "destination": row["destination"],
        "key": row["key"],
        "status": row["status"],
        "attempts": row["attempts"],
        "result": row["result"],
        "external_ref": row["external_ref"],
        "error_code": row["error_code"],
        "uncertain": row["uncertain"],
        "updated_at": iso(row["updated_at"]),
        "next_attempt_at": iso(row["next_attempt_at"]),
    }
    if row["status"] == "superseded":
        view["superseded_by"] = row["superseded_by"]
    return view
