"""The operator console: server-rendered pages over the operators' stores, under /console.

Same rules as the operator API: with OPERATOR_TOKEN unset every page answers 503 (disabled);
otherwise a page needs a signed session (see `session` and `auth`), got by signing in with the
token, and every POST that changes something carries the session's CSRF token. Pages are plain
HTML with one stylesheet served from here: no script, nothing fetched from elsewhere. The
stores are synchronous and run in the thread pool, as in the operator API; the audit trail
names the console's actions "console".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import RedirectResponse, Response
from sqlalchemy import Engine
from starlette.datastructures import FormData

from outbox.core import keys
from outbox.core.access import FailureThrottle
from outbox.core.logs import get_logger
from outbox.core.redaction import mask_secrets, url_host
from outbox.core.routes import RouteTable
from outbox.core.settings import Settings
from outbox.operate import deadletters, replay, routestate, stats
from outbox.operate.console import charts
from outbox.operate.console.auth import Gate, add_auth_routes
from outbox.operate.console.forms import (
    DEAD_LETTER_KINDS,
    DEAD_LETTER_STATES,
    REPLAYABLE,
    DeadLetterQuery,
    digits,
)
from outbox.operate.console.pages import (
    PREFIX,
    ConsoleRoute,
    base_path,
    message_page,
    pretty,
    render,
)
from outbox.operate.console.replays import OPERATOR, add_replay_routes
from outbox.operate.console.session import Session
from outbox.operate.deliveries import key_view
from outbox.store import operate as oq
from outbox.store.attempts import attempts_of

log = get_logger(__name__)

STUCK_AFTER_SECONDS = 300.0
ROUTE_NOTICES = {"paused": "The route is paused.", "resumed": "The route is resumed."}


def target(routes: RouteTable, label: str) -> dict[str, str]:
    """What a route does and where: the action, and the host of an http route."""
    route = routes.by_label(label)
    if route is None:
        return {"route": label, "action": "unknown (route no longer configured)", "host": "—"}
    if route.action == "http" and route.url:
        host = url_host(route.url)
        return {"route": label, "action": f"http {route.method}", "host": host}
    if route.action == "python":
        return {"route": label, "action": "python", "host": route.function or "—"}
    return {"route": label, "action": route.action, "host": "— (touches nothing)"}


def lookup_key(engine: Engine, key: str, routes: RouteTable) -> dict[str, Any] | None:
    """One key's public view (a fan-out event's with its deliveries) and its dead-letter
    history (read-only)."""
    found = key_view(engine, key, routes)
    if found is None:
        return None
    with engine.connect() as conn:
        history = conn.execute(oq.DEAD_LETTER_HISTORY, {"key": key}).mappings().all()
    found["result"] = mask_secrets(found["result"])
    found["history"] = [dict(h) for h in history]
    found["attempt_log"] = attempts_of(engine, key)
    return found


def _overview(engine: Engine, routes: RouteTable) -> dict[str, Any]:
    return {
        "stats": stats.collect(engine, routes.destinations),
        "routes": routestate.list_routes(engine, routes),
        "minutes": charts.per_minute(engine),
        "stuck": stats.stuck(engine, STUCK_AFTER_SECONDS, limit=10),
        "blocked_lanes": stats.blocked_lanes(engine, STUCK_AFTER_SECONDS, limit=10),
    }


def _reason(form: FormData) -> str | None:
    """A form's `reason`: 1 to 500 characters once trimmed, else None."""
    reason = str(form.get("reason") or "").strip()
    return reason if 1 <= len(reason) <= 500 else None


def _reason_needed(request: Request, session: Session, why: str) -> Response:
    return message_page(
        request,
        422,
        "A reason is needed",
        f"Say in 1 to 500 characters why {why}. Nothing changed.",
        session=session,
    )


def console_router(
    settings: Settings,
    routes: RouteTable,
    engine: Callable[[], Engine],
    throttle: FailureThrottle | None = None,
) -> APIRouter:
    """The console's pages under /console; `engine()` returns the sync engine of the app;
    `throttle` counts failed sign-ins (shared with the operator API's tokens)."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False, route_class=ConsoleRoute)
    throttle = throttle or FailureThrottle(
        settings.auth_failure_limit, settings.auth_failure_window_seconds
    )
    gate = Gate(settings.operator_token, engine, throttle)
    add_auth_routes(router, gate)

    @router.get("")
    @router.get("/")
    async def overview(request: Request) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        data = await run_in_threadpool(_overview, engine(), routes)
        minutes: list[charts.Minute] = data["minutes"]
        totals = charts.totals(minutes)
        return render(
            request,
            "overview.html",
            {
                "title": "Overview",
                "nav": "overview",
                "stats": data["stats"],
                "routes": data["routes"],
                "notice": ROUTE_NOTICES.get(request.query_params.get("route_changed") or ""),
                "stuck": data["stuck"],
                "blocked_lanes": data["blocked_lanes"],
                "stuck_after": STUCK_AFTER_SECONDS,
                "chart_wide": charts.render_svg(minutes, id_prefix="chart-wide"),
                "chart_narrow": charts.render_svg(
                    minutes, width=360, height=200, label_every=30, id_prefix="chart-narrow"
                ),
                "legend": [
                    (s.name, totals[s.name], charts.legend_sample(s)) for s in charts.SERIES
                ],
                "minutes": [m for m in minutes if m.accepted or m.succeeded or m.failed],
                "totals": totals,
                "kinds": DEAD_LETTER_KINDS,
            },
            session=session,
        )

    @router.get("/dead-letters")
    async def dead_letter_list(request: Request) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        query = DeadLetterQuery.parse(request.query_params)
        items: list[dict[str, Any]] = []
        next_cursor: int | None = None
        if query.where is not None:
            items, next_cursor = await run_in_threadpool(
                deadletters.list_dead_letters, engine(), query.where, query.limit, query.cursor
            )
        base = base_path(request)
        return render(
            request,
            "dead_letters.html",
            {
                "title": "Dead letters",
                "nav": "dead-letters",
                "form": query.form,
                "kinds": DEAD_LETTER_KINDS,
                "states": DEAD_LETTER_STATES,
                "items": items,
                "errors": query.errors,
                "first_page": query.cursor is not None,
                "first_href": query.href(base),
                "next_href": None if next_cursor is None else query.href(base, next_cursor),
                "replay_href": query.replay_href(base),
            },
            session=session,
            status_code=422 if query.errors else 200,
        )

    @router.get("/dead-letters/{dead_letter_id}")
    async def dead_letter_detail(request: Request, dead_letter_id: str) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        number = digits(dead_letter_id)
        found = None
        if number is not None:
            found = await run_in_threadpool(deadletters.get_dead_letter, engine(), number)
        if found is not None:
            found["attempt_log"] = await run_in_threadpool(attempts_of, engine(), found["key"])
        if found is None:
            return message_page(
                request, 404, "Not found", "No dead letter has this id.", session=session
            )
        notice = None
        if request.query_params.get("discarded"):
            notice = "The dead letter was discarded."
        return render(
            request,
            "dead_letter.html",
            {
                "title": f"Dead letter {found['id']}",
                "nav": "dead-letters",
                "d": found,
                "target": target(routes, found["route"]),
                "payload": pretty(found["payload"]),
                "replayable": found["key_status"] in REPLAYABLE,
                "notice": notice,
            },
            session=session,
        )

    @router.post("/dead-letters/{dead_letter_id}/discard")
    async def discard(request: Request, dead_letter_id: str) -> Response:
        checked = await gate.post(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        number = digits(dead_letter_id)
        if number is None:
            return message_page(
                request, 404, "Not found", "No dead letter has this id.", session=session
            )
        reason = _reason(form)
        if reason is None:
            return _reason_needed(request, session, "this dead letter is discarded")
        done = await run_in_threadpool(
            deadletters.discard_dead_letter, engine(), number, reason, OPERATOR
        )
        if not done:
            return message_page(
                request,
                409,
                "Not open",
                "This dead letter does not exist or is no longer open. Nothing changed.",
                session=session,
            )
        log.info("dead_letter.discarded", id=number, by=OPERATOR)
        return RedirectResponse(
            f"{base_path(request)}/dead-letters/{number}?discarded=1", status_code=303
        )

    add_replay_routes(router, gate, routes, engine, replay.confirm_secret(settings))

    @router.post("/routes/{name}/{action}")
    async def pause_or_resume(request: Request, name: str, action: str) -> Response:
        checked = await gate.post(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        if action not in ("pause", "resume") or routes.by_label(name) is None:
            return message_page(
                request,
                404,
                "Not found",
                "No configured route or destination has this name.",
                session=session,
            )
        try:
            await run_in_threadpool(routestate.check_pausable, engine(), routes, name, action)
        except routestate.FansOut as refused:
            return message_page(
                request, 409, "A fan-out route", f"{refused}. Nothing changed.", session=session
            )
        if action == "pause":
            reason = _reason(form)
            if reason is None:
                return _reason_needed(request, session, "the route is paused")
            if await run_in_threadpool(routestate.pause, engine(), name, reason, OPERATOR):
                log.info("route.paused", route=name, by=OPERATOR)
        else:
            resumed = await run_in_threadpool(routestate.resume, engine(), name, OPERATOR)
            if resumed.changed or resumed.queued:
                log.info(
                    "route.resumed",
                    route=name,
                    by=OPERATOR,
                    changed=resumed.changed,
                    queued=resumed.queued,
                )
        done = "paused" if action == "pause" else "resumed"
        return RedirectResponse(f"{base_path(request)}/?route_changed={done}", status_code=303)

    @router.get("/keys")
    async def key_lookup(request: Request) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        key = (request.query_params.get("key") or "").strip()
        found = None
        if key:
            found = await run_in_threadpool(lookup_key, engine(), key, routes)
        return render(
            request,
            "key.html",
            {
                "title": "Look up a key" if found is None else f"Key {keys.mask_key(key)}",
                "nav": "keys",
                "key": key,
                "k": found,
                "result": None if found is None else pretty(found["result"]),
                "replayable": found is not None and found["status"] in REPLAYABLE,
            },
            session=session,
            status_code=404 if key and found is None else 200,
        )

    @router.api_route("/{rest:path}", methods=["GET", "POST"])
    async def not_found(request: Request, rest: str) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        return message_page(request, 404, "Not found", "There is no such page.", session=session)

    return router
