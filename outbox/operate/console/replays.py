"""The replay pages: a filter (or ticked keys) → a dry-run report → confirm → the result.

The confirm form repeats the exact filter in hidden fields with the dry run's token; when the
set changed in between, the store replays nothing and the page shows the fresh report (409).
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, Response
from pydantic import ValidationError
from sqlalchemy import Engine

from outbox.core.logs import get_logger
from outbox.core.routes import RouteTable
from outbox.operate import replay
from outbox.operate.console.auth import Gate
from outbox.operate.console.forms import REPLAYABLE, ReplayForm, strings, validation_messages
from outbox.operate.console.pages import render
from outbox.operate.console.session import Session

log = get_logger(__name__)

OPERATOR = "console"
"""Who the audit trail names for actions taken in the console."""


def _form_page(
    request: Request, session: Session, form: ReplayForm, errors: list[str], status_code: int
) -> HTMLResponse:
    return render(
        request,
        "replay_form.html",
        {
            "title": "Replay",
            "nav": "replays",
            "form": form,
            "replayable": REPLAYABLE,
            "errors": errors,
        },
        session=session,
        status_code=status_code,
    )


def _report_page(
    request: Request,
    session: Session,
    form: ReplayForm,
    report: replay.ReplayReport,
    *,
    stale: bool = False,
) -> HTMLResponse:
    return render(
        request,
        "dry_run.html",
        {
            "title": "Replay: dry run",
            "nav": "replays",
            "form": form,
            "report": report.as_dict(),
            "to_replay": report.to_replay,
            "stale": stale,
        },
        session=session,
        status_code=409 if stale else 200,
    )


def add_replay_routes(
    router: APIRouter,
    gate: Gate,
    routes: RouteTable,
    engine: Callable[[], Engine],
    secret: bytes,
) -> None:
    @router.get("/replays")
    async def replay_form(request: Request) -> Response:
        session = await gate.page(request)
        if isinstance(session, Response):
            return session
        form = ReplayForm(request.query_params.getlist)
        if not request.query_params:
            form.statuses = ["failed_final"]
        return _form_page(request, session, form, [], 200)

    @router.post("/replays/dry-run")
    async def replay_dry_run(request: Request) -> Response:
        checked = await gate.post(request)
        if isinstance(checked, Response):
            return checked
        session, data = checked
        form = ReplayForm(strings(data))
        try:
            wanted = form.request()
        except ValidationError as error:
            return _form_page(request, session, form, validation_messages(error), 422)
        report = await run_in_threadpool(replay.dry_run, engine(), wanted, routes, secret=secret)
        return _report_page(request, session, form, report)

    @router.post("/replays/confirm")
    async def replay_confirm(request: Request) -> Response:
        checked = await gate.post(request)
        if isinstance(checked, Response):
            return checked
        session, data = checked
        form = ReplayForm(strings(data))
        confirm = str(data.get("confirm") or "").strip()
        try:
            wanted = form.request(confirm=confirm or None)
        except ValidationError as error:
            return _form_page(request, session, form, validation_messages(error), 422)
        outcome = await run_in_threadpool(
            replay.execute, engine(), wanted, routes, OPERATOR, secret=secret
        )
        if isinstance(outcome, replay.Stale):
            log.info("replay.stale", by=OPERATOR)
            return _report_page(request, session, form, outcome.report, stale=True)
        log.info(
            "replay.executed",
            replay_id=outcome.replay_id,
            by=OPERATOR,
            keys=len(outcome.report.to_replay),
        )
        return render(
            request,
            "result.html",
            {
                "title": f"Replay {outcome.replay_id}",
                "nav": "replays",
                "replay_id": outcome.replay_id,
                "report": outcome.report.as_dict(),
                "to_replay": outcome.report.to_replay,
            },
            session=session,
        )
