"""Signing in and out of the console, and the gate every other page goes through.

With OPERATOR_TOKEN unset the console is disabled (503 everywhere). Otherwise a page needs a
valid session cookie that was not signed out (else 303 to the sign-in page), and a
state-changing POST also needs the session's CSRF token (else 403, nothing changed). Failed
sign-ins count against the client's address with the operator API's failed tokens: past the
limit, a wrong token answers 429 with Retry-After; the right one always signs in
(outbox/core/access.py). Signing out revokes the session in the database, so a copy of the
cookie stops working too.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import Engine
from starlette.datastructures import FormData

from outbox.core.access import FailureThrottle, client_address
from outbox.core.logs import get_logger
from outbox.operate.console.forms import read_form
from outbox.operate.console.pages import base_path, message_page, render, stylesheet_response
from outbox.operate.console.revocations import is_revoked, revoke
from outbox.operate.console.session import (
    COOKIE_NAME,
    SESSION_SECONDS,
    Session,
    csrf_matches,
    issue,
    token_matches,
    verify,
)

log = get_logger(__name__)


class Gate:
    """Decides, for each request, between the page and disabled / sign in / forbidden."""

    def __init__(
        self, operator_token: str, engine: Callable[[], Engine], throttle: FailureThrottle
    ) -> None:
        self.token = operator_token
        self.engine = engine
        self.throttle = throttle

    def disabled(self, request: Request) -> HTMLResponse:
        return message_page(
            request,
            503,
            "Console disabled",
            "The console is disabled: set OPERATOR_TOKEN to enable it (and the operator API).",
        )

    def to_sign_in(self, request: Request) -> RedirectResponse:
        target = f"{base_path(request)}/sign-in"
        if request.method == "GET":
            here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            target += "?" + urlencode({"next": here})
        return RedirectResponse(target, status_code=303)

    async def session(self, request: Request) -> Session | None:
        """The request's session: signed, unexpired and not signed out."""
        found = verify(self.token, request.cookies.get(COOKIE_NAME))
        if found is None or await run_in_threadpool(is_revoked, self.engine(), found.value):
            return None
        return found

    async def page(self, request: Request) -> Session | Response:
        """The caller's session, or the answer to give instead (disabled, or sign in)."""
        if not self.token:
            return self.disabled(request)
        found = await self.session(request)
        return found if found is not None else self.to_sign_in(request)

    async def post(self, request: Request) -> tuple[Session, FormData] | Response:
        """A state-changing POST: a session, then its CSRF token (403 without)."""
        found = await self.page(request)
        if isinstance(found, Response):
            return found
        form = await read_form(request)
        given = form.get("csrf")
        if not csrf_matches(found, given if isinstance(given, str) else None):
            log.warning("console.csrf_refused", path=request.url.path)
            return message_page(
                request,
                403,
                "Form expired",
                "This form's security token is missing or not valid for your session. "
                "Nothing was changed. Open the page again and resubmit.",
                session=found,
            )
        return found, form


def safe_next(request: Request, value: str | None) -> str:
    """Where to go after signing in: a console page, never another site."""
    base = base_path(request)
    if (
        value
        and (value == base or value.startswith(base + "/") or value.startswith(base + "?"))
        and "//" not in value
        and "\\" not in value
        and value.isprintable()
    ):
        return value
    return base


def add_auth_routes(router: APIRouter, gate: Gate) -> None:
    """The stylesheet and the sign-in and sign-out pages (the only pages open without a
    session: the sign-in page and its stylesheet)."""

    @router.get("/static/console.css")
    async def stylesheet() -> Response:
        """The console's only asset."""
        return stylesheet_response()

    @router.get("/sign-in")
    async def sign_in_page(request: Request) -> Response:
        if not gate.token:
            return gate.disabled(request)
        next_page = safe_next(request, request.query_params.get("next"))
        if await gate.session(request) is not None:
            return RedirectResponse(next_page, status_code=303)
        notice = "You are signed out." if request.query_params.get("signed_out") else None
        return render(
            request, "sign_in.html", {"title": "Sign in", "next": next_page, "notice": notice}
        )

    @router.post("/sign-in")
    async def sign_in(request: Request) -> Response:
        # No CSRF token here: there is no session yet, and the operator token is the proof.
        if not gate.token:
            return gate.disabled(request)
        address = client_address(request)
        form = await read_form(request)
        given = form.get("token")
        next_page = safe_next(request, str(form.get("next") or ""))
        if not isinstance(given, str) or not token_matches(gate.token, given):
            # Compared first: the right token signs in whatever the throttle says.
            wait = gate.throttle.failed(address)
            if wait is not None:
                log.warning("console.sign_in_throttled", client=address, retry_after=wait)
                page = message_page(
                    request,
                    429,
                    "Too many attempts",
                    f"Too many failed sign-ins from your address. Try again in {wait} seconds.",
                )
                page.headers["Retry-After"] = str(wait)
                return page
            log.warning("console.sign_in_refused", client=address)
            return render(
                request,
                "sign_in.html",
                {"title": "Sign in", "next": next_page, "error": "That token is not valid."},
                status_code=401,
            )
        session = issue(gate.token)
        response = RedirectResponse(next_page, status_code=303)
        response.set_cookie(
            COOKIE_NAME,
            session.value,
            max_age=SESSION_SECONDS,
            path=base_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        log.info("console.signed_in", client=address)
        return response

    @router.post("/sign-out")
    async def sign_out(request: Request) -> Response:
        checked = await gate.post(request)
        if isinstance(checked, Response):
            return checked
        session, _ = checked
        await run_in_threadpool(revoke, gate.engine(), session.value, session.expires_at)
        log.info("console.signed_out", client=client_address(request))
        response = RedirectResponse(f"{base_path(request)}/sign-in?signed_out=1", status_code=303)
        response.delete_cookie(
            COOKIE_NAME,
            path=base_path(request),
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response
