"""`/v1/claims`: the key store for workflows that perform the side effect themselves.

An n8n HTTP Request node claims the key, acts, then completes (or fails) with the lease token.
The answers are made for an IF node: 201 claimed (`uncertain: true`: look the effect up before
acting), 200 already_succeeded (use the stored result) or superseded (a newer version of the
key's lane), 409 in_progress or lane_busy (wait Retry-After), lease_lost (stop: someone else
holds the key now) or not_a_claim_key (an event's key, which the gateway's worker acts on).
A complete or fail sent again with the same token, because its answer was lost, is answered
with the outcome the first one recorded (`repeated: true`), not lease_lost. Every endpoint
needs the CLAIMS_TOKEN bearer token; without one configured, only clients on this machine are
served (`outbox.core.access`).
"""

# No `from __future__ import annotations`: FastAPI must resolve the models at definition time.

import uuid
from collections.abc import Callable
from typing import Any, assert_never

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.claims import dedupe as marks
from outbox.claims import finish, service
from outbox.claims.requests import (
    ClaimRequest,
    CompleteRequest,
    DedupeRequest,
    FailRequest,
    HeartbeatRequest,
    KeyPath,
    lane_version,
)
from outbox.core import keys
from outbox.core.access import FailureThrottle, require_token_or_loopback
from outbox.core.jsonroute import JsonBodyRoute
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, json_response, problem_responses
from outbox.core.settings import Settings

log = get_logger(__name__)


def claims_router(
    settings: Settings,
    engine: Callable[[], AsyncEngine],
    database: Callable[[Any], Any],
    throttle: FailureThrottle,
) -> APIRouter:
    """The claims endpoints; `database(awaitable)` maps an outage to a 503."""

    if not settings.claims_token:
        log.warning(
            "receiver.claims_token_unset",
            detail="the claims API and event look-ups serve clients on this machine only;"
            " set CLAIMS_TOKEN to serve workflows elsewhere",
        )

    def authorize(request: Request) -> None:
        require_token_or_loopback(request, settings.claims_token, throttle, "claims")

    router = APIRouter(
        prefix="/v1/claims",
        tags=["claims"],
        # No lone surrogate in any string of a body, as on the events path (outbox.core.jsonbody).
        route_class=JsonBodyRoute,
        dependencies=[Depends(authorize)],
        responses={
            409: json_response(
                "in_progress or lane_busy (wait Retry-After), lease_lost, finished, or"
                " not_a_claim_key"
            ),
            **problem_responses(400, 401, 403, 413, 422, 429, 503),
        },
    )
    ttl_seconds = settings.claims_ttl_days * 86_400

    @router.post(
        "",
        status_code=201,
        responses={
            200: json_response(
                "already_succeeded: the stored result; superseded: a newer version of the lane"
            )
        },
    )
    async def claim(body: ClaimRequest) -> JSONResponse:
        """Claim a key before acting: 201 claimed, 200 already_succeeded or superseded, 409
        in_progress or lane_busy."""
        version = lane_version(body)
        correlation_id = body.correlation_id or uuid.uuid4().hex
        outcome = await database(
            service.claim(
                engine(),
                body.key,
                payload_hash=None if body.payload is None else keys.payload_hash(body.payload),
                payload=body.payload,
                correlation_id=correlation_id,
                workflow=body.workflow,
                lease_seconds=body.lease_seconds or settings.lease_seconds,
                ttl_seconds=ttl_seconds,
                lane=body.lane,
                version=version,
                in_flight_seconds=settings.claims_in_flight_seconds,
            )
        )
        bound = log.bind(key=keys.mask_key(body.key), correlation_id=correlation_id)
        match outcome:
            case service.Claimed():
                bound.info(
                    "claim.claimed",
                    reclaimed=outcome.reclaimed,
                    uncertain=outcome.uncertain,
                    attempt=outcome.attempt,
                    transition="-> processing",
                )
                return JSONResponse(
                    {
                        "status": "claimed",
                        "key": body.key,
                        "lease_token": outcome.lease_token,
                        "locked_until": outcome.locked_until.isoformat(),
                        "correlation_id": outcome.correlation_id,
                        "reclaimed": outcome.reclaimed,
                        "uncertain": outcome.uncertain,
                        "attempt": outcome.attempt,
                        "previous_error_code": outcome.previous_error_code,
                    },
                    status_code=201,
                )
            case service.AlreadySucceeded():
                bound.info("claim.already_succeeded")
                return JSONResponse(
                    {
                        "status": "already_succeeded",
                        "key": body.key,
                        "result": outcome.result,
                        "external_ref": outcome.external_ref,
                        "correlation_id": outcome.correlation_id,
                    },
                    status_code=200,
                    headers={"Idempotent-Replayed": "true"},
                )
            case service.InProgress():
                return JSONResponse(
                    {"status": "in_progress", "key": body.key, "retry_after": outcome.retry_after},
                    status_code=409,
                    headers={"Retry-After": str(outcome.retry_after)},
                )
            case service.LaneBusy():
                # No lane in the line: a lane may name a person (an e-mail address).
                bound.info("claim.lane_busy", retry_after=outcome.retry_after)
                return JSONResponse(
                    {"status": "lane_busy", "key": body.key, "retry_after": outcome.retry_after},
                    status_code=409,
                    headers={"Retry-After": str(outcome.retry_after)},
                )
            case service.Superseded():
                # Finished without acting, like already_succeeded: 200, the same answer to
                # every later claim of the key.
                bound.info("claim.superseded", transition="-> superseded")
                return JSONResponse(
                    {
                        "status": "superseded",
                        "key": body.key,
                        "superseded_by": outcome.superseded_by,
                        "correlation_id": outcome.correlation_id,
                    },
                    status_code=200,
                )
            case service.PayloadMismatch():
                raise Problem(
                    422,
                    "idempotency_key_reused",
                    "This key was first claimed with a different payload, lane or version.",
                    key=body.key,
                )
            case service.NotAClaimKey():
                raise Problem(
                    409,
                    "not_a_claim_key",
                    "This key was created by an event; the gateway's worker acts on it.",
                    key=body.key,
                )
            case service.Finished():
                return JSONResponse(
                    {"status": outcome.status, "key": body.key, "error_code": outcome.error_code},
                    status_code=409,
                )
            case _:
                assert_never(outcome)

    @router.post(
        "/dedupe",
        status_code=201,
        responses={200: json_response("seen: the key was marked within its TTL")},
    )
    async def dedupe(body: DedupeRequest) -> JSONResponse:
        """Test-and-mark a key for `ttl_seconds`: 201 `{"seen": false}` the first time, 200
        `{"seen": true, "first_seen_at": ...}` while the mark lives; no lease. 409
        `key_in_other_use` for a key an event or a claim created."""
        correlation_id = body.correlation_id or uuid.uuid4().hex
        outcome = await database(
            marks.dedupe(
                engine(),
                body.key,
                ttl_seconds=body.ttl_seconds,
                correlation_id=correlation_id,
                workflow=body.workflow,
            )
        )
        bound = log.bind(key=keys.mask_key(body.key), correlation_id=correlation_id)
        match outcome:
            case marks.New():
                bound.info("claim.dedupe_new", ttl_seconds=body.ttl_seconds)
                return JSONResponse({"seen": False, "key": body.key}, status_code=201)
            case marks.Seen():
                bound.info("claim.dedupe_seen")
                return JSONResponse(
                    {
                        "seen": True,
                        "key": body.key,
                        "first_seen_at": outcome.first_seen_at.isoformat(),
                        "expires_at": outcome.expires_at.isoformat(),
                    },
                    status_code=200,
                )
            case marks.OtherUse():
                raise Problem(
                    409,
                    "key_in_other_use",
                    "This key was created by an event or a claim, not by Dedupe; use another"
                    " key (a prefix of its own, e.g. dedupe:) for Dedupe.",
                    key=body.key,
                )
            case _:
                assert_never(outcome)

    @router.post("/{key}/heartbeat")
    async def heartbeat(key: KeyPath, body: HeartbeatRequest) -> JSONResponse:
        """Extend the lease while the side effect runs."""
        until = await database(
            finish.heartbeat(
                engine(), key, body.lease_token, body.lease_seconds or settings.lease_seconds
            )
        )
        if until is None:
            return _lease_lost(key)
        return JSONResponse({"status": "claimed", "key": key, "locked_until": until.isoformat()})

    @router.post("/{key}/complete")
    async def complete(key: KeyPath, body: CompleteRequest) -> JSONResponse:
        """Record the side effect's result; every later claim gets it back."""
        done = await database(
            finish.complete(engine(), key, body.lease_token, body.result, body.external_ref)
        )
        if done is None:
            return _lease_lost(key)
        log.info(
            "claim.completed",
            key=keys.mask_key(key),
            transition="processing -> succeeded",
            repeated=done.repeated,
        )
        return _recorded(key, done, external_ref=done.external_ref)

    @router.post("/{key}/fail")
    async def fail(key: KeyPath, body: FailRequest) -> JSONResponse:
        """Record a failure: retryable frees the key for the next claim; otherwise a dead
        letter is written for an operator."""
        done = await database(
            finish.fail(
                engine(),
                key,
                body.lease_token,
                error_code=body.error_code,
                retryable=body.retryable,
                detail=body.detail,
                effect=body.effect,
                in_flight_seconds=settings.claims_in_flight_seconds,
            )
        )
        if done is None:
            return _lease_lost(key)
        log.info(
            "claim.failed",
            key=keys.mask_key(key),
            error_code=body.error_code,
            effect=body.effect,
            transition=f"processing -> {done.status}",
            repeated=done.repeated,
        )
        return _recorded(key, done)

    return router


def _recorded(key: str, done: finish.Recorded, **extra: Any) -> JSONResponse:
    """The outcome a complete or fail recorded; a repeated call (the first one's answer was
    lost) gets the same answer, marked `repeated`, and changed nothing."""
    body: dict[str, Any] = {"status": done.status, "key": key, **extra}
    if done.repeated:
        body["repeated"] = True
    return JSONResponse(body)


def _lease_lost(key: str) -> JSONResponse:
    return JSONResponse(
        {
            "status": "lease_lost",
            "key": key,
            "detail": "This lease token no longer holds the key; nothing was changed.",
        },
        status_code=409,
    )
