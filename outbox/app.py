"""The gateway's HTTP app: each context's endpoints composed into one receiver.

The events and the providers' webhooks (`outbox.ingest`), the claims API (`outbox.claims`), the
operator API and console (`outbox.operate`) bring their routers; this module adds what every
endpoint shares: the body limit, the error answers (RFC 9457, an outage is a 503 with
Retry-After), health (`/healthz`, `/readyz`) and `/metrics`. No context imports another; they
meet here and in `outbox.cli`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp

from outbox.claims.api import claims_router
from outbox.core import tracing
from outbox.core.access import FailureThrottle, require_token_or_loopback
from outbox.core.jsonroute import JsonBodyError
from outbox.core.limits import BodyTooLarge, RequestLimits, too_large
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, field_errors, json_response, problem_response
from outbox.core.routes import RouteTable, load_routes
from outbox.core.settings import Settings, get_settings
from outbox.core.unexpected import UnexpectedErrors
from outbox.ingest import admission, wakeup
from outbox.ingest.events import event_ingest, events_router
from outbox.ingest.fastpath import Receiver, event_route
from outbox.ingest.metrics import EventCounters
from outbox.ingest.webhooks import webhook_ingest, webhooks_router
from outbox.operate.api import operator_router
from outbox.operate.console import console_router
from outbox.operate.metrics import DatabaseCollector
from outbox.store.engines import RECEIVER, create_receiver_engine, create_sync_engine
from outbox.store.readiness import Readiness

log = get_logger(__name__)
T = TypeVar("T")


async def bounded_wait(operation: Awaitable[T], seconds: float) -> T:
    """Await `operation` for at most `seconds`, then raise TimeoutError, however long the
    operation itself takes to stop.

    A plain `asyncio.timeout` waits for the cancelled step to end, and psycopg, cancelled
    mid-query, first asks the server to cancel the query over a new connection (up to 5 s) and
    then waits for the query again (up to 5 s more). Across a network that silently drops the
    database's packets both waits run out: the 503 came 10 s after the bound (the multi-host
    soak, docs/explanation/reliability.md). So the step runs as a task of its own: at the bound it
    is cancelled and left to wind down alone (its connection goes back to the pool when it has),
    and the caller is answered at once. The step may still commit while it winds down; a 503
    never said it had not (the answer of a committed statement can be lost just the same).
    """
    step = asyncio.ensure_future(operation)
    try:
        async with asyncio.timeout(seconds):
            return await asyncio.shield(step)
    finally:
        if not step.done():
            step.cancel()
            step.add_done_callback(_retrieve)


def _retrieve(step: asyncio.Future[Any]) -> None:
    """Take an abandoned step's outcome, so asyncio does not report it as never retrieved."""
    if not step.cancelled():
        step.exception()


def create_server() -> ASGIApp:
    """The receiver as `idem serve` runs it (in each of its processes): inside the HTTP server
    span of every request when tracing is on (outbox/core/tracing.py), the app itself when off."""
    tracing.setup("idem-receiver")
    return tracing.instrument_asgi(create_app(), event_route)


def create_app(settings: Settings | None = None, routes: RouteTable | None = None) -> Receiver:
    """Build the receiver for `settings` (the environment's by default)."""
    settings = settings or get_settings()
    routes = routes or load_routes(settings.routes_file)
    for label in routes.open_superseding():
        log.warning(
            "routes.lanes_per_source",
            route=label,
            fix='name the sources that share its objects: sources = ["crm", "erp"]',
            why="open to any source, so each source's versions supersede its own lanes only",
        )
    state: dict[str, Any] = {}

    def sync_engine() -> Engine:
        engine: Engine = state["sync_engine"]
        return engine

    # One registry for /metrics: the receiver's counters and the database's state at scrape.
    registry = CollectorRegistry()
    metrics = EventCounters(registry, routes)
    registry.register(DatabaseCollector(sync_engine, routes))
    known_sources = admission.sources(settings, routes)
    signers = admission.signers(settings, known_sources)
    # One count of failed credentials for every endpoint that takes one (outbox/core/access.py).
    throttle = FailureThrottle(settings.auth_failure_limit, settings.auth_failure_window_seconds)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state["engine"] = create_receiver_engine(settings)
        # Operators, metrics and readiness use the synchronous stores in the thread pool.
        state["sync_engine"] = create_sync_engine(settings, pool_size=2, application_name=RECEIVER)
        state["readiness"] = Readiness(state["sync_engine"], settings.broker())
        try:
            yield
        finally:
            state["readiness"].close()
            await wakeup.of(state["engine"]).settled()
            await state["engine"].dispose()
            state["sync_engine"].dispose()
            tracing.shutdown()
            # Here, not after uvicorn.run: uvicorn re-raises the stopping signal once it is done.
            log.info("receiver.stopped")

    app = Receiver(
        title="idem gateway",
        version=importlib.metadata.version("idem-gateway"),
        summary="Exactly-once side effects for automation workflows.",
        lifespan=lifespan,
        # The schema and its viewers map every endpoint for a scanner: only when asked for.
        openapi_url="/openapi.json" if settings.api_docs else None,
        # /docs is added below, from installed files; ReDoc would load itself from a CDN.
        docs_url=None,
        redoc_url=None,
        # FastAPI's own spans (tracing on: outbox/core/tracing.py), never for probes and scrapes.
        telemetry={"exclude": tracing.untraced},
    )
    app.add_middleware(RequestLimits, max_body_bytes=settings.max_body_bytes)
    # Added last, so outermost of ours: it answers what every handler let through.
    app.add_middleware(UnexpectedErrors)
    if settings.api_docs:
        _serve_api_docs(app)

    @app.exception_handler(Problem)
    async def _problem(_: Request, problem: Problem) -> JSONResponse:
        return problem_response(problem)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        if isinstance(error, BodyTooLarge):
            return problem_response(too_large(error.limit))
        if isinstance(error, JsonBodyError):
            return problem_response(error.problem)
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
            Problem(422, "invalid_request", "The request is malformed.", errors=field_errors(error))
        )

    async def database(operation: Any) -> Any:
        """Run a database step with a bounded wait; an outage becomes a 503 with Retry-After."""
        try:
            return await bounded_wait(operation, settings.db_timeout_seconds * 2)
        except (
            sa_exc.OperationalError,
            sa_exc.InterfaceError,
            sa_exc.TimeoutError,
            TimeoutError,
            OSError,
        ) as error:
            log.warning("database.unavailable", error=type(error).__name__)
            raise _unavailable(settings) from error

    post_event = event_ingest(settings, routes, signers, lambda: state["engine"], database, metrics)
    app.ingest = post_event
    app.include_router(
        events_router(post_event, settings, routes, lambda: state["engine"], database, throttle)
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The process is up (it does not look at the database)."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: json_response("Not ready (the log says why)")})
    async def readyz() -> JSONResponse:
        """Ready to take events: the database answers with the schema at this release's head
        (or a later release's, migrated first in a rolling upgrade), the broker answers.
        Unauthenticated, so it says only ready or not (which check failed is in the log), and
        it checks at most once a second over reused connections (outbox/store/readiness.py)."""
        ready = await state["readiness"].ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus text format: with METRICS_TOKEN set, for its bearer only; unset, for
        loopback clients only (a scrape counts keys, and the counts are not public)."""
        require_token_or_loopback(request, settings.metrics_token, throttle, "metrics")
        body = await run_in_threadpool(generate_latest, registry)
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


def _serve_api_docs(app: FastAPI) -> None:
    """/docs: Swagger UI from the installed `swagger-ui-bundle-v2` package's files, so the page
    works on a machine that cannot reach a CDN."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount("/docs/assets", StaticFiles(directory=str(swagger_ui_path)), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def _docs(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}/openapi.json",
            title="idem gateway: API",
            swagger_js_url=f"{root}/docs/assets/swagger-ui-bundle.js",
            swagger_css_url=f"{root}/docs/assets/swagger-ui.css",
            swagger_favicon_url=f"{root}/docs/assets/favicon-32x32.png",
        )
