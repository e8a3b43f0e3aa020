"""The HTTP API: accept events durably, answer repeats with the first answer.

Nothing is published from a request: a 2xx means the key, the event and its outbox row are
committed together, and the relay takes it from there.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.claims.api import claims_router
from outbox.core import contract, keys
from outbox.core.access import FailureThrottle, require_token_or_loopback
from outbox.core.jsonbody import parse_json
from outbox.core.limits import BodyTooLarge, RequestLimits, too_large
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, json_response, problem_response, problem_responses
from outbox.core.routes import RouteTable, load_routes
from outbox.core.settings import Settings, get_settings
from outbox.core.timewindow import iso
from outbox.ingest import admission, intake
from outbox.ingest.answers import respond
from outbox.ingest.envelope import Envelope
from outbox.ingest.fastpath import EVENTS_PATH, Receiver, read_body
from outbox.ingest.webhooks import webhook_ingest, webhooks_router
from outbox.operate.api import operator_router
from outbox.operate.console import console_router
from outbox.operate.metrics import ReceiverMetrics
from outbox.store.engines import RECEIVER, create_receiver_engine, create_sync_engine
from outbox.store.readiness import readiness

log = get_logger(__name__)

ENVELOPE_SCHEMA = Envelope.model_json_schema()


def create_app(settings: Settings | None = None, routes: RouteTable | None = None) -> Receiver:
    """Build the receiver for `settings` (the environment's by default)."""
    settings = settings or get_settings()
    routes = routes or load_routes(settings.routes_file)
    state: dict[str, Any] = {}

    def sync_engine() -> Engine:
        engine: Engine = state["sync_engine"]
        return engine

    metrics = ReceiverMetrics(sync_engine, routes)
    known_sources = admission.sources(settings, routes)
    signers = admission.signers(settings, known_sources)
    # One count of failed credentials for every endpoint that takes one (outbox/core/access.py).
    throttle = FailureThrottle(settings.auth_failure_limit, settings.auth_failure_window_seconds)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["engine"] = create_receiver_engine(settings)
        # Operators, metrics and readiness use the synchronous stores in the thread pool.
        state["sync_engine"] = create_sync_engine(settings, pool_size=2, application_name=RECEIVER)
        try:
            yield
        finally:
            await state["engine"].dispose()
            state["sync_engine"].dispose()

    app = Receiver(
        title="idem gateway",
        version="0.1.0",
        summary="Exactly-once side effects for automation workflows.",
        lifespan=lifespan,
        # The schema and its viewers map every endpoint for a scanner: only when asked for.
        openapi_url="/openapi.json" if settings.api_docs else None,
        docs_url="/docs" if settings.api_docs else None,
        redoc_url="/redoc" if settings.api_docs else None,
    )
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_body_bytes)

    @app.exception_handler(Problem)
    async def _problem(_: Request, problem: Problem) -> JSONResponse:
        return problem_response(problem)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if isinstance(error, BodyTooLarge):
            return problem_response(too_large(error.limit))
        code = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}.get(
            error.status_code, "error"
        )
        return problem_response(Problem(error.status_code, code, str(error.detail)))

    async def _database_unavailable(_: Request, error: Exception) -> JSONResponse:
        # The operator endpoints and readiness run the synchronous stores; an outage there is
        # the same 503 the event path gives, never a 500.
        log.warning("database.unavailable", error=type(error).__name__)
        return problem_response(_unavailable(settings))

    for outage in (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError):
        app.add_exception_handler(outage, _database_unavailable)

    @app.exception_handler(sa_exc.DataError)
    async def _unstorable(_: Request, error: sa_exc.DataError) -> JSONResponse:
        # Text PostgreSQL cannot store (a NUL character) or a value out of its range: the
        # input's fault, and the transaction was rolled back, so nothing was written.
        log.warning("request.unstorable_value", error=type(error.orig).__name__)
        return problem_response(
            Problem(
                422,
                "invalid_request",
                "A value cannot be stored (text with NUL characters, or a number out of range).",
            )
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        return problem_response(
            Problem(422, "invalid_request", "The request is malformed.", errors=_fields(error))
        )

    async def database(operation: Any) -> Any:
        """Run a database step with a bounded wait; an outage becomes a 503 with Retry-After."""
        try:
            async with asyncio.timeout(settings.db_timeout_seconds * 2):
                return await operation
        except (
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
            sa_exc.TimeoutError,
            TimeoutError,
            OSError,
        ) as error:
            log.warning("database.unavailable", error=type(error).__name__)
            raise _unavailable(settings) from error

    @app.post(
        EVENTS_PATH,
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
                key = keys.validate_client_key(header_key)
            except keys.InvalidKey as error:
                raise Problem(400, "invalid_idempotency_key", str(error)) from error
        else:
            key = envelope.derived_key(fold_external_id_case=route.fold_external_id_case)
        event = intake.NewEvent(
            key=key,
            payload_hash=envelope.payload_hash(fold_external_id_case=route.fold_external_id_case),
            correlation_id=envelope.correlation_id or uuid.uuid4().hex,
            source=envelope.normalized_source,
            event_type=event_type,
            external_id=str(envelope.external_id),
            version=None if envelope.version is None else str(envelope.version),
            payload_json=envelope.payload_json,
            route=route.label,
            ttl_seconds=route.ttl_seconds,
            workflow_name=envelope.workflow,
            execution_id=None if envelope.execution_id is None else str(envelope.execution_id),
            contract_violations=tuple(contract.violations(route, envelope.payload)),
        )
        outcome = await database(intake.accept(state["engine"], event))
        return respond(outcome, event, metrics)

    app.ingest = post_event

    @app.get("/v1/events/{key:path}", responses=problem_responses(401, 403, 404, 422, 429, 503))
    async def get_event(key: str, request: Request) -> JSONResponse:
        """The state of one key: status, attempts, result, external_ref, error_code, times.

        The stored result is the downstream's answer: only holders of the claims or operator
        token (or, with neither configured, clients on this machine) may read it.
        """
        tokens = (settings.claims_token, settings.operator_token)
        require_token_or_loopback(request, tokens, throttle, "claims")
        row = await database(intake.get_key(state["engine"], key))
        if row is None:
            raise Problem(404, "key_not_found", "No event is stored under this key.")
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
            }
        )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is up (it does not look at the database)."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: json_response("Not ready: the checks say what")})
    async def readyz() -> JSONResponse:
        """Ready to take events: the database answers with the schema at head, the broker
        answers. 503 names what is not ready."""
        checks = await run_in_threadpool(readiness, sync_engine(), settings.redis_url)
        ready = all(checks.values())
        return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text format: with METRICS_TOKEN set, for its bearer only; unset, for
        loopback clients only (a scrape counts keys, and the counts are not public)."""
        require_token_or_loopback(request, settings.metrics_token, throttle, "metrics")
        body = await run_in_threadpool(generate_latest, metrics.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.include_router(operator_router(settings, routes, sync_engine, throttle))
    app.include_router(console_router(settings, routes, sync_engine, throttle))
    app.include_router(claims_router(settings, lambda: state["engine"], database, throttle))
    app.ingest_webhook = webhook_ingest(
        settings, routes, known_sources, signers, lambda: state["engine"], database, metrics
    )
    app.include_router(webhooks_router(app.ingest_webhook))

    return app


def _unavailable(settings: Settings) -> Problem:
    return Problem(
        503,
        "database_unavailable",
        "The database is unreachable; nothing was stored or changed. Retry later.",
        headers={"Retry-After": str(settings.unavailable_retry_after)},
    )


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
            422, "invalid_envelope", "The event envelope is malformed.", errors=_fields(error)
        ) from error


def _fields(error: ValidationError | RequestValidationError) -> list[dict[str, str]]:
    """Field-level detail without echoing the caller's values (they may hold personal data)."""
    return [
        {
            "field": ".".join(str(part) for part in err["loc"]) or "(body)",
            "message": err["msg"],
            "type": err["type"],
        }
        for err in error.errors()
    ]
