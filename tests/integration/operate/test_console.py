"""The operator console end to end: Debian's headless Chromium, driven by Playwright, against a
real receiver, PostgreSQL, relay and worker. Dead letters come from real failures at the fake
downstream. Every page visited is saved as a screenshot under test-artifacts/console/."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from outbox.core.keys import mask_key
from outbox.core.routes import load_routes
from outbox.core.settings import Settings
from outbox.operate.console import console_router
from tests.support import (
    OPERATOR_TOKEN,
    ROOT,
    Downstream,
    Reply,
    Stack,
    envelope,
    query,
    seed_lane_key,
    wait_until,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page

ARTIFACTS = ROOT / "test-artifacts" / "console"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAPTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Debian's Chromium under Playwright; missing either is a failure, never a skip."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(
            "Playwright for Python is not installed: `make install` installs it (dev extra), "
            "or `.venv/bin/pip install -e '.[dev]'`.",
            pytrace=False,
        )
    if not CHROMIUM.is_file():
        pytest.fail(
            f"Debian's chromium is missing at {CHROMIUM}: `make test` as root installs it"
            " (`make browser`), or run `apt-get update && apt-get install -y"
            " --no-install-recommends chromium`."
            " No browser is downloaded.",
            pytrace=False,
        )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def _shot(page: Page, name: str) -> None:
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _fail(stack: Stack, downstream: Downstream, external_id: str) -> str:
    """Post an event whose action answers 422 and wait for its dead letter; returns its key."""
    downstream.behaviour = lambda key, n: Reply(422)
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope(external_id, "plain.lead"))
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM dead_letters"
                " WHERE idempotency_key = %s AND resolution = 'open'",
                (key,),
            )
            == [(1,)]
        ),
        timeout=30,
    )
    return key


def _dead_letter_id(stack: Stack, key: str) -> int:
    rows = query(
        stack.database_url,
        "SELECT id FROM dead_letters WHERE idempotency_key = %s ORDER BY id DESC LIMIT 1",
        (key,),
    )
    return int(rows[0][0])


def _key_status(stack: Stack, key: str) -> str:
    rows = query(
        stack.database_url, "SELECT status FROM idempotency_keys WHERE idempotency_key = %s", (key,)
    )
    return str(rows[0][0])


def _follow(page: Page, target: Locator) -> None:
    """Click what leads to another page and wait until that page has loaded. A click returns
    once the navigation has started; a read before the new page loaded reads the old page or
    an empty document (`page.content()` returned '' on a busy machine)."""
    with page.expect_navigation():
        target.click()


def _sign_in(page: Page, stack: Stack, path: str = "/console") -> None:
    page.goto(stack.url + path)
    assert "/console/sign-in" in page.url, page.url
    page.get_by_label("Operator token").fill(OPERATOR_TOKEN)
    _follow(page, page.get_by_role("button", name="Sign in"))
    assert "/console/sign-in" not in page.url, page.content()


def _wait_for_done(page: Page) -> None:
    """The replay's result page. A confirm posts to the URL its page was loaded from, so the
    URL cannot tell the result from the page before it: wait for the result's heading (a
    click returns once the post is sent, and a busy machine answered after the check)."""
    done = page.get_by_role("heading", name=re.compile(r"Replay \d+ done"))
    done.wait_for(state="visible", timeout=30_000)
    assert done.is_visible()


def _no_engine() -> Any:
    raise AssertionError("a page without a session must not reach the database")


@contextlib.contextmanager
def _session_client(stack: Stack) -> Iterator[httpx.Client]:
    """An httpx client holding a console session, signed in through the form."""
    with httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False) as client:
        answer = client.post("/console/sign-in", data={"token": OPERATOR_TOKEN})
        assert answer.status_code == 303, answer.text
        assert "idem_console" in client.cookies
        yield client


def test_replay_a_dead_letter_from_the_console(
    stack: Stack, downstream: Downstream, browser: Browser
) -> None:
    """An operator signs in, finds a route's dead letter, dry-runs its replay, fixes the route,
    confirms, and sees the key succeed, on a laptop and on a phone."""
    key = _fail(stack, downstream, "console-1")
    dead_letter = _dead_letter_id(stack, key)
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()

    page.goto(stack.url + "/console/dead-letters")
    assert "/console/sign-in?next=%2Fconsole%2Fdead-letters" in page.url
    _shot(page, "01-sign-in")
    page.get_by_label("Operator token").fill("not-the-token")
    _follow(page, page.get_by_role("button", name="Sign in"))
    assert "That token is not valid." in page.content()
    page.get_by_label("Operator token").fill(OPERATOR_TOKEN)
    page.keyboard.press("Enter")  # the keyboard is enough
    page.wait_for_url("**/console/dead-letters")

    _follow(page, page.get_by_role("link", name="Overview"))
    assert page.get_by_role("heading", name="Overview").is_visible()
    page.keyboard.press("Tab")  # the first stop is the skip link, with a visible focus ring
    focused = page.evaluate(
        "(e => [e.textContent, getComputedStyle(e).outlineStyle])(document.activeElement)"
    )
    assert focused[0] == "Skip to content" and focused[1] != "none", focused
    open_card = page.locator(".card").filter(has_text="open dead letters")
    assert open_card.inner_text().split()[0] == "1"
    assert page.locator(".wide-only svg.chart polyline").count() == 3
    _shot(page, "02-overview")

    _follow(
        page,
        page.get_by_role("navigation", name="Console").get_by_role("link", name="Dead letters"),
    )
    page.get_by_label("Event type").fill("plain.*")
    _follow(page, page.get_by_role("button", name="Filter"))
    row = page.get_by_role("row").filter(has_text=f"Dead letter {dead_letter}")
    assert "http_422" in row.inner_text() and "open" in row.inner_text()
    _shot(page, "03-dead-letters")

    # Ticked rows make a replay filter of their keys.
    page.get_by_label(f"Select dead letter {dead_letter} for replay").check()
    _follow(page, page.get_by_role("button", name="Dry-run replay of ticked rows"))
    assert page.locator(".card.ok .big").inner_text() == "1"
    page.go_back()

    _follow(page, page.get_by_role("link", name=f"Dead letter {dead_letter}", exact=True))
    detail = page.content()
    assert "http_422" in detail
    assert "console-1@example.com" in detail  # the payload, pretty-printed
    assert f"127.0.0.1:{downstream.port}" in detail  # the route's target host
    assert page.get_by_role("heading", name="History of this key's dead letters").is_visible()
    _shot(page, "04-detail")

    _follow(page, page.get_by_role("button", name="Dry-run a replay of this key"))
    assert page.get_by_role("heading", name="Replay: dry run").is_visible()
    assert page.locator(".card.ok .big").inner_text() == "1"
    assert "http 127.0.0.1" in page.content()  # counted by target
    assert _key_status(stack, key) == "failed_final"  # a dry run changes nothing
    _shot(page, "05-dry-run")

    downstream.behaviour = None  # the route is fixed
    _follow(page, page.get_by_role("button", name="Confirm replay of 1 key"))
    _wait_for_done(page)
    _shot(page, "06-result")

    _follow(page, page.locator("ol.keys").get_by_role("link").first)
    assert "/console/keys?key=" in page.url

    def succeeded() -> bool:
        page.reload()
        return "succeeded" in page.locator("h2 .badge").inner_text()

    wait_until(succeeded, timeout=30, interval=0.5)
    assert "replayed" in page.locator("ol.timeline").inner_text()
    _shot(page, "07-key")
    assert downstream.effects[key] == 1
    assert query(
        stack.database_url,
        "SELECT resolution, resolved_by FROM dead_letters WHERE id = %s",
        (dead_letter,),
    ) == [("replayed", "console")]
    assert query(stack.database_url, "SELECT requested_by, key_count FROM replays") == [
        ("console", 1)
    ]

    phone = browser.new_context(
        viewport=PHONE, storage_state=context.storage_state(), is_mobile=True, has_touch=True
    )
    small = phone.new_page()
    small.goto(stack.url + "/console")
    assert small.get_by_role("heading", name="Overview").is_visible()
    assert small.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    _shot(small, "08-overview-phone")
    small.goto(stack.url + "/console/dead-letters?status=any")
    assert small.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    _shot(small, "09-dead-letters-phone")
    phone.close()
    context.close()


def test_a_stale_confirm_shows_the_fresh_report(
    stack: Stack, downstream: Downstream, browser: Browser
) -> None:
    """A failure added between the dry run and the confirm replays nothing and shows the fresh
    report, whose own confirm then replays both."""
    first = _fail(stack, downstream, "stale-1")
    context = browser.new_context(viewport=LAPTOP)
    page = context.new_page()
    _sign_in(page, stack, "/console/replays")
    assert page.get_by_label("failed final").is_checked()
    page.get_by_label("Event type").fill("plain.*")
    _shot(page, "10-replay-form")
    _follow(page, page.get_by_role("button", name="Dry run"))
    assert page.locator(".card.ok .big").inner_text() == "1"

    second = _fail(stack, downstream, "stale-2")
    downstream.behaviour = None
    _follow(page, page.get_by_role("button", name="Confirm replay of 1 key"))
    assert "The set changed since the dry run; nothing was replayed." in page.content()
    assert page.locator(".card.ok .big").inner_text() == "2"
    _shot(page, "11-stale-report")
    assert {_key_status(stack, k) for k in (first, second)} == {"failed_final"}
    assert query(stack.database_url, "SELECT count(*) FROM replays") == [(0,)]

    _follow(page, page.get_by_role("button", name="Confirm replay of 2 keys"))
    _wait_for_done(page)
    wait_until(lambda: {_key_status(stack, k) for k in (first, second)} == {"succeeded"})
    context.close()


def test_every_console_page_needs_a_session(stack: Stack, routes_file: Path) -> None:
    """Every console route, for every method, sends a caller without a valid session to the
    sign-in page (303), and the session cookie is HttpOnly, SameSite=Strict and expires."""
    console = console_router(
        Settings(operator_token="x"), load_routes(routes_file), lambda: _no_engine()
    )
    open_paths = {"/console/sign-in", "/console/static/console.css"}
    checked: list[tuple[str, str]] = []
    anonymous = httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False)
    forged = httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False)
    # Well formed, but signed with another key, and one signed with nothing at all.
    forged.cookies.set("idem_console", "v1.9999999999.abc." + "0" * 64, path="/console")
    with anonymous, forged:
        for route in console.routes:
            path: str = getattr(route, "path", "")
            if not path.startswith("/console") or path in open_paths:
                continue
            concrete = path.replace("{dead_letter_id}", "1").replace("{rest:path}", "elsewhere")
            for method in sorted(getattr(route, "methods", set()) - {"HEAD"}):
                for client in (anonymous, forged):
                    answer = client.request(method, concrete)
                    assert answer.status_code == 303, (method, concrete, answer.text)
                    location = answer.headers["location"]
                    assert location.startswith("/console/sign-in"), (method, concrete, location)
                checked.append((method, concrete))
    assert {
        ("GET", "/console"),
        ("GET", "/console/dead-letters"),
        ("GET", "/console/dead-letters/1"),
        ("POST", "/console/dead-letters/1/discard"),
        ("GET", "/console/replays"),
        ("POST", "/console/replays/dry-run"),
        ("POST", "/console/replays/confirm"),
        ("GET", "/console/keys"),
        ("POST", "/console/sign-out"),
        ("GET", "/console/elsewhere"),
    } <= set(checked)

    with httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False) as client:
        wrong = client.post("/console/sign-in", data={"token": "nope"})
        assert wrong.status_code == 401 and "idem_console" not in wrong.headers.get(
            "set-cookie", ""
        )
        right = client.post("/console/sign-in", data={"token": OPERATOR_TOKEN})
        cookie = right.headers["set-cookie"].lower()
    assert right.status_code == 303
    for attribute in ("httponly", "samesite=strict", "path=/console", "max-age=28800"):
        assert attribute in cookie, cookie
    assert "secure" not in cookie  # plain http here; https requests get Secure


def test_a_post_without_the_csrf_token_is_refused(
    stack: Stack, downstream: Downstream, browser: Browser
) -> None:
    """A signed-in POST without, or with a wrong, CSRF token gets 403 and changes nothing; the
    detail page's own form discards with a reason."""
    key = _fail(stack, downstream, "csrf-1")
    dead_letter = _dead_letter_id(stack, key)
    with _session_client(stack) as client:
        page = client.get(f"/console/dead-letters/{dead_letter}")
        assert page.status_code == 200
        match = re.search(r'name="csrf" value="([0-9a-f]{64})"', page.text)
        assert match is not None
        posts: list[tuple[str, dict[str, Any]]] = [
            (f"/console/dead-letters/{dead_letter}/discard", {"reason": "forged"}),
            ("/console/replays/dry-run", {"keys": key}),
            ("/console/replays/confirm", {"keys": key, "confirm": "rp1_x"}),
            ("/console/sign-out", {}),
        ]
        for path, form in posts:
            real = match.group(1)
            # A token one character off the real one (never equal to it).
            near = real[:-1] + ("1" if real[-1] == "0" else "0")
            for csrf in (None, "0" * 64, near):
                body = form if csrf is None else {**form, "csrf": csrf}
                answer = client.post(path, data=body)
                assert answer.status_code == 403, (path, csrf, answer.text)
        # Still signed in (sign-out was refused too), and nothing changed.
        assert client.get("/console").status_code == 200
    assert query(
        stack.database_url, "SELECT resolution FROM dead_letters WHERE id = %s", (dead_letter,)
    ) == [("open",)]
    assert query(stack.database_url, "SELECT count(*) FROM replays") == [(0,)]

    context = browser.new_context(viewport=LAPTOP)
    browser_page = context.new_page()
    _sign_in(browser_page, stack, f"/console/dead-letters/{dead_letter}")
    browser_page.get_by_label("Reason for discarding").fill("test data from a form check")
    _follow(browser_page, browser_page.get_by_role("button", name="Discard this dead letter"))
    assert "The dead letter was discarded." in browser_page.content()
    assert "test data from a form check" in browser_page.content()
    _follow(browser_page, browser_page.get_by_role("button", name="Sign out"))
    assert "You are signed out." in browser_page.content()
    browser_page.goto(stack.url + "/console")
    assert "/console/sign-in" in browser_page.url
    context.close()
    assert query(
        stack.database_url,
        "SELECT resolution, resolved_by, resolution_note FROM dead_letters WHERE id = %s",
        (dead_letter,),
    ) == [("discarded", "console", "test data from a form check")]


def test_the_console_is_disabled_without_a_token(
    stack: Stack, routes_file: Path, tmp_path: Path
) -> None:
    """With OPERATOR_TOKEN unset the console says it is disabled (503) on every page."""
    closed = Stack(
        stack.database_url,
        stack.broker_url,
        routes_file,
        tmp_path,
        extra_env={"OPERATOR_TOKEN": ""},
    )
    closed.start_receiver()
    try:
        with closed.client() as client:
            answers = [
                client.get("/console/sign-in"),
                client.post("/console/sign-in", data={"token": ""}),
                client.get("/console"),
                client.get("/console/dead-letters"),
            ]
    finally:
        closed.stop_all()
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert "The console is disabled" in answer.text


def test_the_overview_pauses_and_resumes_a_route_with_its_csrf_token(stack: Stack) -> None:
    """The overview lists the routes; its pause form needs the session's CSRF token and a
    reason, pauses the route on record, and the resume form undoes it."""
    with _session_client(stack) as client:
        page = client.get("/console")
        assert page.status_code == 200 and "<code>crm</code>" in page.text
        match = re.search(r'name="csrf" value="([0-9a-f]{64})"', page.text)
        assert match is not None
        forged = client.post("/console/routes/crm/pause", data={"reason": "x", "csrf": "0" * 64})
        assert forged.status_code == 403
        csrf = match.group(1)
        empty = client.post("/console/routes/crm/pause", data={"reason": " ", "csrf": csrf})
        assert empty.status_code == 422
        unknown = client.post("/console/routes/nope/pause", data={"reason": "x", "csrf": csrf})
        assert unknown.status_code == 404
        paused = client.post(
            "/console/routes/crm/pause", data={"reason": "CRM upgrade", "csrf": csrf}
        )
        assert paused.status_code == 303
        shown = client.get(paused.headers["location"])
        assert "The route is paused." in shown.text and "CRM upgrade" in shown.text
        resumed = client.post("/console/routes/crm/resume", data={"csrf": csrf})
        assert resumed.status_code == 303
    assert query(
        stack.database_url, "SELECT route, action, requested_by FROM route_changes ORDER BY id"
    ) == [("crm", "pause", "console"), ("crm", "resume", "console")]
    assert query(stack.database_url, "SELECT paused FROM route_state WHERE route = 'crm'") == [
        (False,)
    ]


def test_the_console_shows_superseded_keys_and_blocked_lanes(stack: Stack) -> None:
    """The overview counts superseded keys and lists a blocked lane once with its masked head
    and the keys waiting behind it; a key's page shows its lane and the version that won; the
    dead-letter list filters on `superseded`."""
    db = stack.database_url
    old = seed_lane_key(db, "c1-v1", "superseded", lane="contact-1", rank=1, superseded_by="3")
    query(
        db,
        "INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts, first_failed_at,"
        " last_failed_at, resolution, resolved_by, resolved_at)"
        " VALUES (%s, 'permanent', 'http_422', 1, now(), now(), 'superseded', 'lane', now())"
        " RETURNING id",
        (old,),
    )
    (superseded_letter,) = query(db, "SELECT id FROM dead_letters")[0]
    head = seed_lane_key(
        db, "c2-v1", "quarantined", lane="contact-2", rank=1, error_code="contract_violation"
    )
    for n in (2, 3, 4):
        seed_lane_key(
            db, f"c2-v{n}", "pending", lane="contact-2", rank=n, error_code="lane_waiting"
        )
    with _session_client(stack) as client:
        overview = client.get("/console").text
        key_page = client.get("/console/keys", params={"key": old}).text
        superseded = client.get("/console/dead-letters", params={"status": "superseded"}).text
        bad_filter = client.get("/console/dead-letters", params={"status": "gone"})
    counts = re.search(r"st-superseded.*?</td><td class=\"num\">(\d+)</td>", overview)
    assert counts is not None and counts.group(1) == "1"
    lanes = overview[overview.index('id="lanes-heading"') :]
    assert "<code>contact-2</code>" in lanes and mask_key(head) in lanes and head not in lanes
    assert "<code>contract_violation</code>" in lanes
    assert '<td class="num">3</td>' in lanes
    assert "contact-1" not in lanes
    assert "<dt>Lane</dt><dd><code>contact-1</code></dd>" in key_page
    assert "<dt>Superseded by version</dt><dd><code>3</code>" in key_page
    assert re.findall(r">Dead letter (\d+)</a>", superseded) == [str(superseded_letter)]
    assert bad_filter.status_code == 422
    assert "open, replayed, discarded, superseded" in bad_filter.text
