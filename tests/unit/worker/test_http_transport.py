"""The http action's connections (worker/actions/transport.py) against real local servers:
kept alive and reused, never reused once the server closed them or they idled too long, every
failure raised as the httpx error `classify` reads (so "not sent" and "uncertain" mean what they
meant), answers decoded as httpx decoded them, a proxy from the environment honoured, and a
forked child with connections of its own."""

from __future__ import annotations

import gzip
import json
import os
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import action_context
from worker.actions import http, transport
from worker.errors import classify


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.requests.append(self.requestline)  # type: ignore[attr-defined]
        body = json.dumps({"id": f"task-{len(self.server.requests)}"}).encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    """Counts the connections it accepted and the requests it answered."""

    daemon_threads = True
    request_queue_size = 64  # every thread's connection accepted, none dropped at the door

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.connections = 0
        self.requests: list[str] = []
        self.open: list[socket.socket] = []

    def get_request(self) -> tuple[socket.socket, object]:
        accepted, address = super().get_request()
        self.connections += 1
        self.open.append(accepted)
        return accepted, address

    def handle_error(self, request: object, client_address: object) -> None:
        """Quiet: the client resets the connections it closes (`RESET_ON_CLOSE`), which a
        handler waiting for the next request reads as an error."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/tasks"


@pytest.fixture
def server() -> Iterator[_Server]:
    running = _Server()
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running
    running.shutdown()
    running.server_close()


def _route(url: str, **settings: Any) -> Route:
    return Route(match="crm.*", action="http", url=url, external_ref_pointer="/id", **settings)


def _once(url: str) -> str | None:
    return http.run(_route(url), action_context("c-1")).external_ref


def test_a_connection_is_kept_and_reused(server: _Server) -> None:
    """Three requests in turn go over one connection."""
    assert [_once(server.url) for _ in range(3)] == ["task-1", "task-2", "task-3"]
    assert server.connections == 1


def test_threads_share_the_connections_and_never_one_at_once(server: _Server) -> None:
    """32 threads, 5 requests each: every request answered, no more connections than
    requests in flight at once."""
    answers: list[str | None] = []
    failures: list[BaseException] = []

    def five() -> None:
        try:
            for _ in range(5):
                answers.append(_once(server.url))
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=five) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert failures == []
    assert len(answers) == 160 and len(set(answers)) == 160
    assert server.connections <= 32


def test_a_connection_the_server_closed_while_idle_is_not_reused(server: _Server) -> None:
    """The server ends the idle connection (as one whose keep-alive ran out does): the next
    request opens another instead of being written into it, and is answered."""
    assert _once(server.url) == "task-1"
    for accepted in server.open:
        accepted.shutdown(socket.SHUT_RDWR)
    assert _once(server.url) == "task-2"
    assert server.connections == 2


def test_a_connection_idle_past_the_keep_alive_time_is_not_reused(
    server: _Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "KEEPALIVE_SECONDS", 0.0)
    assert [_once(server.url) for _ in range(2)] == ["task-1", "task-2"]
    assert server.connections == 2


def _raw_server(answer: Callable[[socket.socket], object]) -> str:
    """A server that reads one request, then does `answer` with the connection and closes it."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            accepted, _ = listener.accept()
            with accepted:
                accepted.recv(65_536)
                answer(accepted)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/tasks"


def _failure(url: str) -> tuple[str, bool, bool]:
    with pytest.raises(httpx.TransportError) as raised:
        http.run(_route(url, read_timeout_seconds=2), action_context("c-1"))
    failure = classify(raised.value)
    return failure.error_code, failure.uncertain, failure.not_sent


def test_a_refused_connection_is_not_sent() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/tasks"
    assert _failure(closed) == ("connect_refused", False, True)


def test_a_name_that_does_not_resolve_is_not_sent() -> None:
    assert _failure("http://no-such-host.invalid/tasks") == ("connect_refused", False, True)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(lambda conn: None, id="closed-without-an-answer"),
        pytest.param(lambda conn: conn.sendall(b"garbage\r\n\r\n"), id="not-http"),
        pytest.param(
            lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{}"),
            id="body-cut-short",
        ),
    ],
)
def test_a_connection_that_ends_mid_answer_is_uncertain(
    answer: Callable[[socket.socket], None],
) -> None:
    """The request was written: whatever broke after, the effect may exist."""
    assert _failure(_raw_server(answer)) == ("connection_dropped", True, False)


def test_an_answer_that_never_comes_is_a_read_timeout() -> None:
    stop = threading.Event()
    url = _raw_server(lambda conn: stop.wait(10))
    try:
        with pytest.raises(httpx.ReadTimeout):
            http.run(_route(url, read_timeout_seconds=0.3), action_context("c-1"))
    finally:
        stop.set()


def test_a_chunked_gzip_answer_and_a_header_that_is_not_ascii_are_read() -> None:
    """Decoded as httpx decoded it: the body de-chunked and un-gzipped, a Latin-1 header kept."""
    body = gzip.compress(json.dumps({"id": "task-9"}).encode())
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    head = (
        b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\n"
        b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\nX-Name: caf\xe9\r\n\r\n"
    )
    url = _raw_server(lambda conn: conn.sendall(head + chunked))
    done = http.run(_route(url), action_context("c-1"))
    assert done.external_ref == "task-9"
    assert done.result == {"status_code": 201, "body": {"id": "task-9"}}


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[_Server, Path]]:
    """The keep-alive server behind TLS, with a self-signed certificate for 127.0.0.1."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    command = [
        *("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
        *("-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"),
        *("-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
    ]
    subprocess.run(
        command,
        check=True,
        capture_output=True,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    running = _Server()
    running.socket = context.wrap_socket(running.socket, server_side=True)
    threading.Thread(target=running.serve_forever, daemon=True).start()
    yield running, cert
    running.shutdown()
    running.server_close()


def test_https_verifies_the_certificate_and_keeps_the_connection(
    tls_server: tuple[_Server, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A certificate nobody trusts fails the handshake: not sent. Trusted (SSL_CERT_FILE, as
    httpx reads it), two requests go over one TLS connection."""
    server, cert = tls_server
    url = server.url.replace("http://", "https://")
    assert _failure(url) == ("connect_refused", False, True)
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.setattr(http, "_transport", None)
    assert [_once(url) for _ in range(2)] == ["task-1", "task-2"]
    assert server.connections == 1  # (a refused handshake is never accepted)


def test_a_proxy_named_in_the_environment_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """HTTP_PROXY set: the request goes to the proxy, in the absolute form a proxy reads."""
    seen: list[bytes] = []

    def proxy(conn: socket.socket) -> None:
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"id": "p-1"}')

    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            accepted, _ = listener.accept()
            with accepted:
                seen.append(accepted.recv(65_536))
                proxy(accepted)

    threading.Thread(target=serve, daemon=True).start()
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{listener.getsockname()[1]}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    assert _once("http://crm.test/tasks") == "p-1"
    assert seen[0].startswith(b"POST http://crm.test/tasks HTTP/1.1")


def test_a_forked_child_makes_its_own_connections(server: _Server) -> None:
    """Connections are never shared between processes: the child's request opens its own."""
    assert _once(server.url) == "task-1"
    inherited = http.transport()
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            fresh = http.transport() is not inherited
            os.write(writer, b"1" if fresh and _once(server.url) == "task-2" else b"0")
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as said:
        answer = said.read()
    os.waitpid(pid, 0)
    assert answer == b"1"
    assert server.connections == 2
    assert http.transport() is inherited
