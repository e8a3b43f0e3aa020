"""Helpers for tests that run the real processes: servers, a fake downstream, waiting."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import psycopg
from sqlalchemy import Engine, event, make_url

from outbox.store.ports import free_port, wait_for_port
from tests.pooler import pooled_url

ROOT = Path(__file__).resolve().parent.parent
# At least 32 characters, or the receiver refuses to start.
OPERATOR_TOKEN = "test-operator-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
CLAIMS_TOKEN = "test-claims-token-0123456789abcdef-xyz"
WEBHOOK_SECRET = "whsec_test_0123456789abcdef-signed-source"
# The providers' sources in the test routes file (`write_routes`): name -> (scheme, secret).
PROVIDER_SECRETS = {
    "acme": ("standard", "whsec_dGVzdCBrZXkgYnl0ZXMgZm9yIGFjbWUgaG9va3M="),
    "stripe": ("stripe", "whsec_stripe_test_0123456789abcdef"),
    "github": ("github", "github-test-secret-0123456789abcdef"),
    "shopify": ("shopify", "shopify-test-secret-0123456789abcdef"),
}


def run_idem(
    *args: str, env: dict[str, str], cwd: Path = ROOT, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`idem <args>` as a process of its own (in the project's folder unless `cwd`), its output
    captured."""
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.1) -> Any:
    """Poll `condition` until it returns something truthy; fail with the last value."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last value: {value!r})")
        time.sleep(interval)
        value = condition()
    return value


def libpq(url: str) -> str:
    """A SQLAlchemy URL as a libpq URL, for psycopg in the tests."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def query(database_url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchall() if cur.description else []


def seed_due_outbox(
    database_url: str, rows: int, *, waited: str = "0 seconds", first: int = 1
) -> None:
    """`rows` due outbox rows with their keys (`k-<first>` on), each due since `waited` ago:
    the relay's work, with no event behind it (a relay never reads one)."""
    params = {"first": first, "last": first + rows - 1, "waited": waited}
    query(
        database_url,
        """
        INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,
                                      event_type, route, expires_at)
        SELECT 'k-' || g, 'h', 'c-' || g, 's', 'e', 'default', now() + interval '1 day'
          FROM generate_series(%(first)s::int, %(last)s::int) g
        """,
        params,
    )
    query(
        database_url,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)"
        " SELECT 'k-' || g, 'idem.process', 'c-' || g, now() - CAST(%(waited)s AS interval)"
        "   FROM generate_series(%(first)s::int, %(last)s::int) g",
        params,
    )


def queued_tasks(broker: Any) -> list[tuple[str, list[Any]]]:
    """(task name, args) of each message waiting in a Redis broker's task queue, oldest first:
    what the relay published and no worker took."""
    from outbox.core.wire import TASK_QUEUE

    frames = [json.loads(m) for m in reversed(broker.lrange(TASK_QUEUE, 0, -1))]
    return [(f["headers"]["task"], json.loads(base64.b64decode(f["body"]))[0]) for f in frames]


def queued_keys(broker: Any) -> list[str]:
    """The keys of every message waiting in a Redis broker's task queue, oldest first: one
    message's key, or the keys of a message that carries several (`idem.process_keys`)."""
    from outbox.core.wire import PROCESS_KEYS_TASK

    return [
        key
        for name, args in queued_tasks(broker)
        for key in (args[0] if name == PROCESS_KEYS_TASK else args)
    ]


def seed_pending_key(database_url: str, external_id: str) -> str:
    """A pending key with its event, written directly (no outbox row, so no worker sees it);
    returns the key."""
    key = f"webform:crm.lead.created:{external_id}"
    query(
        database_url,
        "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,"
        " event_type, route, expires_at)"
        " VALUES (%s, 'h', %s, 'webform', 'crm.lead.created', 'crm', now() + interval '1 day')",
        (key, f"corr-{external_id}"),
    )
    query(
        database_url,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        """ VALUES (%s, 'webform', 'crm.lead.created', %s, '{"email": "a@b.c"}')""",
        (key, external_id),
    )
    return key


def seed_expired_keys(database_url: str, count: int) -> None:
    """`count` succeeded keys whose TTL ran out ten days ago, with their events (no outbox
    row): what a purge removes."""
    query(
        database_url,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, created_at, updated_at, expires_at)"
        " SELECT 'webform:crm.lead.created:' || i, 'succeeded', 'h', 'corr-' || i, 'webform',"
        " 'crm.lead.created', 'crm', now() - interval '40 days', now() - interval '40 days',"
        " now() - interval '10 days' FROM generate_series(1, %s) i",
        (count,),
    )
    query(
        database_url,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " SELECT idempotency_key, source, event_type, idempotency_key, '{}' FROM idempotency_keys",
    )


def seed_lane_key(
    database_url: str,
    external_id: str,
    status: str,
    *,
    lane: str,
    rank: int,
    on_failure: str = "block",
    error_code: str | None = None,
    superseded_by: str | None = None,
    age: str = "1 hour",
) -> str:
    """A key of lane `lane` (route crm) at `rank`, written directly as the lane step would
    leave it, with the lane's row (`on_failure`); a failed_final or quarantined key gets an
    open dead letter of kind permanent. No outbox row, so no worker sees it; returns the key."""
    key = seed_pending_key(database_url, external_id)
    query(
        database_url,
        "UPDATE idempotency_keys SET status = %(status)s, lane = %(lane)s, lane_rank = %(rank)s,"
        " error_code = %(error_code)s, superseded_by = %(superseded_by)s, attempts = 1,"
        " updated_at = now() - CAST(%(age)s AS interval)"
        " WHERE idempotency_key = %(key)s",
        {
            "status": status,
            "lane": lane,
            "rank": rank,
            "error_code": error_code,
            "superseded_by": superseded_by,
            "age": age,
            "key": key,
        },
    )
    query(
        database_url,
        "INSERT INTO lanes (route, lane, ordering, on_failure, expires_at)"
        " VALUES ('crm', %s, 'accepted', %s, now() + interval '1 day')"
        " ON CONFLICT (route, lane) DO NOTHING",
        (lane, on_failure),
    )
    if status in ("failed_final", "quarantined"):
        query(
            database_url,
            "INSERT INTO dead_letters (idempotency_key, kind, error_code, error_detail, attempts,"
            " first_failed_at, last_failed_at, created_at)"
            " VALUES (%(key)s, 'permanent', %(error_code)s, %(external_id)s, 1,"
            " now() - CAST(%(age)s AS interval), now() - CAST(%(age)s AS interval),"
            " now() - CAST(%(age)s AS interval))",
            {"key": key, "error_code": error_code, "external_id": external_id, "age": age},
        )
    return key


def seed_fan_out_event(
    database_url: str,
    external_id: str,
    deliveries: dict[str, str],
    *,
    queued: bool = False,
    age: str = "0 seconds",
) -> str:
    """A `billing.invoice_paid` event of the fan-out route `billing`, stored by the receiver's
    own statement (RESERVE_FANNED_OUT): its key `fanned_out`, one delivery key per destination
    of `deliveries`, then each set to its status there (a `processing` one with an expired
    lease; `failed_final` with an open dead letter), all last changed `age` ago. Without
    `queued` the outbox rows go in the same transaction, so no worker ever sees the event;
    with it they stay, unpublished. Returns the event's key."""
    from sqlalchemy import create_engine, text

    from outbox.core.keys import delivery_key
    from outbox.core.wire import PROCESS_TASK
    from outbox.store.ingest import RESERVE_FANNED_OUT

    key = f"billing-app:billing.invoice_paid:{external_id}"
    names = list(deliveries)
    engine = create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                RESERVE_FANNED_OUT,
                {
                    "key": key,
                    "payload_hash": f"hash-{external_id}",
                    "correlation_id": f"corr-{external_id}",
                    "source": "billing-app",
                    "event_type": "billing.invoice_paid",
                    "route": "billing",
                    "workflow_name": None,
                    "execution_id": None,
                    "ttl_seconds": 86_400,
                    "external_id": external_id,
                    "version": None,
                    "payload": json.dumps({"invoice": external_id}),
                    "trace_context": None,
                    "task_name": PROCESS_TASK,
                    "delivery_keys": [delivery_key(key, name) for name in names],
                    "destinations": names,
                    "delivery_lanes": [None] * len(names),
                    "delivery_ranks": [None] * len(names),
                },
            )
            if not queued:
                conn.execute(
                    text("DELETE FROM outbox WHERE idempotency_key LIKE :prefix"),
                    {"prefix": f"{key} @%"},
                )
            conn.execute(
                text(
                    "UPDATE idempotency_keys SET updated_at = now() - CAST(:age AS interval)"
                    " WHERE idempotency_key = :key OR event_key = :key"
                ),
                {"key": key, "age": age},
            )
            for name, status in deliveries.items():
                conn.execute(
                    text(
                        """
                        UPDATE idempotency_keys
                           SET status = :status,
                               attempts = CASE WHEN :status = 'pending' THEN 0 ELSE 1 END,
                               error_code = CASE WHEN :status = 'failed_final'
                                                 THEN 'http_422' END,
                               lease_owner = CASE WHEN :status = 'processing'
                                                  THEN 'worker-1' END,
                               locked_until = CASE WHEN :status = 'processing'
                                                   THEN now() - interval '1 minute' END
                         WHERE idempotency_key = :key
                        """
                    ),
                    {"key": delivery_key(key, name), "status": status},
                )
                if status == "failed_final":
                    conn.execute(
                        text(
                            "INSERT INTO dead_letters (idempotency_key, kind, error_code,"
                            " error_detail, attempts, first_failed_at, last_failed_at)"
                            " VALUES (:key, 'permanent', 'http_422', 'refused', 1, now(), now())"
                        ),
                        {"key": delivery_key(key, name)},
                    )
    finally:
        engine.dispose()
    return key


def key_rows(database_url: str, keys: list[str]) -> dict[str, tuple[str, int]]:
    """Each key's status and attempts spent."""
    rows = query(
        database_url,
        "SELECT idempotency_key, status, attempts FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%s)",
        (keys,),
    )
    return {key: (status, attempts) for key, status, attempts in rows}


def all_in(database_url: str, keys: list[str], *statuses: str) -> bool:
    """Every key has a row and is in one of `statuses`: a key with no row (none accepted it
    here) is in none of them."""
    rows = key_rows(database_url, keys)
    return len(rows) == len(set(keys)) and all(status in statuses for status, _ in rows.values())


def statuses(database_url: str) -> Counter[str]:
    return Counter(
        dict(query(database_url, "SELECT status, count(*) FROM idempotency_keys GROUP BY 1"))
    )


@dataclass(frozen=True)
class Reply:
    """How the fake downstream answers one request.

    `commit` records the side effect first; `delay` waits before answering (past the client's
    read timeout, the answer is lost); `drop` closes the connection without any answer; `late`
    applies the request that many seconds after it arrived and never answers it: a downstream
    that takes a request in, is slow, and acts after its client gave up.
    """

    status: int = 201
    headers: dict[str, str] = field(default_factory=dict)
    commit: bool | None = None  # None: commit exactly when the status is 2xx
    delay: float = 0.0
    drop: bool = False
    # Fields added to the JSON answer.
    extra: dict[str, Any] = field(default_factory=dict)
    # After the commit, hold the answer until this is set (at most `delay` or 30 s).
    hold: threading.Event | None = None
    late: float | None = None


class _Listening(ThreadingHTTPServer):
    """A real server's accept queue: Python's default of 5 lost a burst's connections (a packed
    message's eight attempts connecting at once), and an attempt then waited out its connect
    timeout, an error the downstream under test never answered."""

    request_queue_size = 128

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that reset its kept-alive connection ended it (the `http` action closes
        its connections with a reset): nothing to report. Anything else is printed, as
        socketserver does."""
        if isinstance(sys.exc_info()[1], ConnectionResetError):
            return
        super().handle_error(request, client_address)


@dataclass
class Downstream:
    """A fake CRM: counts side effects per Idempotency-Key and misbehaves on demand.

    `behaviour(key, request_number)` returns a Reply for each POST (request_number counts the
    POSTs seen for that key, from 1). `GET /tasks/by-key/{key}` answers 200 with the effect's id
    when one exists, else 404: the reconcile lookup (under any prefix, e.g. `/api/tasks/...`).
    """

    port: int = 0
    effects: Counter[str] = field(default_factory=Counter)
    refs: dict[str, str] = field(default_factory=dict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    lookups: list[str] = field(default_factory=list)
    # Every GET as received: path, headers and raw body (a signature covers these bytes).
    lookup_requests: list[dict[str, Any]] = field(default_factory=list)
    behaviour: Callable[[str, int], Reply] | None = None
    # `lookup_failure(key, lookup_number)`: a status to answer a lookup with instead (a 503).
    lookup_failure: Callable[[str, int], int | None] | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Requests being handled right now (POSTs and lookups), and the most there ever were.
    in_flight: int = 0
    peak_in_flight: int = 0
    # Every effect as it was applied, in order: (key, the request's body).
    applied: list[tuple[str, Any]] = field(default_factory=list)

    def reset(self) -> None:
        with self.lock:
            self.effects.clear()
            self.refs.clear()
            self.requests.clear()
            self.lookups.clear()
            self.lookup_requests.clear()
            self.applied.clear()
            self.behaviour = None
            self.lookup_failure = None
            self.peak_in_flight = self.in_flight

    @contextlib.contextmanager
    def _handling(self) -> Iterator[None]:
        with self.lock:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            yield
        finally:
            with self.lock:
                self.in_flight -= 1

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request_times(self, key: str) -> list[float]:
        with self.lock:
            return [r["at"] for r in self.requests if r["key"] == key]

    def _commit(self, key: str, body: Any = None) -> str:
        with self.lock:
            self.applied.append((key, body))
            self.effects[key] += 1
            self.refs.setdefault(key, f"task-{len(self.refs) + 1}")
            return self.refs[key]

    def start(self) -> ThreadingHTTPServer:
        downstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
                payload = json.dumps(body).encode()
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                with downstream._handling():
                    self._get()

            def do_POST(self) -> None:
                with downstream._handling():
                    self._post()

            def _get(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                with downstream.lock:
                    downstream.lookup_requests.append(
                        {"path": self.path, "headers": dict(self.headers), "raw": raw}
                    )
                # Any collection prefix: `/tasks/by-key/{key}`, `/api/tasks/by-key/{key}`.
                _, found, rest = self.path.partition("/tasks/by-key/")
                if not found:
                    self._answer(404, {}, {})
                    return
                key = unquote(rest)
                with downstream.lock:
                    downstream.lookups.append(key)
                    ref = downstream.refs.get(key)
                    failing = downstream.lookup_failure
                    number = downstream.lookups.count(key)
                failure = failing(key, number) if failing else None
                if failure is not None:
                    self._answer(failure, {"error": "lookup failed"}, {})
                elif ref is None:
                    self._answer(404, {"error": "not found"}, {})
                else:
                    self._answer(200, {"id": ref}, {})

            def _post(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(length)
                body = json.loads(raw or b"null")
                key = self.headers.get("idempotency-key", "")
                with downstream.lock:
                    seen = sum(1 for r in downstream.requests if r["key"] == key)
                    downstream.requests.append(
                        {
                            "key": key,
                            # With the query: a route's URL may carry one.
                            "path": self.path,
                            "body": body,
                            # The bytes as received, for checking a signature over them.
                            "raw": raw,
                            "headers": dict(self.headers),
                            "at": time.monotonic(),
                        }
                    )
                    behaviour = downstream.behaviour
                reply = behaviour(key, seen + 1) if behaviour else Reply()
                if reply.late is not None:
                    time.sleep(reply.late)
                    downstream._commit(key, body)
                    self.close_connection = True
                    return
                commit = (200 <= reply.status < 300) if reply.commit is None else reply.commit
                answer: dict[str, Any] = dict(reply.extra)
                if commit:
                    answer["id"] = downstream._commit(key, body)
                if reply.hold is not None:
                    reply.hold.wait(30)
                elif reply.delay:
                    time.sleep(reply.delay)
                if reply.drop:
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                with contextlib.suppress(OSError):
                    self._answer(reply.status, answer, reply.headers)

            def log_message(self, *args: Any) -> None:
                pass

        server = _Listening(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


# The `signed` route's two secrets (a rotation): the Standard Webhooks example's, and another.
SIGNING_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SIGNING_SECRET_NEXT = "whsec_" + base64.b64encode(bytes(range(32))).decode()


# The `billing` route's destinations, and one no route names yet (a backfill's target).
FAN_OUT_DESTINATIONS = ("books", "finance-flow", "notify", "archive")


def write_routes(path: Path, downstream_url: str) -> Path:
    path.write_text(
        f"""
[[routes]]
match = "crm.*"
name = "crm"
action = "http"
url = "{downstream_url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{downstream_url}/tasks/by-key/{{key}}"
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
max_attempts = 4

[[routes]]
match = "plain.*"
name = "plain"
action = "http"
url = "{downstream_url}/tasks"
external_ref_pointer = "/id"
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1

[[routes]]
match = "slow.*"
name = "slow"
action = "python"
function = "tests.actions:sleep_then_succeed"

[[routes]]
match = "strict.*"
name = "strict"
action = "http"
url = "{downstream_url}/tasks"
required_fields = ["email", "phone"]
read_timeout_seconds = 1
connect_timeout_seconds = 1

[[routes]]
match = "wait.*"
name = "wait"
action = "http"
url = "{downstream_url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{downstream_url}/tasks/by-key/{{key}}"
read_timeout_seconds = 3
connect_timeout_seconds = 1

[[routes]]
match = "signed.*"
name = "signed"
action = "http"
url = "{downstream_url}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{downstream_url}/tasks/by-key/{{key}}"
signing_secrets = ["{SIGNING_SECRET}", "{SIGNING_SECRET_NEXT}"]
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 2

[[routes]]
match = "n8n.*"
name = "n8n"
kind = "n8n"
action = "http"
url = "{downstream_url}/tasks"
external_ref_pointer = "/id"
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
max_attempts = 2

[[routes]]
match = "odd.result"
name = "odd-result"
action = "python"
function = "tests.actions:effect_then_unstorable"

[[routes]]
match = "odd.crash"
name = "odd-crash"
action = "python"
function = "tests.actions:effect_then_exit"
max_attempts = 2
# Bounds the in-flight window a takeover waits out after the lease (the action exits at once).
timeout_seconds = 2

[[routes]]
match = "odd.hang"
name = "odd-hang"
action = "python"
function = "tests.actions:effect_then_hang"
timeout_seconds = 1.5
max_attempts = 2
backoff_base_seconds = 0.2
backoff_cap_seconds = 0.5

[[routes]]
match = "payment.*"
name = "payments"
action = "noop"
sources = ["signed"]

[[routes]]
match = "invoice.*"
name = "acme-invoices"
action = "http"
url = "{downstream_url}/tasks"
read_timeout_seconds = 1
connect_timeout_seconds = 1
sources = ["acme"]

[[routes]]
match = "payment_intent.*"
name = "stripe-payments"
action = "http"
url = "{downstream_url}/tasks"
read_timeout_seconds = 1
connect_timeout_seconds = 1
sources = ["stripe"]

[[routes]]
match = "issues"
name = "github-issues"
action = "http"
url = "{downstream_url}/tasks"
read_timeout_seconds = 1
connect_timeout_seconds = 1
sources = ["github"]

[[routes]]
match = "orders/*"
name = "shopify-orders"
action = "http"
url = "{downstream_url}/tasks"
read_timeout_seconds = 1
connect_timeout_seconds = 1
sources = ["shopify"]

[[routes]]
match = "billing.*"
name = "billing"
fan_out = ["books", "finance-flow", "notify"]

[[routes]]
match = "account.*"
name = "accounts"
fan_out = ["ledger-sync", "books"]

[[routes]]
match = "charge.*"
name = "stripe-charges"
sources = ["stripe"]
fan_out = ["books", "notify"]

[[routes]]
match = "*"
name = "default"
action = "noop"
"""
        + "".join(
            f"""
[[destinations]]
name = "{name}"
action = "http"
url = "{downstream_url}/{name}/tasks"
external_ref_pointer = "/id"
reconcile_url = "{downstream_url}/{name}/tasks/by-key/{{key}}"
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
max_attempts = {20 if name == "notify" else 4}
"""
            for name in FAN_OUT_DESTINATIONS
        )
        + f"""
[[destinations]]
name = "ledger-sync"
action = "http"
url = "{downstream_url}/ledger-sync/tasks"
order_by = "/account"
versions = "supersede"
read_timeout_seconds = 1
connect_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 1
"""
        + "".join(
            f'\n[[sources]]\nname = "{name}"\nscheme = "{scheme}"\nsecrets = ["{secret}"]\n'
            for name, (scheme, secret) in PROVIDER_SECRETS.items()
        ),
        encoding="utf-8",
    )
    return path


@dataclass
class Stack:
    """The gateway's processes (receiver, relays, workers) started as real subprocesses."""

    database_url: str
    # redis://... or amqp://... (tests/brokers.py): the processes get it as BROKER_URL.
    broker_url: str
    routes_file: Path
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            DATABASE_URL=self.database_url,
            BROKER_URL=self.broker_url,
            # The setting of before BROKER_URL names a Redis or nothing.
            REDIS_URL=self.broker_url if self.broker_url.startswith("redis") else "",
            ROUTES_FILE=str(self.routes_file),
            LOG_FORMAT="json",
            LEASE_SECONDS="5",
            SWEEP_INTERVAL_SECONDS="0.5",
            SWEEP_GRACE_SECONDS="2",
            OPERATOR_TOKEN=OPERATOR_TOKEN,
            CLAIMS_TOKEN=CLAIMS_TOKEN,
            # The shared stack sees every test's deliberate wrong tokens from one address;
            # the throttle itself is tested on a receiver of its own.
            AUTH_FAILURE_LIMIT="100000",
            # A workflow's key is claimable again as soon as its lease ends or it failed: the
            # tests of the claims API's other rules do not wait out the in-flight rule, which
            # tests/integration/worker/test_handoffs.py tests on a stack of its own.
            CLAIMS_IN_FLIGHT_SECONDS="0",
            WEBHOOK_SECRETS=f"signed={WEBHOOK_SECRET}",
            PYTHONPATH=str(ROOT),
        )
        pool_port = os.environ.get("TEST_POOL_PORT")
        server = make_url(self.database_url)
        if (
            pool_port
            and f"{server.host}:{server.port}" == os.environ.get("TEST_POOL_SERVER")
            and "DATABASE_POOL_MODE" not in self.extra_env
        ):
            # TEST_POOLER=pgbouncer (tests/pooler.py): the processes go through the pool.
            env.update(
                DATABASE_URL=pooled_url(self.database_url, int(pool_port)),
                DATABASE_POOL_MODE="transaction",
                DATABASE_DIRECT_URL=self.database_url,
            )
        env.update(self.extra_env)
        return env

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            process = subprocess.Popen(
                [sys.executable, *args], env=self.env(), cwd=ROOT, stdout=log, stderr=log
            )
        self.processes[name] = process
        return process

    def start_receiver(self) -> None:
        self.port = self.port or free_port()
        process = self._spawn("receiver", ["-m", "outbox.cli", "serve", "--port", str(self.port)])
        wait_for_port(self.port, process, timeout=20)

    def start_relay(self, name: str = "relay") -> None:
        self._spawn(name, ["-m", "outbox.cli", "relay"])

    def start_worker(
        self, name: str = "worker", concurrency: int | None = None, wait: bool = True
    ) -> None:
        """A worker with the default pool (WORKER_POOL in extra_env chooses another); with
        `wait`, returns once it is about to consume (else at once, for one that may refuse)."""
        self.metrics_ports[name] = free_port()
        self.extra_env["WORKER_METRICS_PORT"] = str(self.metrics_ports[name])
        flags = ["--concurrency", str(concurrency)] if concurrency else []
        process = self._spawn(name, ["-m", "worker", *flags])
        if wait:
            # The metrics port opens just before Celery starts consuming.
            wait_for_port(self.metrics_ports[name], process, timeout=30)

    def start_sweeper(self, name: str = "sweeper") -> None:
        self._spawn(name, ["-m", "outbox.cli", "sweep"])

    def start_all(self) -> Stack:
        self.start_receiver()
        self.start_relay()
        self.start_worker()
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> httpx.Client:
        """A workflow's client: it sends the claims token (the operators' calls send theirs)."""
        return httpx.Client(
            base_url=self.url, timeout=15, headers={"Authorization": f"Bearer {CLAIMS_TOKEN}"}
        )

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def stop_all(self) -> None:
        """Stop every process at once (each gets SIGTERM, then 15 s before SIGKILL): a stack's
        teardown takes its slowest process's time, not the sum."""
        processes = [self.processes.pop(name) for name in list(self.processes)]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")


@contextlib.contextmanager
def other_receiver(stack: Stack, log_dir: Path, **settings: str) -> Iterator[Stack]:
    """A receiver of its own beside `stack` (same database, broker and routes) with other
    settings (`REQUIRE_SIGNED_WEBHOOKS="true"`), stopped at the end."""
    receiver = Stack(
        stack.database_url, stack.broker_url, stack.routes_file, log_dir, extra_env=settings
    )
    receiver.start_receiver()
    try:
        yield receiver
    finally:
        receiver.stop_all()


def refused_start(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`idem serve` run with `env` on a port nothing uses, expected to stop before it binds
    (its exit status and stderr, for the test to judge)."""
    return subprocess.run(
        [sys.executable, "-m", "outbox.cli", "serve", "--port", str(free_port())],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )


def post_event(stack: Stack, body: dict[str, Any]) -> str:
    """Post one event as a workflow does; its key (the answer must be 202)."""
    with stack.client() as client:
        answer = client.post("/v1/events", json=body)
    assert answer.status_code == 202, answer.text
    key: str = answer.json()["key"]
    return key


def envelope(
    external_id: str, event_type: str = "crm.lead.created", **extra: Any
) -> dict[str, Any]:
    return {
        "source": "webform",
        "event_type": event_type,
        "external_id": external_id,
        "payload": {"email": f"{external_id}@example.com", "name": "Ada"},
        **extra,
    }


def pump(
    source: socket.socket,
    sink: socket.socket,
    keep: Callable[[socket.socket], bool] = lambda _sock: False,
) -> None:
    """Copy what `source` sends to `sink` until either ends, then shut both down, but those
    `keep` names: one direction of a forwarder."""
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            if not keep(sock):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class TcpProxy:
    """A TCP forwarder the test can cut and restore, to make a server unreachable without
    touching the server itself (other tests and people may be using it)."""

    def __init__(
        self, target_port: int = 0, target_host: str = "127.0.0.1", unix_socket: str = ""
    ) -> None:
        self.target = (target_host, target_port)
        self.unix_socket = unix_socket
        self.port = free_port()
        self._server: socket.socket | None = None
        self._sockets: list[socket.socket] = []
        # Per open connection, its client's socket and its upstream socket.
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        # Upstream sockets `orphan` keeps open and unread until `release`.
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        self._server = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._server,), daemon=True).start()
        return self

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                if self.unix_socket:
                    upstream = socket.socket(socket.AF_UNIX)
                    try:
                        upstream.connect(self.unix_socket)
                    except OSError:
                        upstream.close()
                        raise
                else:
                    upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
                self._pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        pump(source, sink, keep=self._is_held)

    def _is_held(self, sock: socket.socket) -> bool:
        with self._lock:
            return sock in self._held

    def cut(self) -> None:
        """Refuse new connections and drop every open one."""
        if self._server is not None:
            # shutdown() wakes the thread blocked in accept(); close() alone would not.
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
            self._server = None
        with self._lock:
            sockets, self._sockets, self._pairs = self._sockets, [], []
        self._close(sockets)

    def orphan(self) -> None:
        """End every open connection at its client's end only: the upstream sockets stay open
        and unread, so the server still sees each connection alive (as a server sees a client
        whose network went silent) until `release` or its own timeout; the client sees it end
        at once. New connections are forwarded as before."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._held += [upstream for _, upstream in pairs]
            clients = [client for client, _ in pairs]
            self._sockets = [s for s in self._sockets if s not in self._held + clients]
        self._close(clients)

    def release(self) -> None:
        """Close the upstream sockets `orphan` kept: the server sees those connections end."""
        with self._lock:
            held, self._held = self._held, []
        self._close(held)

    @staticmethod
    def _close(sockets: list[socket.socket]) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def stop(self) -> None:
        self.cut()
        self.release()


def proxied_database(database_url: str) -> tuple[TcpProxy, str]:
    """A started TcpProxy in front of the test database, and the URL that goes through it."""
    url = make_url(database_url)
    socket_dir = url.query.get("host")
    if isinstance(socket_dir, str):  # an embedded server listens on a Unix socket only
        proxy = TcpProxy(unix_socket=f"{socket_dir}/.s.PGSQL.{url.port or 5432}").start()
    else:
        proxy = TcpProxy(url.port or 5432, url.host or "127.0.0.1").start()
    proxied = url.set(host="127.0.0.1", port=proxy.port).difference_update_query(["host"])
    return proxy, proxied.render_as_string(hide_password=False)


FINAL_STATUSES = ("succeeded", "failed_final", "quarantined", "superseded")


def key_state(stack: Stack, key: str) -> dict[str, Any]:
    """`GET /v1/events/{key}` as a workflow reads it."""
    with stack.client() as client:
        answer = client.get(f"/v1/events/{key}")
    assert answer.status_code == 200, answer.text
    body: dict[str, Any] = answer.json()
    return body


def replay(stack: Stack, keys: list[str]) -> None:
    """An operator replays `keys` through the API: a dry run, then its confirmation."""
    headers = {**AUTH, "X-Operator": "ops-ada"}
    with stack.client() as client:
        dry = client.post("/v1/replays", json={"keys": keys}, headers=headers)
        assert dry.status_code == 200, dry.text
        done = client.post(
            "/v1/replays",
            json={"keys": keys, "dry_run": False, "confirm": dry.json()["confirm"]},
            headers=headers,
        )
    assert done.status_code == 200 and done.json()["to_replay"] == len(keys), done.text


def finished(stack: Stack, key: str, timeout: float = 60) -> dict[str, Any]:
    """Wait until the key reaches a final status; return its state."""

    def final() -> dict[str, Any] | None:
        state = key_state(stack, key)
        return state if state["status"] in FINAL_STATUSES else None

    result: dict[str, Any] = wait_until(final, timeout=timeout)
    return result


def claim(stack: Stack, key: str, **extra: Any) -> httpx.Response:
    """`POST /v1/claims` with the claims token."""
    with stack.client() as client:
        return client.post("/v1/claims", json={"key": key, **extra})


def claim_call(stack: Stack, key: str, action: str, body: dict[str, Any]) -> httpx.Response:
    """`POST /v1/claims/{key}/{heartbeat|complete|fail}` with the claims token."""
    with stack.client() as client:
        return client.post(f"/v1/claims/{key}/{action}", json=body)


def system_state(*paths: Path) -> dict[str, Any]:
    """What a start-up must leave alone: the user and group databases, the mount table, and the
    mode and owner of every folder above each of `paths` (an embedded server's data directory,
    its binaries)."""
    folders = sorted({parent for path in paths for parent in path.resolve().parents})
    return {
        "passwd": Path("/etc/passwd").read_bytes(),
        "group": Path("/etc/group").read_bytes(),
        "mounts": sorted(Path("/proc/self/mountinfo").read_text().splitlines()),
        "folders": {str(f): (f.stat().st_mode, f.stat().st_uid, f.stat().st_gid) for f in folders},
    }


def refuse_shared_successes(database_url: str) -> None:
    """Make every `SUCCEED_KEYS` fail (the attempt log refuses its rows, as a full disk or a
    broken constraint would), and nothing else: the shared write's fallback, tested."""
    query(
        database_url,
        "CREATE FUNCTION refuse_shared() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN IF current_query() LIKE '%Several effects happened%' THEN"
        "   RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$",
    )
    query(
        database_url,
        "CREATE TRIGGER refuse_shared BEFORE INSERT ON attempts"
        " FOR EACH ROW EXECUTE FUNCTION refuse_shared()",
    )


Seen = Callable[[psycopg.Cursor[Any], str, Any], None]


@contextlib.contextmanager
def statements_sent(engine: Engine, seen: Seen) -> Iterator[None]:
    """Call `seen(cursor, statement, parameters)` before each statement the engine's
    connections send, however it is sent: through SQLAlchemy's execution or straight on the
    driver's connection (outbox/store/driven.py), which SQLAlchemy's execution events never
    see. Connections already pooled are dropped first, so every one made after has the
    observing cursor. `seen` may run statements of its own on `psycopg.Cursor(cursor.connection)`,
    which is not observed."""

    class Observed(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            seen(self, str(query), params)
            return super().execute(query, params, **kwargs)

    def observe(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.cursor_factory = Observed

    engine.dispose()
    event.listen(engine, "connect", observe)
    try:
        yield
    finally:
        event.remove(engine, "connect", observe)
        engine.dispose()
