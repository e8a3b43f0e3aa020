"""Notifications reach their targets once: batched dead letters, circuit and pause changes,
from two sweepers at once, and later when a target was down, without holding any key back."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from outbox.ingest.provider_signatures import StandardSigner
from outbox.operate import routestate
from outbox.store import routes as route_sql
from tests.support import (
    SIGNING_SECRET,
    Stack,
    envelope,
    query,
    run_idem,
    seed_pending_key,
    wait_until,
    write_routes,
)

# The shared routes file's downstream, which this test's routes file keeps.
DOWNSTREAM_URL = re.compile(r'url = "(http://[^"/]+)/tasks"')


class Target:
    """A local notification target: records every request; answers 503 while `down`."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.down = False
        self._lock = threading.Lock()
        target = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                with target._lock:
                    down = target.down
                    if not down:
                        target.requests.append((self.path, dict(self.headers.items()), body))
                self.send_response(503 if down else 200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"

    def bodies(self, path: str) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(body) for p, _, body in self.requests if p == path]

    def received(self, path: str) -> list[tuple[dict[str, str], bytes]]:
        with self._lock:
            return [(headers, body) for p, headers, body in self.requests if p == path]


@pytest.fixture
def target() -> Iterator[Target]:
    server = Target()
    yield server
    server.server.shutdown()
    server.server.server_close()


def routes_with_notify(path: Path, downstream_url: str, notify: str) -> Path:
    write_routes(path, downstream_url)
    path.write_text(path.read_text() + notify)
    return path


def notify_tables(target: Target, window: float = 60.0, on: str = '"dead_letters"') -> str:
    return f"""
[[notify]]
name = "slack"
url = "${{NOTIFY_SLACK_URL}}"
format = "slack"
on = [{on}]
window_seconds = {window}

[[notify]]
name = "hook"
url = "{target.url}/hook"
format = "json"
secret = "${{NOTIFY_SECRET}}"
on = [{on}]
window_seconds = {window}
"""


def use_routes(stack: Stack, tmp_path: Path, target: Target, notify: str) -> None:
    downstream_url = DOWNSTREAM_URL.search(stack.routes_file.read_text())
    assert downstream_url is not None
    stack.routes_file = routes_with_notify(tmp_path / "routes.toml", downstream_url[1], notify)
    stack.extra_env.update(NOTIFY_SLACK_URL=f"{target.url}/slack", NOTIFY_SECRET=SIGNING_SECRET)


def quarantine(stack: Stack, prefix: str, count: int) -> None:
    """`count` events the `strict` route quarantines at accept (no phone): dead letters."""
    with stack.client() as client:
        for i in range(count):
            event = envelope(f"{prefix}-{i}@example.com", "strict.signup")
            assert client.post("/v1/events", json=event).status_code == 202


def dead_letters(stack: Stack) -> int:
    return int(query(stack.database_url, "SELECT count(*) FROM dead_letters")[0][0])


def test_a_burst_of_dead_letters_is_one_message_per_target_from_two_sweepers(
    private_stack: Stack, tmp_path: Path, target: Target
) -> None:
    """50 dead letters, two sweepers running: each target gets one message counting all 50
    with five masked keys (Slack's shape; JSON signed), and the next dead letter comes in a
    second message no sooner than a window after the first."""
    stack = private_stack
    use_routes(stack, tmp_path, target, notify_tables(target, window=2))
    stack.start_receiver()
    quarantine(stack, "burst", 50)
    assert dead_letters(stack) == 50
    stack.start_sweeper("sweeper-a")
    stack.start_sweeper("sweeper-b")
    wait_until(lambda: len(target.bodies("/slack")) == 1 and len(target.bodies("/hook")) == 1)

    slack = target.bodies("/slack")[0]
    assert set(slack) == {"text", "blocks"}
    assert slack["text"].startswith("50 new dead letters (strict contract_violation x50)")
    assert slack["blocks"] == [
        {"type": "section", "text": {"type": "mrkdwn", "text": slack["text"]}}
    ]
    headers, body = target.received("/hook")[0]
    StandardSigner((SIGNING_SECRET,)).verify(headers, body)
    hook = json.loads(body)
    assert hook["type"] == "dead_letters" and hook["target"] == "hook"
    assert hook["data"]["total"] == 50
    assert hook["data"]["counts"] == [
        {"route": "strict", "error_code": "contract_violation", "count": 50}
    ]
    keys = hook["data"]["keys"]
    assert len(keys) == 5 and all("…" in key and "example.com" not in key for key in keys)
    assert headers["webhook-id"] == hook["id"]

    quarantine(stack, "later", 1)
    wait_until(lambda: len(target.bodies("/hook")) == 2, timeout=30)
    wait_until(lambda: len(target.bodies("/slack")) == 2, timeout=30)
    assert target.bodies("/hook")[1]["data"]["total"] == 1
    # A target has the message a moment before the sweeper marks its notice sent.
    sent = "SELECT count(*) FROM notices WHERE sent_at IS NOT NULL"
    wait_until(lambda: query(stack.database_url, sent)[0][0] == 4)
    spacing = query(
        stack.database_url,
        "SELECT target, EXTRACT(EPOCH FROM max(sent_at) - min(sent_at)), count(*)"
        " FROM notices GROUP BY target ORDER BY target",
    )
    assert [(name, n) for name, _, n in spacing] == [("hook", 2), ("slack", 2)]
    assert all(float(gap) >= 2 for _, gap, _ in spacing), spacing
    # Both sweepers ran passes the whole time; still one row and one message per batch.
    assert len(target.bodies("/slack")) == 2 and len(target.bodies("/hook")) == 2
    assert '"notify.pass"' in stack.logs("sweeper-a") + stack.logs("sweeper-b")
    assert target.url not in stack.logs("sweeper-a") + stack.logs("sweeper-b")


def test_a_circuit_that_opens_and_closes_is_two_messages(
    private_stack: Stack, tmp_path: Path, target: Target
) -> None:
    """The breaker's statement opens the route's circuit and a trial closes it: each target
    hears `circuit_opened` then `circuit_closed`, once, over two `idem sweep --once` runs; a
    pause and a resume come the same way to a target that asks for them."""
    stack = private_stack
    use_routes(stack, tmp_path, target, notify_tables(target, on='"circuit", "pause"'))
    engine = create_engine(stack.database_url.replace("postgresql://", "postgresql+psycopg://"))
    calls = {
        "route": "crm",
        "successes": 0,
        "window": 30.0,
        "minimum_calls": 3,
        "rate": 0.5,
        "trials": 1,
        "opens_now": False,
        "reason": "50% of the calls failed (http_503)",
        "cooldown": 0.01,
        "cooldown_cap": 1.0,
        "not_sent": False,
        "retry_after": None,
    }
    try:
        with engine.begin() as conn:
            conn.execute(route_sql.ENSURE_ROUTE, {"route": "crm", "max_in_flight": 1})
            opened = [
                conn.execute(route_sql.ROUTE_CALLS, {**calls, "key": f"k{i}", "failed": True})
                .one()
                .opened
                for i in range(3)
            ]
        assert opened == [False, False, True]

        def trial() -> bool:
            with engine.begin() as conn:
                params = {"route": "crm", "key": "k4", "trials": 1, "probe_seconds": 5}
                return conn.execute(route_sql.TAKE_TRIAL, params).first() is not None

        wait_until(trial)
        with engine.begin() as conn:
            row = conn.execute(route_sql.ROUTE_CALLS, {**calls, "key": "k4", "failed": False})
            assert row.one().closed
        routestate.pause(engine, "crm", "downstream migration", "ops@example.com")
        routestate.resume(engine, "crm", "ops@example.com")
    finally:
        engine.dispose()

    for _ in range(2):  # the second run finds nothing new to tell
        done = run_idem("sweep", "--once", env=stack.env())
        assert done.returncode == 0, done.stderr
    kinds = [body["type"] for body in target.bodies("/hook")]
    assert kinds == ["circuit_opened", "circuit_closed", "pause", "resume"]
    texts = [body["text"] for body in target.bodies("/slack")]
    assert texts == [
        "route crm: circuit opened (50% of the calls failed (http_503))",
        "route crm: circuit closed",
        "route crm paused by ops@example.com: downstream migration",
        "route crm resumed by ops@example.com",
    ]
    for headers, body in target.received("/hook"):
        StandardSigner((SIGNING_SECRET,)).verify(headers, body)


def test_a_target_that_is_down_is_retried_and_keys_keep_flowing(
    private_stack: Stack, tmp_path: Path, target: Target
) -> None:
    """While the target answers 503 the notice waits with its tries counted and events still
    succeed; once it is back the notice is delivered, once."""
    stack = private_stack
    use_routes(stack, tmp_path, target, notify_tables(target))
    target.down = True
    stack.start_all()
    stack.start_sweeper()
    quarantine(stack, "down", 3)
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM notices WHERE tries >= 1 AND last_error = 'http_503'",
            )
            == [(2,)]
        ),
        timeout=30,
    )
    with stack.client() as client:
        for i in range(10):
            assert client.post("/v1/events", json=envelope(f"flow-{i}")).status_code == 202
    wait_until(
        lambda: (
            query(
                stack.database_url,
                "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
            )
            == [(10,)]
        ),
        timeout=60,
    )
    assert query(stack.database_url, "SELECT count(*) FROM notices WHERE sent_at IS NULL") == [(2,)]
    target.down = False
    wait_until(lambda: len(target.bodies("/hook")) == 1, timeout=60)
    wait_until(lambda: len(target.bodies("/slack")) == 1, timeout=60)
    assert target.bodies("/hook")[0]["data"]["total"] == 3
    # The sweeper marks a notice sent just after the target has it.
    unsent = "SELECT count(*) FROM notices WHERE sent_at IS NULL"
    wait_until(lambda: query(stack.database_url, unsent) == [(0,)], timeout=30)
    assert (len(target.bodies("/hook")), len(target.bodies("/slack"))) == (1, 1)
    assert '"notify.send_failed"' in stack.logs("sweeper")
    assert target.url not in stack.logs("sweeper")


def test_stuck_keys_are_told_when_they_start_and_when_they_end(
    private_stack: Stack, tmp_path: Path, target: Target
) -> None:
    """Two keys untouched past `stuck_after_seconds` reach a threshold of two: one `stuck`
    notice with their masked keys, none more while they stay stuck, and one when they are
    finished."""
    stack = private_stack
    notify = notify_tables(target, on='"stuck"').replace(
        "window_seconds", "stuck_threshold = 2\nstuck_after_seconds = 60\nwindow_seconds"
    )
    use_routes(stack, tmp_path, target, notify)
    keys = [seed_pending_key(stack.database_url, f"stuck-{i}") for i in range(2)]
    sweep = ["sweep", "--once"]
    assert run_idem(*sweep, env=stack.env()).returncode == 0
    assert target.bodies("/hook") == []  # not untouched for a minute yet
    query(
        stack.database_url,
        "UPDATE idempotency_keys SET updated_at = now() - interval '2 minutes'",
    )
    for _ in range(2):
        assert run_idem(*sweep, env=stack.env()).returncode == 0
    raised = target.bodies("/hook")
    assert [(b["type"], b["data"]["raised"], b["data"]["count"]) for b in raised] == [
        ("stuck", True, 2)
    ]
    assert all("…" in key for key in raised[0]["data"]["keys"])
    assert not set(raised[0]["data"]["keys"]) & set(keys)
    query(stack.database_url, "UPDATE idempotency_keys SET status = 'succeeded'")
    assert run_idem(*sweep, env=stack.env()).returncode == 0
    assert [b["data"]["raised"] for b in target.bodies("/hook")] == [True, False]
    assert [b["text"] for b in target.bodies("/slack")][-1] == "no more stuck keys"
