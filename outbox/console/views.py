"""The operator console: server-rendered pages over the operators' stores, under /console.

Same rules as the operator API: with OPERATOR_TOKEN unset every page answers 503 (disabled);
otherwise a page needs a signed session (see `session`), got by signing in with the token, and
every POST that changes something carries the session's CSRF token. Pages are plain HTML with
one stylesheet served from here: no script, nothing fetched from elsewhere. The stores are
synchronous and run in the thread pool, as in the operator API; the audit name is "console".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlencode, urlsplit

import jinja2
from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.routing import APIRoute
from markupsafe import Markup
from pydantic import ValidationError
from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox import deadletters, keys, queries, replay, stats
from outbox import operator_queries as oq
from outbox.console import charts
from outbox.console.session import (
    COOKIE_NAME,
    SESSION_SECONDS,
    Session,
    csrf_matches,
    issue,
    token_matches,
    verify,
)
from outbox.logs import get_logger
from outbox.redaction import mask_secrets
from outbox.routes import RouteTable
from outbox.settings import Settings
from outbox.timewindow import parse_instant

log = get_logger(__name__)

OPERATOR = "console"
"""Who the audit trail names for actions taken in the console."""

PREFIX = "/console"
HERE = Path(__file__).resolve().parent
PAGE_SIZE = 50
STUCK_AFTER_SECONDS = 300.0
MAX_FORM_BYTES = 512 * 1024  # room for a replay of 1000 keys, refused early beyond
DEAD_LETTER_KINDS = ("permanent", "retries_exhausted", "quarantined")
DEAD_LETTER_STATES = ("open", "replayed", "discarded")
DeadLetterKind = Literal["permanent", "retries_exhausted", "quarantined"]
DeadLetterState = Literal["open", "replayed", "discarded"]
REPLAYABLE = ("failed_final", "failed_retryable", "quarantined", "processing")

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

_DB_ERRORS = (
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.TimeoutError,
    TimeoutError,
    OSError,
)

STATUS_LABELS = {
    # Every status is shown as a word (and a symbol); colour only repeats it.
    "pending": ("…", "pending"),
    "processing": ("↻", "processing"),
    "succeeded": ("✔", "succeeded"),
    "failed_retryable": ("↺", "failed, will retry"),
    "failed_final": ("✖", "failed (final)"),
    "quarantined": ("⊘", "quarantined"),
    "open": ("●", "open"),
    "replayed": ("↺", "replayed"),
    "discarded": ("–", "discarded"),
}


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = _when
    env.filters["seconds"] = _seconds
    env.filters["mask"] = keys.mask_key
    env.globals["status_badge"] = _status_badge
    return env


TEMPLATES = _environment()
STYLESHEET = (HERE / "static" / "console.css").read_bytes()
STYLESHEET_VERSION = hashlib.sha256(STYLESHEET).hexdigest()[:12]


def _when(value: datetime | str | None) -> Markup:
    """An instant as `<time>` in UTC, to the second; a dash when absent."""
    if value is None or value == "":
        return Markup("—")
    moment = datetime.fromisoformat(value) if isinstance(value, str) else value
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    moment = moment.astimezone(UTC)
    return Markup('<time datetime="{}">{}</time>').format(
        moment.isoformat(), moment.strftime("%Y-%m-%d %H:%M:%S UTC")
    )


def _seconds(value: float | int | None) -> str:
    """A duration for people: 0.4 s, 42 s, 3 min 5 s, 2 h 10 min."""
    if value is None:
        return "—"
    seconds = float(value)
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, rest = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def _status_badge(status: str | None) -> Markup:
    if not status:
        return Markup("—")
    symbol, label = STATUS_LABELS.get(status, ("", status.replace("_", " ")))
    return Markup(
        '<span class="badge st-{}"><span aria-hidden="true">{}</span> {}</span>'
    ).format(status, symbol, label)


def _base(request: Request) -> str:
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/") + PREFIX


def _render(
    request: Request,
    template: str,
    context: Mapping[str, Any],
    *,
    session: Session | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    base = _base(request)
    html = TEMPLATES.get_template(template).render(
        {
            "base": base,
            "css_href": f"{base}/static/console.css?v={STYLESHEET_VERSION}",
            "session": session,
            "nav": "",
            "notice": None,
            "error": None,
            **context,
        }
    )
    return HTMLResponse(html, status_code=status_code)


def _message_page(
    request: Request, status_code: int, title: str, message: str, session: Session | None = None
) -> HTMLResponse:
    return _render(
        request,
        "message.html",
        {"title": title, "message": message, "status_code": status_code},
        session=session,
        status_code=status_code,
    )


class ConsoleRoute(APIRoute):
    """Console routes answer in HTML even when something fails, and carry strict headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response = await handler(request)
            except _DB_ERRORS as error:
                log.warning("console.database_unavailable", error=type(error).__name__)
                response = _message_page(
                    request,
                    503,
                    "Database unreachable",
                    "The database did not answer. Nothing was changed; try again shortly.",
                )
                response.headers["Retry-After"] = "2"
            except StarletteHTTPException as error:
                response = _message_page(
                    request, error.status_code, "Request refused", str(error.detail)
                )
            for name, value in SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            response.headers.setdefault("Cache-Control", "no-store")
            return response

        return guarded


def _target(routes: RouteTable, label: str) -> dict[str, str]:
    """What a route does and where: the action, and the host of an http route."""
    route = routes.by_label(label)
    if route is None:
        return {"route": label, "action": "unknown (route no longer configured)", "host": "—"}
    if route.action == "http" and route.url:
        return {
            "route": label,
            "action": f"http {route.method}",
            "host": urlsplit(route.url).netloc,
        }
    if route.action == "python":
        return {"route": label, "action": "python", "host": route.function or "—"}
    return {"route": label, "action": route.action, "host": "— (touches nothing)"}


def _clean(value: str | None) -> str | None:
    if value is None:
        return None
    value = value.strip()
    return value or None


def _lookup_key(engine: Engine, key: str) -> dict[str, Any] | None:
    """One key's public view and its dead-letter history (read-only)."""
    with engine.connect() as conn:
        row = conn.execute(queries.GET_KEY, {"key": key}).mappings().first()
        if row is None:
            return None
        history = conn.execute(oq.DEAD_LETTER_HISTORY, {"key": key}).mappings().all()
    found = dict(row)
    found["result"] = mask_secrets(found["result"])
    found["history"] = [dict(h) for h in history]
    return found


def _overview(engine: Engine) -> dict[str, Any]:
    return {
        "stats": stats.collect(engine),
        "minutes": charts.per_minute(engine),
        "stuck": stats.stuck(engine, STUCK_AFTER_SECONDS, limit=10),
    }


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=False, default=str)


def _split_keys(values: list[str]) -> list[str]:
    """Keys from ticked rows and from a textarea (one per line), in order, without repeats."""
    seen: dict[str, None] = {}
    for value in values:
        for line in value.splitlines():
            line = line.strip()
            if line:
                seen.setdefault(line, None)
    return list(seen)


class _ReplayForm:
    """The replay filter as typed, re-sent verbatim by the dry-run page's hidden fields."""

    def __init__(self, multi: Callable[[str], list[str]]) -> None:
        def one(name: str) -> str:
            values = multi(name)
            return (_clean(values[0]) or "") if values else ""

        self.statuses = [s for s in multi("statuses") if s]
        self.event_type = one("event_type")
        self.source = one("source")
        self.since = one("since")
        self.until = one("until")
        self.keys = _split_keys(multi("keys"))
        self.limit = one("limit") or "100"

    def request(self, *, confirm: str | None = None) -> replay.ReplayRequest:
        """The store's request; raises ValidationError with what is wrong."""
        document: dict[str, Any] = {
            "statuses": self.statuses or None,
            "event_type": self.event_type or None,
            "source": self.source or None,
            "since": self.since or None,
            "until": self.until or None,
            "keys": self.keys or None,
            "limit": self.limit,
            "dry_run": confirm is None,
            "confirm": confirm,
        }
        return replay.ReplayRequest.model_validate(document)


def _validation_messages(error: ValidationError) -> list[str]:
    messages = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"])
        text = item["msg"].removeprefix("Value error, ")
        messages.append(f"{field}: {text}" if field else text)
    return messages


def _strings(form: FormData) -> Callable[[str], list[str]]:
    """A form's text values by name (uploads are refused before this)."""
    return lambda name: [v for v in form.getlist(name) if isinstance(v, str)]


async def _read_form(request: Request) -> FormData:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_FORM_BYTES:
        raise StarletteHTTPException(413, "The form is too large.")
    return await request.form(max_files=0, max_fields=1100, max_part_size=MAX_FORM_BYTES)


def console_router(
    settings: Settings, routes: RouteTable, engine: Callable[[], Engine]
) -> APIRouter:
    """The console's pages under /console; `engine()` returns the sync engine of the app."""
    router = APIRouter(prefix=PREFIX, include_in_schema=False, route_class=ConsoleRoute)
    token = settings.operator_token

    def disabled(request: Request) -> HTMLResponse:
        return _message_page(
            request,
            503,
            "Console disabled",
            "The console is disabled: set OPERATOR_TOKEN to enable it (and the operator API).",
        )

    def to_sign_in(request: Request) -> RedirectResponse:
        base = _base(request)
        target = f"{base}/sign-in"
        if request.method == "GET":
            here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            target += "?" + urlencode({"next": here})
        return RedirectResponse(target, status_code=303)

    def gate(request: Request) -> Session | Response:
        """The caller's session, or the answer to give instead (disabled, or sign in)."""
        if not token:
            return disabled(request)
        found = verify(token, request.cookies.get(COOKIE_NAME))
        return found if found is not None else to_sign_in(request)

    async def gate_post(request: Request) -> tuple[Session, FormData] | Response:
        """A state-changing POST: a session, then its CSRF token (403 without)."""
        found = gate(request)
        if isinstance(found, Response):
            return found
        form = await _read_form(request)
        given = form.get("csrf")
        if not csrf_matches(found, given if isinstance(given, str) else None):
            log.warning("console.csrf_refused", path=request.url.path)
            return _message_page(
                request,
                403,
                "Form expired",
                "This form's security token is missing or not valid for your session. "
                "Nothing was changed. Open the page again and resubmit.",
                session=found,
            )
        return found, form

    def safe_next(request: Request, value: str | None) -> str:
        base = _base(request)
        if (
            value
            and (value == base or value.startswith(base + "/") or value.startswith(base + "?"))
            and "//" not in value
            and "\\" not in value
            and value.isprintable()
        ):
            return value
        return base

    @router.get("/static/console.css", name="console_css")
    async def stylesheet() -> Response:
        """The console's only asset (public: the sign-in page needs it)."""
        return Response(
            STYLESHEET,
            media_type="text/css; charset=utf-8",
            headers={"Cache-Control": "public, max-age=86400"},
        )

    @router.get("/sign-in")
    async def sign_in_page(request: Request) -> Response:
        if not token:
            return disabled(request)
        if verify(token, request.cookies.get(COOKIE_NAME)) is not None:
            return RedirectResponse(safe_next(request, request.query_params.get("next")), 303)
        notice = "You are signed out." if request.query_params.get("signed_out") else None
        return _render(
            request,
            "sign_in.html",
            {
                "title": "Sign in",
                "next": safe_next(request, request.query_params.get("next")),
                "notice": notice,
            },
        )

    @router.post("/sign-in")
    async def sign_in(request: Request) -> Response:
        # No CSRF token here: there is no session yet, and the operator token is the proof.
        if not token:
            return disabled(request)
        form = await _read_form(request)
        given = form.get("token")
        next_page = safe_next(request, str(form.get("next") or ""))
        if not isinstance(given, str) or not token_matches(token, given):
            log.warning("console.sign_in_refused")
            return _render(
                request,
                "sign_in.html",
                {"title": "Sign in", "next": next_page, "error": "That token is not valid."},
                status_code=401,
            )
        session = issue(token)
        response = RedirectResponse(next_page, status_code=303)
        response.set_cookie(
            COOKIE_NAME,
            session.value,
            max_age=SESSION_SECONDS,
            path=_base(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        log.info("console.signed_in")
        return response

    @router.post("/sign-out")
    async def sign_out(request: Request) -> Response:
        checked = await gate_post(request)
        if isinstance(checked, Response):
            return checked
        response = RedirectResponse(f"{_base(request)}/sign-in?signed_out=1", status_code=303)
        response.delete_cookie(
            COOKIE_NAME,
            path=_base(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @router.get("")
    @router.get("/")
    async def overview(request: Request) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        data = await run_in_threadpool(_overview, engine())
        minutes: list[charts.Minute] = data["minutes"]
        return _render(
            request,
            "overview.html",
            {
                "title": "Overview",
                "nav": "overview",
                "stats": data["stats"],
                "stuck": data["stuck"],
                "stuck_after": STUCK_AFTER_SECONDS,
                "chart": charts.render_svg(minutes),
                "minutes": [m for m in minutes if m.accepted or m.succeeded or m.failed],
                "totals": charts.totals(minutes),
                "kinds": DEAD_LETTER_KINDS,
            },
            session=session,
        )

    @router.get("/dead-letters")
    async def dead_letter_list(request: Request) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        params = request.query_params
        form = {
            name: (params.get(name) or "").strip()
            for name in ("event_type", "source", "kind", "status", "since", "until")
        }
        if "status" not in params:
            form["status"] = "open"
        errors: list[str] = []
        instants: dict[str, datetime | None] = {}
        for name in ("since", "until"):
            try:
                instants[name] = parse_instant(form[name]) if form[name] else None
            except ValueError as error:
                errors.append(f"{name}: {error}")
                instants[name] = None
        kind = form["kind"] if form["kind"] in DEAD_LETTER_KINDS else None
        if form["kind"] and kind is None:
            errors.append(f"kind: {form['kind']!r} is not a dead-letter kind")
        state = form["status"] if form["status"] in DEAD_LETTER_STATES else None
        if form["status"] not in ("", "any", *DEAD_LETTER_STATES):
            errors.append(f"status: {form['status']!r} is not open, replayed or discarded")
        cursor_text = params.get("cursor") or ""
        cursor = int(cursor_text) if cursor_text.isdigit() and int(cursor_text) > 0 else None
        limit_text = params.get("limit") or ""
        limit = (
            min(int(limit_text), deadletters.MAX_PAGE)
            if limit_text.isdigit() and int(limit_text) > 0
            else PAGE_SIZE
        )
        items: list[dict[str, Any]] = []
        next_cursor: int | None = None
        if not errors:
            where = deadletters.DeadLetterFilter(
                event_type=form["event_type"] or None,
                source=form["source"] or None,
                kind=cast(DeadLetterKind | None, kind),
                status=cast(DeadLetterState | None, state),
                since=instants["since"],
                until=instants["until"],
            )
            items, next_cursor = await run_in_threadpool(
                deadletters.list_dead_letters, engine(), where, limit, cursor
            )
        kept = {k: v for k, v in form.items() if v}
        if limit != PAGE_SIZE:
            kept["limit"] = str(limit)
        base = _base(request)
        replay_prefill = {
            k: form[k] for k in ("event_type", "source", "since", "until") if form[k]
        }
        statuses = (
            ["quarantined"]
            if kind == "quarantined"
            else ["failed_final"]
            if kind
            else ["failed_final", "quarantined"]
        )
        replay_href = (
            f"{base}/replays?"
            + urlencode([*replay_prefill.items(), *(("statuses", s) for s in statuses)])
        )
        return _render(
            request,
            "dead_letters.html",
            {
                "title": "Dead letters",
                "nav": "dead-letters",
                "form": form,
                "kinds": DEAD_LETTER_KINDS,
                "states": DEAD_LETTER_STATES,
                "items": items,
                "errors": errors,
                "first_page": cursor is not None,
                "first_href": f"{base}/dead-letters?{urlencode(kept)}",
                "next_href": (
                    f"{base}/dead-letters?{urlencode({**kept, 'cursor': next_cursor})}"
                    if next_cursor is not None
                    else None
                ),
                "replay_href": replay_href,
            },
            session=session,
            status_code=422 if errors else 200,
        )

    @router.get("/dead-letters/{dead_letter_id}")
    async def dead_letter_detail(request: Request, dead_letter_id: str) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        found = None
        if dead_letter_id.isdigit() and len(dead_letter_id) < 19:
            found = await run_in_threadpool(
                deadletters.get_dead_letter, engine(), int(dead_letter_id)
            )
        if found is None:
            return _message_page(
                request, 404, "Not found", "No dead letter has this id.", session=session
            )
        notice = None
        if request.query_params.get("discarded"):
            notice = "The dead letter was discarded."
        return _render(
            request,
            "dead_letter.html",
            {
                "title": f"Dead letter {found['id']}",
                "nav": "dead-letters",
                "d": found,
                "target": _target(routes, found["route"]),
                "payload": _pretty(found["payload"]),
                "replayable": found["key_status"] in REPLAYABLE,
                "notice": notice,
            },
            session=session,
        )

    @router.post("/dead-letters/{dead_letter_id}/discard")
    async def discard(request: Request, dead_letter_id: str) -> Response:
        checked = await gate_post(request)
        if isinstance(checked, Response):
            return checked
        session, form = checked
        if not dead_letter_id.isdigit() or len(dead_letter_id) >= 19:
            return _message_page(
                request, 404, "Not found", "No dead letter has this id.", session=session
            )
        reason = str(form.get("reason") or "").strip()
        if not 1 <= len(reason) <= 500:
            return _message_page(
                request,
                422,
                "A reason is needed",
                "Say in 1 to 500 characters why this dead letter is discarded. Nothing changed.",
                session=session,
            )
        done = await run_in_threadpool(
            deadletters.discard_dead_letter, engine(), int(dead_letter_id), reason, OPERATOR
        )
        if not done:
            return _message_page(
                request,
                409,
                "Not open",
                "This dead letter does not exist or is no longer open. Nothing changed.",
                session=session,
            )
        log.info("dead_letter.discarded", id=int(dead_letter_id), by=OPERATOR)
        return RedirectResponse(
            f"{_base(request)}/dead-letters/{dead_letter_id}?discarded=1", status_code=303
        )

    def replay_form_page(
        request: Request,
        session: Session,
        form: _ReplayForm,
        errors: list[str],
        status_code: int = 200,
    ) -> HTMLResponse:
        return _render(
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

    def report_page(
        request: Request,
        session: Session,
        form: _ReplayForm,
        report: replay.ReplayReport,
        *,
        stale: bool = False,
    ) -> HTMLResponse:
        return _render(
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

    @router.get("/replays")
    async def replay_form(request: Request) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        form = _ReplayForm(request.query_params.getlist)
        if not request.query_params:
            form.statuses = ["failed_final"]
        return replay_form_page(request, session, form, [])

    @router.post("/replays/dry-run")
    async def replay_dry_run(request: Request) -> Response:
        checked = await gate_post(request)
        if isinstance(checked, Response):
            return checked
        session, data = checked
        form = _ReplayForm(_strings(data))
        try:
            wanted = form.request()
        except ValidationError as error:
            return replay_form_page(request, session, form, _validation_messages(error), 422)
        report = await run_in_threadpool(replay.dry_run, engine(), wanted, routes)
        return report_page(request, session, form, report)

    @router.post("/replays/confirm")
    async def replay_confirm(request: Request) -> Response:
        checked = await gate_post(request)
        if isinstance(checked, Response):
            return checked
        session, data = checked
        form = _ReplayForm(_strings(data))
        confirm = str(data.get("confirm") or "").strip()
        try:
            wanted = form.request(confirm=confirm or None)
        except ValidationError as error:
            return replay_form_page(request, session, form, _validation_messages(error), 422)
        outcome = await run_in_threadpool(replay.execute, engine(), wanted, routes, OPERATOR)
        if isinstance(outcome, replay.Stale):
            log.info("replay.stale", by=OPERATOR)
            return report_page(request, session, form, outcome.report, stale=True)
        log.info(
            "replay.executed",
            replay_id=outcome.replay_id,
            by=OPERATOR,
            keys=len(outcome.report.to_replay),
        )
        return _render(
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

    @router.get("/keys")
    async def key_lookup(request: Request) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        key = (request.query_params.get("key") or "").strip()
        found = None
        if key:
            found = await run_in_threadpool(_lookup_key, engine(), key)
        return _render(
            request,
            "key.html",
            {
                "title": "Look up a key" if found is None else f"Key {keys.mask_key(key)}",
                "nav": "keys",
                "key": key,
                "k": found,
                "result": None if found is None else _pretty(found["result"]),
                "replayable": found is not None and found["status"] in REPLAYABLE,
            },
            session=session,
            status_code=404 if key and found is None else 200,
        )

    @router.api_route("/{rest:path}", methods=["GET", "POST"])
    async def not_found(request: Request, rest: str) -> Response:
        session = gate(request)
        if isinstance(session, Response):
            return session
        return _message_page(request, 404, "Not found", "There is no such page.", session=session)

    return router
