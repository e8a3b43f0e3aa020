"""Who may call what: throttled credentials, token length at start-up, sign-out that revokes,
API docs off in production, and /metrics behind its token."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import AUTH, OPERATOR_TOKEN, ROOT, Stack, refused_start

METRICS_TOKEN = "metrics-token-0123456789abcdef-0123"


@pytest.fixture
def guarded(
    database_url: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> Iterator[Stack]:
    """A receiver of its own: three failed credentials per address, a metrics token."""
    stack = Stack(
        database_url,
        redis_url,
        routes_file,
        tmp_path,
        extra_env={"AUTH_FAILURE_LIMIT": "3", "METRICS_TOKEN": METRICS_TOKEN},
    )
    stack.start_receiver()
    yield stack
    stack.stop_all()


def _from(address: str) -> dict[str, str]:
    """Headers of a request forwarded for `address` (uvicorn trusts its loopback proxy)."""
    return {"X-Forwarded-For": address}


def test_wrong_tokens_and_sign_ins_are_throttled_per_address(guarded: Stack) -> None:
    """After three wrong credentials from one address (operator token, metrics token, console
    sign-in alike) that address's next wrong ones get 429 with Retry-After, while the right
    tokens still pass from it; another address is not affected; the refusals are logged with
    the client's address."""
    attacker, operator = _from("203.0.113.7"), _from("198.51.100.20")
    with guarded.client() as client:
        wrong = [
            client.get("/v1/stats", headers={"Authorization": "Bearer guess-1", **attacker}),
            client.get("/metrics", headers={"Authorization": "Bearer guess-2", **attacker}),
            client.post("/console/sign-in", data={"token": "guess-3"}, headers=attacker),
        ]
        assert [a.status_code for a in wrong] == [401, 401, 401]
        held = [
            client.get("/v1/stats", headers={"Authorization": "Bearer guess-4", **attacker}),
            client.post("/console/sign-in", data={"token": "guess-5"}, headers=attacker),
            client.get("/metrics", headers={"Authorization": "Bearer guess-6", **attacker}),
        ]
        api = client.get("/v1/stats", headers={**AUTH, **attacker})
        metrics = client.get(
            "/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}", **attacker}
        )
        elsewhere = client.get("/v1/stats", headers={"Authorization": "Bearer typo", **operator})
    for answer in held:
        assert answer.status_code == 429, answer.text[:300]
        assert 1 <= int(answer.headers["retry-after"]) <= 300
    assert held[0].json()["error"] == "too_many_failures"
    assert "idem_console" not in held[1].headers.get("set-cookie", "")
    assert (api.status_code, metrics.status_code) == (200, 200)
    assert elsewhere.status_code == 401
    logs = [json.loads(line) for line in guarded.logs("receiver").splitlines() if "{" in line]
    refused = [line for line in logs if line.get("event") == "console.sign_in_refused"]
    assert [line.get("client") for line in refused] == ["203.0.113.7"]
    assert "guess-3" not in guarded.logs("receiver")


def test_metrics_need_the_metrics_token_when_it_is_set(guarded: Stack) -> None:
    """With METRICS_TOKEN set, /metrics answers 401 without it and the Prometheus text with it."""
    with guarded.client() as client:
        anonymous = client.get("/metrics")
        scraped = client.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert anonymous.status_code == 401
    assert anonymous.json()["error"] == "unauthorized"
    assert scraped.status_code == 200
    assert "idem_events_accepted_total" in scraped.text


def test_metrics_without_a_token_are_for_loopback_clients_only(stack: Stack) -> None:
    """With METRICS_TOKEN unset, /metrics answers this machine only: a client forwarded from
    elsewhere gets 403 metrics_forbidden."""
    with stack.client() as client:
        local = client.get("/metrics")
        remote = client.get("/metrics", headers=_from("203.0.113.7"))
    assert local.status_code == 200
    assert remote.status_code == 403
    assert remote.json()["error"] == "metrics_forbidden"


def test_sign_out_revokes_the_session_for_every_copy_of_the_cookie(stack: Stack) -> None:
    """After signing out, a copy of the session cookie taken before gets the sign-in page, not
    the console."""
    with httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False) as client:
        signed_in = client.post("/console/sign-in", data={"token": OPERATOR_TOKEN})
        assert signed_in.status_code == 303
        cookie = client.cookies["idem_console"]
        page = client.get("/console")
        assert page.status_code == 200
        csrf = page.text.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        assert client.post("/console/sign-out", data={"csrf": csrf}).status_code == 303
    with httpx.Client(base_url=stack.url, timeout=15, follow_redirects=False) as copy:
        copy.cookies.set("idem_console", cookie, path="/console")
        answer = copy.get("/console")
    assert answer.status_code == 303
    assert answer.headers["location"].startswith("/console/sign-in")


@pytest.mark.parametrize("name", ["OPERATOR_TOKEN", "METRICS_TOKEN"])
def test_a_short_token_stops_the_start_with_how_to_make_one(name: str, tmp_path: Path) -> None:
    """`idem serve` with a token shorter than 32 characters exits 2, naming the setting and the
    command that makes a good one, before it binds a port."""
    env = dict(
        os.environ,
        DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        REDIS_URL="redis://127.0.0.1:1/0",
        ROUTES_FILE="",
        OPERATOR_TOKEN=OPERATOR_TOKEN,
        PYTHONPATH=str(ROOT),
    )
    env[name] = "too-short-token"
    run = refused_start(tmp_path, env)
    assert run.returncode == 2, run.stderr
    assert name in run.stderr
    assert "secrets.token_urlsafe(32)" in run.stderr


def test_api_docs_are_off_unless_asked_for(
    stack: Stack, database_url: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """/docs and /openapi.json answer 404 by default and 200 with API_DOCS=true, and /docs
    loads Swagger UI from the gateway itself, never from another host."""
    paths = ["/docs", "/openapi.json", "/docs/assets/swagger-ui-bundle.js"]
    with stack.client() as client:
        assert [client.get(p).status_code for p in paths] == [404, 404, 404]
    documented = Stack(
        database_url, redis_url, routes_file, tmp_path, extra_env={"API_DOCS": "true"}
    )
    documented.start_receiver()
    try:
        with documented.client() as client:
            assert [client.get(p).status_code for p in paths] == [200, 200, 200]
            assert "/v1/events" in client.get("/openapi.json").json()["paths"]
            page = client.get("/docs").text
            assets = re.findall(r'(?:src|href)="([^"]+)"', page)
            assert assets, page
            assert all(asset.startswith("/docs/assets/") for asset in assets), assets
            assert "://" not in page, page
            assert client.get("/docs/assets/swagger-ui.css").status_code == 200
    finally:
        documented.stop_all()
