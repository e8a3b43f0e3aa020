"""Connections are bounded before the app sees them: a header block that never ends, senders
that dribble their headers, and more connections than the receiver serves at once, each against
a real receiver process (`idem serve`)."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import Stack, envelope, wait_until

MIB = 1024 * 1024


@pytest.fixture
def receiver(
    request: pytest.FixtureRequest,
    database_url: str,
    redis_url: str,
    routes_file: Path,
    tmp_path: Path,
) -> Iterator[Stack]:
    """A receiver of its own, with the settings the test names (`@pytest.mark.parametrize`
    on `receiver` indirectly)."""
    stack = Stack(database_url, redis_url, routes_file, tmp_path, extra_env=request.param)
    stack.start_receiver()
    yield stack
    stack.stop_all()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _open(stack: Stack) -> socket.socket:
    return socket.create_connection(("127.0.0.1", stack.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    """Whatever the server sends until it closes the connection (a reset ends it too)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


@pytest.mark.parametrize("receiver", [{}], indirect=True)
def test_a_header_value_that_never_ends_is_cut_off_without_buffering_it(receiver: Stack) -> None:
    """One connection sends a header value of up to 64 MiB in 1 MiB pieces and never ends the
    headers: the receiver closes it within the first few MiB, and its memory grows by less
    than 50 MB (buffering the value would cost at least its size)."""
    pid = receiver.processes["receiver"].pid
    before = _rss_bytes(pid)
    piece = b"a" * MIB
    sent = 0
    with _open(receiver) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: idem\r\nX-Big: ")
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            while sent < 64 * MIB:
                sock.sendall(piece)
                sent += len(piece)
    # The server has read what it will read (it closed the connection, or took it all).
    time.sleep(1)
    grown = _rss_bytes(pid) - before
    assert grown < 50 * 1_000_000, f"the receiver grew by {grown / 1e6:.0f} MB"
    assert sent < 16 * MIB, f"the receiver took {sent // MIB} MiB of one header value"
    with httpx.Client(base_url=receiver.url, timeout=10) as client:
        assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("receiver", [{}], indirect=True)
def test_a_header_block_over_the_limit_is_answered_431_before_it_ends(receiver: Stack) -> None:
    """A request whose headers pass 32 KiB and have not ended gets 431 headers_too_large as a
    problem document, and the connection is closed."""
    with _open(receiver) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: idem\r\nX-Big: " + b"a" * 40_000)
        answer = _read_all(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"application/problem+json" in head
    assert b'"error":"headers_too_large"' in body


def _still_open(sock: socket.socket) -> bool:
    """Whether the server has not closed this connection (a 408 before the close is fine)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        while readable:
            if not sock.recv(65536):
                return False
            readable, _, _ = select.select([sock], [], [], 0)
        return True
    except (ConnectionResetError, BrokenPipeError):
        return False


@pytest.mark.parametrize("receiver", [{"HEADER_READ_TIMEOUT_SECONDS": "3"}], indirect=True)
def test_slow_senders_are_disconnected_after_the_header_read_timeout(receiver: Stack) -> None:
    """Fifty connections each sending one header line a second, never ending their headers,
    are all closed by the receiver within the 3 s header-read timeout plus a margin; meanwhile
    and after, a normal request is served."""
    sockets = [_open(receiver) for _ in range(50)]
    for sock in sockets:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: idem\r\n")
    deadline = time.monotonic() + 3 + 7
    line = 0
    open_ = list(sockets)
    try:
        while open_ and time.monotonic() < deadline:
            line += 1
            for sock in list(open_):
                try:
                    sock.sendall(f"X-Slow-{line}: 1\r\n".encode())
                except (BrokenPipeError, ConnectionResetError):
                    open_.remove(sock)
            time.sleep(1)
            open_ = [sock for sock in open_ if _still_open(sock)]
        assert not open_, f"{len(open_)} of 50 slow connections still open after 10 s"
        with httpx.Client(base_url=receiver.url, timeout=10) as client:
            assert client.get("/healthz").status_code == 200
    finally:
        for sock in sockets:
            sock.close()


@pytest.mark.parametrize(
    "receiver", [{"MAX_CONNECTIONS": "3", "KEEP_ALIVE_SECONDS": "60"}], indirect=True
)
def test_requests_beyond_the_connection_cap_get_503_until_connections_close(
    receiver: Stack,
) -> None:
    """With three connections held open (keep-alive), a request on a fourth gets 503
    server_busy with Retry-After; once they close, requests are served again."""
    holders = [httpx.Client(base_url=receiver.url, timeout=10) for _ in range(3)]
    try:
        for holder in holders:
            assert holder.get("/healthz").status_code == 200
        with httpx.Client(base_url=receiver.url, timeout=10) as extra:
            busy = extra.get("/healthz")
        assert busy.status_code == 503, busy.text[:200]
        assert busy.json()["error"] == "server_busy"
        assert int(busy.headers["retry-after"]) >= 1
        # The holders are still served on their own connections, once the server has seen the
        # fourth connection close (until then every request counts four: a loaded machine
        # may take a moment to notice).
        wait_until(lambda: holders[0].get("/healthz").status_code == 200, timeout=10)
    finally:
        for holder in holders:
            holder.close()

    def served() -> bool:
        with httpx.Client(base_url=receiver.url, timeout=10) as client:
            return client.get("/healthz").status_code == 200

    wait_until(served, timeout=10)


def _post_head(length: int) -> bytes:
    return (
        f"POST /v1/events HTTP/1.1\r\nHost: idem\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _answer_code(sock: socket.socket) -> str | None:
    """The problem's `error` of what the server sent before it closed, if anything."""
    sock.setblocking(True)
    sock.settimeout(5)
    try:
        answer = _read_all(sock)
    except TimeoutError:
        return None
    _, _, body = answer.partition(b"\r\n\r\n")
    return json.loads(body)["error"] if body.startswith(b"{") else None


SLOW_BODIES = {
    "REQUEST_TIMEOUT_SECONDS": "8",
    "MIN_BODY_RATE_BYTES": "100",
    "BODY_RATE_WINDOW_SECONDS": "2",
}


@pytest.mark.parametrize("receiver", [SLOW_BODIES], indirect=True)
def test_trickling_bodies_are_cut_off_while_genuine_events_get_202(receiver: Stack) -> None:
    """520 connections each declare a 100 000-byte body and send a byte every half second (more
    than the 512 connections served at once): each is answered 408 `body_too_slow` within its
    first rate window (or 503 `server_busy` beyond the cap) and closed, while a genuine sender
    posting events throughout gets each one accepted (202, after waiting out any 503 its
    Retry-After asks for), and after the cut every event is 202 at the first try."""
    tricklers = [_open(receiver) for _ in range(520)]
    for sock in tricklers:
        sock.sendall(_post_head(100_000) + b"{")
    accepted: list[int] = []
    stop = threading.Event()

    def genuine() -> None:
        with httpx.Client(base_url=receiver.url, timeout=10) as client:
            n = 0
            while not stop.is_set():
                event = envelope(f"slow-body-{n}")
                while (answer := client.post("/v1/events", json=event)).status_code == 503:
                    assert answer.json()["error"] == "server_busy"
                    time.sleep(0.2)
                accepted.append(answer.status_code)
                n += 1

    sender = threading.Thread(target=genuine)
    sender.start()
    open_ = list(tricklers)
    codes: list[str | None] = []
    try:
        deadline = time.monotonic() + 30
        while open_ and time.monotonic() < deadline:
            for sock in list(open_):
                try:
                    sock.sendall(b" ")
                except (BrokenPipeError, ConnectionResetError):
                    open_.remove(sock)
                    codes.append(_answer_code(sock))
            time.sleep(0.5)
            for sock in [s for s in open_ if not _still_open(s)]:
                open_.remove(sock)
                codes.append(None)
        assert not open_, f"{len(open_)} of 520 trickling connections still open after 30 s"
        wait_until(lambda: len(accepted) >= 5, timeout=30)
    finally:
        stop.set()
        sender.join(timeout=30)
        for sock in tricklers:
            sock.close()
    assert set(accepted) == {202}, accepted
    with httpx.Client(base_url=receiver.url, timeout=10) as client:
        after = [client.post("/v1/events", json=envelope(f"after-{n}")) for n in range(20)]
    assert [a.status_code for a in after] == [202] * 20


@pytest.mark.parametrize("receiver", [SLOW_BODIES], indirect=True)
def test_a_body_fast_enough_but_never_done_meets_the_request_deadline(receiver: Stack) -> None:
    """A body sent at 300 bytes a second (above the minimum rate) that never ends is answered
    408 `request_timeout` once the request is older than REQUEST_TIMEOUT_SECONDS, and closed;
    a hang-up mid-body on another connection is logged at info, never as a failure."""
    with _open(receiver) as gone:
        gone.sendall(_post_head(1000) + b'{"source": ')
    with _open(receiver) as sock:
        sock.sendall(_post_head(1_000_000))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(60):
                sock.sendall(b" " * 150)
                if select.select([sock], [], [], 0.5)[0]:
                    break  # the server answered (and closes)
        received = _read_all(sock)
    assert b"408" in received.split(b"\r\n", 1)[0], received[:200]
    assert b'"error":"request_timeout"' in received
    wait_until(lambda: "request.client_gone" in receiver.logs("receiver"), timeout=10)
    assert "request.failed" not in receiver.logs("receiver")
