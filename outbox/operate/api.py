"""The operator API: dead letters, replays, stats. Behind a bearer token, never open.

With OPERATOR_TOKEN unset these endpoints answer 503 (disabled), not 200: an unconfigured
deployment must not expose replay to anyone who can reach it. The token is compared in
constant time, and wrong tokens are throttled per client address (outbox/core/access.py). The
stores are synchronous (the CLI runs the same functions); here they run in the thread pool.
"""

# No `from __future__ import annotations` here: FastAPI must see the dependency objects that
# the endpoints, defined inside a factory, refer to.

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Body, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import Engine

from outbox.core.access import FailureThrottle, require_bearer
from outbox.core.jsonroute import JsonBodyRoute
from outbox.core.labels import Label
from outbox.core.logs import get_logger
from outbox.core.problems import Problem, problem_responses
from outbox.core.routes import RouteTable
from outbox.core.settings import Settings
from outbox.core.timewindow import parse_instant
from outbox.operate import deadletters, replay, routestate, stats

log = get_logger(__name__)


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=500)


class DiscardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1, max_length=500)


def operator_router(
    settings: Settings,
    routes: RouteTable,
    engine: Callable[[], Engine],
    throttle: FailureThrottle | None = None,
) -> APIRouter:
    """Routes under /v1 for operators; `engine()` returns the sync engine of the app;
    `throttle` counts wrong tokens (shared with the console's sign-ins)."""
    throttle = throttle or FailureThrottle(
        settings.auth_failure_limit, settings.auth_failure_window_seconds
    )

    def authorize(
        request: Request,
        authorization: Annotated[str | None, Header()] = None,
        # In the audit trail and log lines: a label (outbox.core.labels), at most 100 long.
        x_operator: Annotated[Label | None, Header(max_length=100)] = None,
    ) -> str:
        """The operator's name for the audit trail, once the token checks out."""
        expected = settings.operator_token
        if not expected:
            raise Problem(
                503,
                "operator_api_disabled",
                "Set OPERATOR_TOKEN to enable the operator API.",
            )
        # `authorization` is declared for the OpenAPI document; the check reads the request.
        require_bearer(request, expected, throttle, "operator")
        return x_operator or "api"

    router = APIRouter(
        prefix="/v1",
        tags=["operators"],
        # No lone surrogate in any string of a body, as on the events path (outbox.core.jsonbody).
        route_class=JsonBodyRoute,
        responses=problem_responses(400, 401, 413, 422, 429, 503),
    )
    secret = replay.confirm_secret(settings)
    Operator = Annotated[str, Depends(authorize)]

    @router.get("/dead-letters")
    async def list_dead_letters(
        _: Operator,
        event_type: str | None = None,
        source: str | None = None,
        destination: str | None = Query(
            None, description="A fan-out route's destination: its deliveries' dead letters only"
        ),
        kind: Literal["permanent", "retries_exhausted", "quarantined"] | None = None,
        status: Literal["open", "replayed", "discarded", "superseded"] | None = None,
        since: str | None = Query(None, description="ISO-8601 or relative such as 2h"),
        until: str | None = None,
        limit: int = Query(50, ge=1, le=deadletters.MAX_PAGE),
        cursor: int | None = Query(None, ge=1),
    ) -> dict[str, Any]:
        """Dead letters, newest first; pass `next_cursor` back as `cursor` for the next page."""
        where = deadletters.DeadLetterFilter(
            event_type=event_type,
            source=source,
            kind=kind,
            status=status,
            since=_instant("since", since),
            until=_instant("until", until),
            destination=destination or None,
        )
        items, next_cursor = await run_in_threadpool(
            deadletters.list_dead_letters, engine(), where, limit, cursor
        )
        return {"items": items, "next_cursor": next_cursor}

    @router.get("/dead-letters/{dead_letter_id}", responses=problem_responses(404))
    async def show_dead_letter(dead_letter_id: int, _: Operator) -> dict[str, Any]:
        """The payload (secrets masked), the history of dead letters of its key, the last error."""
        found = await run_in_threadpool(deadletters.get_dead_letter, engine(), dead_letter_id)
        if found is None:
            raise Problem(404, "dead_letter_not_found", "No dead letter has this id.")
        return found

    @router.post("/dead-letters/{dead_letter_id}/discard", responses=problem_responses(409))
    async def discard(
        dead_letter_id: int, body: DiscardRequest, operator: Operator
    ) -> dict[str, Any]:
        """Close an open dead letter without replaying it, with a reason for the record."""
        done = await run_in_threadpool(
            deadletters.discard_dead_letter, engine(), dead_letter_id, body.reason, operator
        )
        if not done:
            raise Problem(
                409, "dead_letter_not_open", "This dead letter does not exist or is no longer open."
            )
        log.info("dead_letter.discarded", id=dead_letter_id, by=operator)
        return {"id": dead_letter_id, "status": "discarded"}

    @router.post("/replays", responses=problem_responses(409))
    async def replays(
        request: Annotated[replay.ReplayRequest, Body()], operator: Operator
    ) -> JSONResponse:
        """Dry run by default: the report and its `confirm` token. Execute with
        `"dry_run": false` and that token; 409 with a fresh report if the set changed."""
        if request.dry_run:
            report = await run_in_threadpool(
                replay.dry_run, engine(), request, routes, secret=secret
            )
            return JSONResponse({"dry_run": True, **report.as_dict()})
        outcome = await run_in_threadpool(
            replay.execute, engine(), request, routes, operator, secret=secret
        )
        match outcome:
            case replay.Stale(report):
                raise Problem(
                    409,
                    "replay_set_changed",
                    "The keys this filter selects changed since the dry run; nothing was "
                    "replayed. Check the fresh report and confirm again.",
                    report={"dry_run": True, **report.as_dict()},
                )
            case replay.Executed(replay_id, report):
                log.info(
                    "replay.executed", replay_id=replay_id, by=operator, keys=len(report.to_replay)
                )
                return JSONResponse({"dry_run": False, "replay_id": replay_id, **report.as_dict()})

    @router.get("/stats")
    async def get_stats(_: Operator) -> dict[str, Any]:
        """Keys by status, outbox backlog and lag, processing age, open dead letters, and each
        destination's deliveries on their way or failed (`destinations`)."""
        result: dict[str, Any] = await run_in_threadpool(
            stats.collect, engine(), routes.destinations
        )
        return result

    async def known(name: str, action: str) -> str:
        """The name of a configured route or destination that this action may change."""
        if routes.by_label(name) is None:
            raise Problem(404, "route_not_found", "No configured route has this name.")
        try:
            await run_in_threadpool(routestate.check_pausable, engine(), routes, name, action)
        except routestate.FansOut as refused:
            raise Problem(
                409, "route_fans_out", str(refused), destinations=refused.destinations
            ) from refused
        return name

    @router.get("/routes")
    async def list_routes(_: Operator) -> dict[str, Any]:
        """Every route, then every destination: paused or circuit state, limits, keys waiting,
        attempts running; a fan-out route names its destinations (`fan_out`)."""
        items = await run_in_threadpool(routestate.list_routes, engine(), routes)
        return {"items": items}

    @router.post("/routes/{name}/pause", responses=problem_responses(404, 409))
    async def pause_route(name: str, body: PauseRequest, operator: Operator) -> dict[str, Any]:
        """Stop acting on the route's or destination's keys (they wait as pending), with a
        reason on record. A fan-out route is refused (409 `route_fans_out`, naming its
        destinations): it runs nothing itself; pause its destinations."""
        name = await known(name, "pause")
        changed = await run_in_threadpool(routestate.pause, engine(), name, body.reason, operator)
        if changed:
            log.info("route.paused", route=name, by=operator)
        return {"name": name, "paused": True, "changed": changed}

    @router.post("/routes/{name}/resume", responses=problem_responses(404, 409))
    async def resume_route(name: str, operator: Operator) -> dict[str, Any]:
        """Act on the route's keys again, those it held first, in the order they arrived."""
        name = await known(name, "resume")
        done = await run_in_threadpool(routestate.resume, engine(), name, operator)
        if done.changed or done.queued:
            log.info(
                "route.resumed", route=name, by=operator, changed=done.changed, queued=done.queued
            )
        return {"name": name, "paused": False, "changed": done.changed, "queued": done.queued}

    return router


def _instant(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return parse_instant(value)
    except ValueError as error:
        raise Problem(
            422,
            "invalid_request",
            str(error),
            errors=[{"field": name, "message": str(error), "type": "value_error"}],
        ) from error
