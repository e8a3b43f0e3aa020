"""`/v1/claims`: the key store for workflows that perform the side effect themselves.

An n8n HTTP Request node claims the key, acts, then completes (or fails) with the lease token.
The answers are made for an IF node: 201 claimed (`uncertain: true`: look the effect up before
acting), 200 already_succeeded (use the stored result) or superseded (a newer version of the
key's lane), 409 in_progress or lane_busy (wait Retry-After), lease_lost (stop: someone else
holds the key now) or not_a_claim_key (an event's key, which the gateway's worker acts on).
Every endpoint needs the CLAIMS_TOKEN bearer token; without one configured, only clients on
this machine are served (`outbox.core.access`).
"""

# No `from __future__ import annotations`: FastAPI must resolve the models at definition time.

import math
import uuid
from collections.abc import Callable
from typing import Annotated, Any, assert_never

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.claims import lanes, service
from outbox.core import keys
from outbox.core.access import FailureThrottle, require_token_or_loopback
from outbox.core.jsonroute import JsonBodyRoute
from outbox.core.labels import Label
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, json_response, problem_responses
from outbox.core.settings import Settings

log = get_logger(__name__)

Seconds = Annotated[int, Field(ge=1, le=3600)]


def _finite(value: Any) -> Any:
    """Refuse NaN and Infinity anywhere in a value: Python's JSON parser reads them, but they
    are not JSON, cannot be hashed canonically nor stored as jsonb (the event path refuses them
    the same way)."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN and Infinity are not JSON")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return value


# Any JSON value, without the non-standard constants.
JsonValue = Annotated[Any, AfterValidator(_finite)]


def _client_key(value: str) -> str:
    try:
        return keys.validate_client_key(value)
    except keys.InvalidKey as error:
        raise ValueError(str(error)) from error


# A key a workflow names: the gateway's rules for client keys (outbox.core.keys).
ClientKey = Annotated[str, Field(min_length=1, max_length=255), AfterValidator(_client_key)]


class ClaimRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: ClientKey
    payload: JsonValue = None
    lease_seconds: Seconds | None = None
    # Visible ASCII, at most 200 characters: they travel in headers (outbox.core.labels).
    correlation_id: Label | None = None
    workflow: Label | None = None
    # The business object the effect is about: claims of one lane hold it one at a time. Also
    # a label: printable ASCII, 1 to 200 characters (outbox.core.labels).
    lane: Label | None = None
    # An integer or an RFC 3339 timestamp (outbox.claims.lanes); read by the endpoint, so that
    # any value that is not one is the one answer `version_invalid`.
    version: JsonValue = None

    @field_validator("payload")
    @classmethod
    def _finite_payload(cls, value: Any) -> Any:
        return keys.require_finite(value)


def _lane_version(body: ClaimRequest) -> lanes.Version | None:
    """The claim's version, parsed; a Problem when it names one it may not."""
    if body.version is None:
        return None
    if body.lane is None:
        raise Problem(
            422, "lane_required", "A version is compared within a lane: name the `lane` too."
        )
    try:
        if not isinstance(body.version, int | str):
            raise lanes.InvalidVersion("a version is an integer or an RFC 3339 timestamp")
        return lanes.parse_version(body.version)
    except lanes.InvalidVersion as error:
        raise Problem(422, "version_invalid", str(error)) from error


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    lease_seconds: Seconds | None = None


class CompleteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    result: JsonValue = None
    external_ref: str | None = Field(default=None, max_length=500)

    @field_validator("result")
    @classmethod
    def _finite_result(cls, value: Any) -> Any:
        return keys.require_finite(value)


class FailRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    error_code: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:-]+$")
    retryable: bool
    detail: str = Field(default="", max_length=10_000)
    # Whether the side effect may exist: `none` only when the workflow knows nothing was done
    # (the downstream refused, or the request never left). Unknown makes the key uncertain.
    effect: service.Effect = "unknown"


class DedupeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: ClientKey
    # One second to a year: how long the key counts as seen.
    ttl_seconds: int = Field(ge=1, le=31_536_000)
    correlation_id: Label | None = None
    workflow: Label | None = None


# The key in a path: held to the same rules, so a CR/LF or a control character never reaches
# the log line that names the key (masked) or the store.
KeyPath = Annotated[str, Path(min_length=1, max_length=255), AfterValidator(_client_key)]


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
        version = _lane_version(body)
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
            service.dedupe(
                engine(),
                body.key,
                ttl_seconds=body.ttl_seconds,
                correlation_id=correlation_id,
                workflow=body.workflow,
            )
        )
        bound = log.bind(key=keys.mask_key(body.key), correlation_id=correlation_id)
        match outcome:
            case service.New():
                bound.info("claim.dedupe_new", ttl_seconds=body.ttl_seconds)
                return JSONResponse({"seen": False, "key": body.key}, status_code=201)
            case service.Seen():
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
            case service.OtherUse():
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
            service.heartbeat(
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
            service.complete(engine(), key, body.lease_token, body.result, body.external_ref)
        )
        if not done:
            return _lease_lost(key)
        log.info("claim.completed", key=keys.mask_key(key), transition="processing -> succeeded")
        return JSONResponse({"status": "succeeded", "key": key, "external_ref": body.external_ref})

    @router.post("/{key}/fail")
    async def fail(key: KeyPath, body: FailRequest) -> JSONResponse:
        """Record a failure: retryable frees the key for the next claim; otherwise a dead
        letter is written for an operator."""
        done = await database(
            service.fail(
                engine(),
                key,
                body.lease_token,
                error_code=body.error_code,
                retryable=body.retryable,
                detail=body.detail,
                effect=body.effect,
            )
        )
        if not done:
            return _lease_lost(key)
        status = "failed_retryable" if body.retryable else "failed_final"
        log.info(
            "claim.failed",
            key=keys.mask_key(key),
            error_code=body.error_code,
            effect=body.effect,
            transition=f"processing -> {status}",
        )
        return JSONResponse({"status": status, "key": key})

    return router


def _lease_lost(key: str) -> JSONResponse:
    return JSONResponse(
        {
            "status": "lease_lost",
            "key": key,
            "detail": "This lease token no longer holds the key; nothing was changed.",
        },
        status_code=409,
    )
