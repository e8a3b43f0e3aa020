"""`POST /v1/events` and `GET /v1/events/{key}`: accept an event durably, read a key's state.

Nothing is published from a request: a 2xx means the key, the event and its outbox row are
committed together, and the relay takes it from there. The receiver's app calls the POST handler
ahead of the framework (outbox/ingest/fastpath.py); the router declares it for OpenAPI and for
requests the shortcut does not take.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.core import contract, keys
from outbox.core.access import FailureThrottle, require_token_or_loopback
from outbox.core.jsonbody import parse_json
from outbox.core.problems import Problem, field_errors, json_response, problem_responses
from outbox.core.routes import RouteTable
from outbox.core.settings import Settings
from outbox.core.timewindow import iso
from outbox.ingest import admission, fanout, intake, lanes
from outbox.ingest.answers import delivery_view, respond
from outbox.ingest.envelope import Envelope
from outbox.ingest.fastpath import EVENTS_PATH, read_body
from outbox.ingest.metrics import EventCounters
from outbox.ingest.signatures import Signer
from outbox.store.attempts import attempts_of_async

ENVELOPE_SCHEMA = Envelope.model_json_schema()

EventHandler = Callable[[Request], Awaitable[JSONResponse]]


def event_ingest(
    settings: Settings,
    routes: RouteTable,
    signers: dict[str, Signer],
    engine: Callable[[], AsyncEngine],
    database: Callable[[Any], Any],
    metrics: EventCounters,
) -> EventHandler:
    """The envelope endpoint's handler; `database(awaitable)` maps an outage to a 503."""

    async def post_event(request: Request) -> JSONResponse:
        """Store an event once; repeats get the first answer (`Idempotent-Replayed: true`)."""
        body = await read_body(request, settings.max_body_bytes)
        envelope = _parse_envelope(body)
        header_key = request.headers.get("idempotency-key")
        signer = signers.get(envelope.normalized_source)
        if signer is not None:
            verified = signer.verify(request.headers, body, idempotency_key=header_key)
            if header_key is not None and not verified.covers_key:
                raise Problem(
                    400,
                    "unsigned_idempotency_key",
                    "The signature does not cover the Idempotency-Key header: sign with v2 "
                    "(<timestamp>.<idempotency-key>.<body>) or send no key. Nothing was stored.",
                )
        elif settings.require_signed_webhooks:
            raise Problem(
                401,
                "unknown_source",
                "This source has no signing secret and unsigned events are refused. "
                "Nothing was stored.",
            )
        event_type = envelope.normalized_event_type
        route = admission.route_for(routes, envelope.normalized_source, event_type)
        if header_key is not None:
            try:
                client_key = keys.validate_client_key(header_key)
            except keys.InvalidKey as error:
                raise Problem(400, "invalid_idempotency_key", str(error)) from error
            # Inside the sender's namespace: no source can occupy another's keys.
            key = keys.scoped_client_key(envelope.normalized_source, client_key)
        else:
            key = envelope.derived_key(fold_external_id_case=route.fold_external_id_case)
        version = None if envelope.version is None else str(envelope.version)
        where = lanes.place(
            route,
            envelope.payload,
            str(envelope.external_id),
            version,
            source=envelope.normalized_source,
            shared=route.sources is not None,
        )
        event = intake.NewEvent(
            key=key,
            payload_hash=envelope.payload_hash(fold_external_id_case=route.fold_external_id_case),
            correlation_id=envelope.correlation_id or uuid.uuid4().hex,
            source=envelope.normalized_source,
            event_type=event_type,
            external_id=str(envelope.external_id),
            version=version,
            payload_json=envelope.payload_json,
            route=route.label,
            ttl_seconds=route.ttl_seconds,
            workflow_name=envelope.workflow,
            execution_id=None if envelope.execution_id is None else str(envelope.execution_id),
            contract_violations=tuple(contract.violations(route, envelope.payload)),
            lane=None if where is None else where.lane,
            lane_rank=None if where is None else where.rank,
            deliveries=fanout.plan(
                routes,
                route,
                key,
                envelope.payload,
                str(envelope.external_id),
                version,
                envelope.normalized_source,
            ),
        )
        outcome = await database(intake.accept(engine(), event))
        return respond(outcome, event, metrics)

    return post_event


def events_router(
    handler: EventHandler,
    settings: Settings,
    routes: RouteTable,
    engine: Callable[[], AsyncEngine],
    database: Callable[[Any], Any],
    throttle: FailureThrottle,
) -> APIRouter:
    """The event endpoints as declared for OpenAPI, and the key's state for its readers."""
    router = APIRouter()
    router.add_api_route(
        EVENTS_PATH,
        handler,
        methods=["POST"],
        status_code=202,
        responses={
            200: json_response("A repeat of a finished event: the first answer"),
            202: json_response("Accepted (new), or a repeat of an event still in flight"),
            **problem_responses(400, 401, 403, 413, 422, 503),
        },
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ENVELOPE_SCHEMA}},
            },
            "parameters": [
                {
                    "name": "Idempotency-Key",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                }
            ],
        },
    )

    @router.get(
        "/v1/events/{key:path}/attempts", responses=problem_responses(401, 403, 404, 429, 503)
    )
    async def get_event_attempts(key: str, request: Request) -> JSONResponse:
        """The key's attempt log, oldest first (the newest 50): when, how long, the outcome,
        the downstream's status code, the error code and detail, worker and fence. Same access
        as the key's state. (Registered first: a key's own path may contain slashes.)"""
        tokens = (settings.claims_token, settings.operator_token)
        require_token_or_loopback(request, tokens, throttle, "claims")
        if await database(intake.get_key(engine(), key)) is None:
            raise Problem(404, "key_not_found", "No event is stored under this key.")
        found = await database(attempts_of_async(engine(), key))
        return JSONResponse({"key": key, "attempts": found})

    @router.get("/v1/events/{key:path}", responses=problem_responses(401, 403, 404, 422, 429, 503))
    async def get_event(key: str, request: Request) -> JSONResponse:
        """The state of one key: status, attempts, result, external_ref, error_code, times;
        `lane` for a key of an ordered route, `superseded_by` for a superseded one. A fan-out
        event lists its `deliveries` (each one's own state) and its status is theirs; a
        delivery names its `event_key` and `destination`.

        The stored result is the downstream's answer: only holders of the claims or operator
        token (or, with neither configured, clients on this machine) may read it.
        """
        tokens = (settings.claims_token, settings.operator_token)
        require_token_or_loopback(request, tokens, throttle, "claims")
        row = await database(intake.get_key(engine(), key, _destination_order(routes)))
        if row is None:
            raise Problem(404, "key_not_found", "No event is stored under this key.")
        # Only keys of an ordered route have a lane; only superseded keys a superseding version;
        # only deliveries an event and a destination.
        named = ("lane", "superseded_by", "event_key", "destination")
        extra: dict[str, Any] = {name: row[name] for name in named if row[name] is not None}
        if "deliveries" in row:
            extra["deliveries"] = [delivery_view(d) for d in row["deliveries"]]
        return JSONResponse(
            {
                "key": row["idempotency_key"],
                "status": row["status"],
                "attempts": row["attempts"],
                "result": row["result"],
                "external_ref": row["external_ref"],
                "error_code": row["error_code"],
                "uncertain": row["uncertain"],
                "correlation_id": row["correlation_id"],
                "source": row["source"],
                "event_type": row["event_type"],
                "duplicate_count": row["duplicate_count"],
                "created_at": iso(row["created_at"]),
                "updated_at": iso(row["updated_at"]),
                "next_attempt_at": iso(row["next_attempt_at"]),
                "expires_at": iso(row["expires_at"]),
                **extra,
            }
        )

    return router


def _destination_order(routes: RouteTable) -> list[str]:
    """Destinations in the order fan-out routes name them, so an event's deliveries are listed
    as its route lists them (the route is not known before the key is read)."""
    return list(dict.fromkeys(name for route in routes.routes for name in route.fan_out or ()))


def _parse_envelope(body: bytes) -> Envelope:
    try:
        document = parse_json(body)
    except keys.NumberOutOfRange as error:
        raise Problem(
            422,
            "invalid_envelope",
            "The event envelope is malformed.",
            errors=[{"field": "(body)", "message": str(error), "type": "number_out_of_range"}],
        ) from error
    try:
        return Envelope.model_validate(document)
    except ValidationError as error:
        raise Problem(
            422, "invalid_envelope", "The event envelope is malformed.", errors=field_errors(error)
        ) from error
