"""Rendering for the console: templates and their filters, the one stylesheet, HTML errors.

Every console route is a `ConsoleRoute`: whatever happens it answers in HTML (a database outage
is a 503 page, not a stack trace) and carries strict headers: a Content-Security-Policy that
allows no script and nothing from elsewhere, no framing, no referrer, no caching.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse, Response
from fastapi.routing import APIRoute
from markupsafe import Markup
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from outbox.core import keys
from outbox.core.logs import get_logger
from outbox.operate.console.session import Session

log = get_logger(__name__)

PREFIX = "/console"
HERE = Path(__file__).resolve().parent

SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
}

DB_ERRORS = (
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
    # A key never acted on because a newer version of its lane won, and its dead letter.
    "superseded": ("⤼", "superseded"),
    # A fan-out event's own key (it never runs), and an event some of whose deliveries failed.
    "fanned_out": ("⇉", "fanned out"),
    "partially_failed": ("◐", "partially failed"),
    "open": ("●", "open"),
    "replayed": ("↺", "replayed"),
    "discarded": ("⌀", "discarded"),
}


def when(value: datetime | str | None) -> Markup:
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


def seconds(value: float | int | None) -> str:
    """A duration for people: 0.4 s, 42 s, 3 min 5 s, 2 h 10 min."""
    if value is None:
        return "—"
    amount = float(value)
    if amount < 60:
        return f"{amount:.1f} s" if amount < 10 else f"{amount:.0f} s"
    minutes, rest = divmod(int(amount), 60)
    if minutes < 60:
        return f"{minutes} min {rest} s" if rest else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"


def status_badge(status: str | None) -> Markup:
    """A status as a badge: a symbol and a word, the colour only repeating them."""
    if not status:
        return Markup("—")
    symbol, label = STATUS_LABELS.get(status, ("", status.replace("_", " ")))
    return Markup('<span class="badge st-{}"><span aria-hidden="true">{}</span> {}</span>').format(
        status, symbol, label
    )


def pretty(value: Any) -> str:
    """JSON for reading: indented, Unicode kept."""
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = when
    env.filters["seconds"] = seconds
    env.filters["mask"] = keys.mask_key
    env.globals["status_badge"] = status_badge
    return env


TEMPLATES = _environment()
STYLESHEET = (HERE / "static" / "console.css").read_bytes()
STYLESHEET_VERSION = hashlib.sha256(STYLESHEET).hexdigest()[:12]


def base_path(request: Request) -> str:
    """Where the console is mounted, for links (a proxy's root_path included)."""
    root: str = request.scope.get("root_path", "")
    return root.rstrip("/") + PREFIX


def render(
    request: Request,
    template: str,
    context: Mapping[str, Any],
    *,
    session: Session | None = None,
    status_code: int = 200,
) -> HTMLResponse:
    """A page from its template; `session` shows the navigation and gives forms their CSRF."""
    base = base_path(request)
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


def message_page(
    request: Request, status_code: int, title: str, message: str, session: Session | None = None
) -> HTMLResponse:
    """A short page saying what happened (errors, refusals)."""
    return render(
        request,
        "message.html",
        {"title": title, "message": message, "status_code": status_code},
        session=session,
        status_code=status_code,
    )


def stylesheet_response() -> Response:
    return Response(
        STYLESHEET,
        media_type="text/css; charset=utf-8",
        headers={"Cache-Control": "public, max-age=86400"},
    )


class ConsoleRoute(APIRoute):
    """Console routes answer in HTML even when something fails, and carry strict headers."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response = await handler(request)
            except DB_ERRORS as error:
                log.warning("console.database_unavailable", error=type(error).__name__)
                response = message_page(
                    request,
                    503,
                    "Database unreachable",
                    "The database did not answer. Nothing was changed; try again shortly.",
                )
                response.headers["Retry-After"] = "2"
            except StarletteHTTPException as error:
                response = message_page(
                    request, error.status_code, "Request refused", str(error.detail)
                )
            for name, value in SECURITY_HEADERS.items():
                response.headers.setdefault(name, value)
            response.headers.setdefault("Cache-Control", "no-store")
            return response

        return guarded
