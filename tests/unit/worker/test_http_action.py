"""The http action builds its request before sending it: what cannot be built is the key's own
permanent failure, raised before any connection is opened."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import socket
import threading
import time
import tracemalloc
from typing import Any

import httpx
import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import action_context
from worker.actions import ActionContext, http
from worker.errors import RequestInvalid, TransientError, classify


def _closed_port() -> int:
    """A local port nobody listens on: a request that got as far as connecting would fail
    with a connection error there, not with RequestInvalid."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _context(correlation_id: str) -> ActionContext:
    return action_context(correlation_id)


@pytest.mark.parametrize("correlation_id", ["café-1", "line\r\nX-Injected: 1"])
def test_a_header_that_cannot_be_sent_is_the_keys_permanent_failure(correlation_id: str) -> None:
    """A correlation id stored before intake checked it (not ASCII, or with CR/LF) makes the
    event's request unbuildable: a permanent `request_invalid` of that key, marked local so the
    route's breaker never hears of it, and no connection is attempted."""
    route = Route(
        match="crm.*",
        action="http",
        url=f"http://127.0.0.1:{_closed_port()}/tasks",
        reconcile_url=f"http://127.0.0.1:{_closed_port()}/tasks/{{key}}",
    )
    for call in (http.run, http.reconcile):
        with pytest.raises(Exception) as raised:
            call(route, _context(correlation_id))
        failure = classify(raised.value)
        assert (failure.error_code, failure.transient, failure.local) == (
            "request_invalid",
            False,
            True,
        ), raised.value
        assert isinstance(raised.value, RequestInvalid)


# --- signed requests ---------------------------------------------------------------------------

SIGNING_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def _verify(secret: str, headers: httpx.Headers, body: bytes) -> bool:
    """An independent Standard Webhooks check: HMAC-SHA256 over `id.timestamp.body` with the
    secret's base64-decoded key, against any `v1,` entry of the header."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{headers['webhook-id']}.{headers['webhook-timestamp']}.".encode() + body
    expected = "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(expected, e) for e in headers["webhook-signature"].split())


def _recording_client(
    monkeypatch: pytest.MonkeyPatch, seen: list[httpx.Request], status: int
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json={"id": "task-1"})

    recording = httpx.MockTransport(answer)
    monkeypatch.setattr(http, "transport", lambda: recording)


def _crm_route(**settings: Any) -> Route:
    """An http route with a reconcile lookup, on a host the recording client answers for."""
    return Route(
        match="crm.*",
        action="http",
        url="http://crm.test/tasks",
        reconcile_url="http://crm.test/tasks/{key}",
        **settings,
    )


def test_a_signing_route_signs_the_exact_bytes_of_action_and_reconcile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `signing_secret` the POST and the reconcile GET carry webhook-id (the key),
    webhook-timestamp and a signature that an independent check accepts over the bytes sent."""
    seen: list[httpx.Request] = []
    _recording_client(monkeypatch, seen, 200)
    route = _crm_route(signing_secret=SIGNING_SECRET)
    http.run(route, _context("corr-1"))
    http.reconcile(route, _context("corr-1"))
    assert [r.method for r in seen] == ["POST", "GET"]
    for request in seen:
        assert request.headers["webhook-id"] == "crm:lead:1"
        assert request.headers["idempotency-key"] == "crm:lead:1"
        assert request.headers["webhook-timestamp"].isdigit()
        assert _verify(SIGNING_SECRET, request.headers, request.content), request
    assert json.loads(seen[0].content) == {"name": "Ada"}
    assert not _verify(SIGNING_SECRET, seen[0].headers, seen[0].content + b" ")


def test_a_route_without_a_secret_sends_no_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a signing secret no webhook-* header is sent."""
    seen: list[httpx.Request] = []
    _recording_client(monkeypatch, seen, 200)
    http.run(Route(match="crm.*", action="http", url="http://crm.test/tasks"), _context("c"))
    assert not [name for name in seen[0].headers if name.startswith("webhook-")]


def test_a_request_that_timed_out_is_reset_not_closed() -> None:
    """After a read timeout the client resets the connection: the kernel drops what it has
    not delivered of the request instead of retransmitting it for minutes, so it cannot land
    after the next attempt's lookup. The downstream reads a reset, not an orderly end."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        route = Route(
            match="crm.*",
            action="http",
            url=f"http://127.0.0.1:{server.getsockname()[1]}/tasks",
            read_timeout_seconds=0.3,
        )
        with pytest.raises(httpx.ReadTimeout):
            http.run(route, _context("corr-1"))
        accepted, _ = server.accept()
        with accepted:
            accepted.settimeout(5)
            received = b""
            with pytest.raises(ConnectionResetError):
                while chunk := accepted.recv(65536):
                    received += chunk
    assert received.startswith(b"POST /tasks")


@pytest.mark.parametrize("why", ["flag", "clock"])
def test_no_request_leaves_once_the_lease_is_not_held(
    monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    """Neither the write nor the reconcile lookup is sent once the lease stopped being ours:
    by the cancel flag, or by the clock alone past the trust window, before the keeper or the
    attempt's wait has set the flag. Each ends in a `lease_lost` nothing was sent for."""
    seen: list[httpx.Request] = []
    _recording_client(monkeypatch, seen, 200)
    route = _crm_route()
    for call in (http.run, http.reconcile):
        ctx = _context("corr-1")
        if why == "flag":
            ctx.cancelled.set()
        else:
            ctx.trusted_until = lambda: time.monotonic() - 0.001
        with pytest.raises(TransientError) as raised:
            call(route, ctx)
        assert classify(raised.value).error_code == "lease_lost"
    assert seen == []
    # Inside the window both go out.
    held = _context("corr-1")
    held.trusted_until = lambda: time.monotonic() + 60
    http.run(route, held)
    http.reconcile(route, held)
    assert [r.method for r in seen] == ["POST", "GET"]


class _Flood:
    """A downstream that answers `status` with a declared body of `total` bytes, sent in
    64 KiB writes for as long as the client reads; `sent` counts what left before the client
    cut the connection."""

    def __init__(self, status: int, total: int) -> None:
        self.status, self.total, self.sent = status, total, 0
        self.done = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            conn.recv(65_536)
            head = f"HTTP/1.1 {self.status} X\r\nContent-Length: {self.total}\r\n\r\n"
            conn.sendall(head.encode())
            chunk = b"x" * 65_536
            try:
                while self.sent < self.total:
                    conn.sendall(chunk)
                    self.sent += len(chunk)
            except OSError:
                pass  # the client cut the connection: what a bounded read does
        self.done.set()
        self.listener.close()


@pytest.mark.parametrize(
    ("status", "error_code"), [(200, None), (500, "http_500"), (404, "http_404")]
)
def test_a_huge_answer_is_read_up_to_the_cap_and_judged_by_its_status(
    status: int, error_code: str | None
) -> None:
    """A 300 MB answer is read up to the route's `max_response_bytes` (64 KiB here), then the
    connection is cut: the downstream got to send a small part of it (the socket buffers), the
    worker's peak allocation stays far below it, a 2xx is a success with its body dropped, and
    any other status is judged by its status."""
    flood = _Flood(status, 300 * 1024 * 1024)
    route = Route(
        match="crm.*",
        action="http",
        url=f"http://127.0.0.1:{flood.port}/tasks",
        external_ref_pointer="/id",
        max_response_bytes=65_536,
    )
    tracemalloc.start()
    try:
        if error_code is None:
            done = http.run(route, _context("c-1"))
            assert done.external_ref is None
            assert done.result == {
                "status_code": 200,
                "body": None,
                "body_dropped": "response_too_large",
                "max_response_bytes": 65_536,
            }
        else:
            with pytest.raises(Exception) as raised:
                http.run(route, _context("c-1"))
            assert classify(raised.value).error_code == error_code
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert flood.done.wait(30)
    assert flood.sent < 64 * 1024 * 1024, flood.sent
    assert peak < 16 * 1024 * 1024, peak


def test_a_routes_own_header_replaces_the_default_of_that_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defaults every request carries (Accept, Accept-Encoding, User-Agent) give way to a
    route's header of the same name in any case: it is sent once, with the route's value."""
    seen: list[httpx.Request] = []
    _recording_client(monkeypatch, seen, 200)
    route = Route(
        match="crm.*",
        action="http",
        url="http://crm.test/tasks",
        headers={"user-agent": "crm-sync/1", "Authorization": "Bearer t"},
    )
    http.run(route, _context("c"))
    sent = seen[0].headers
    assert sent.get_list("User-Agent") == ["crm-sync/1"]
    assert sent["Accept"] == "*/*" and sent["Accept-Encoding"] == "gzip, deflate"
    assert sent["Authorization"] == "Bearer t" and sent["Host"] == "crm.test"
