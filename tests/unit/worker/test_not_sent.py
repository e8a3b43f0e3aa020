"""A request that never reached anything that could act spends no attempt: which failures are
"not sent" (told apart on real sockets: refused, a name that does not resolve, a TLS handshake
that failed, against a connection that broke after the request was written), what the outcome
is, and the breaker's short cool-down for them."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import claim_at
from worker.errors import Failure, TransientError, classify
from worker.guard import _cooldowns
from worker.outcomes import DeadLetter, Deferred, RetryLater, after_failure, told


def _route(**settings: Any) -> Route:
    fields: dict[str, Any] = {"match": "crm.*", "action": "http", "url": "http://crm.test/tasks"}
    return Route(**{**fields, **settings})


@contextmanager
def _server(serve: Any) -> Iterator[int]:
    """A TCP server on loopback whose every connection is handed to `serve`; its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                serve(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def _failure_of(url: str) -> Failure:
    try:
        httpx.post(url, json={"n": 1}, timeout=3)
    except httpx.HTTPError as error:
        return classify(error)
    raise AssertionError("the request was expected to fail")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_refused_connection_is_not_sent() -> None:
    failure = _failure_of(f"http://127.0.0.1:{_closed_port()}/tasks")
    assert (failure.error_code, failure.transient, failure.uncertain) == (
        "connect_refused",
        True,
        False,
    )
    assert failure.not_sent and failure.at_downstream


def test_a_name_that_does_not_resolve_is_not_sent() -> None:
    failure = _failure_of("http://no-such-host.invalid/tasks")
    assert failure.error_code in ("connect_refused", "timeout_connect")
    assert failure.not_sent and not failure.uncertain


def test_a_tls_handshake_that_fails_is_not_sent() -> None:
    """An https request to a server that closes the connection instead of a handshake: the
    request was never written."""
    with _server(lambda conn: None) as port:
        failure = _failure_of(f"https://127.0.0.1:{port}/tasks")
    assert failure.not_sent and not failure.uncertain


def test_a_connection_that_breaks_after_the_request_is_sent_may_have_acted() -> None:
    """The server reads the request, then closes without an answer: uncertain, and spent."""

    def read_then_close(conn: socket.socket) -> None:
        conn.recv(65536)

    with _server(read_then_close) as port:
        failure = _failure_of(f"http://127.0.0.1:{port}/tasks")
    assert (failure.error_code, failure.uncertain, failure.not_sent) == (
        "connection_dropped",
        True,
        False,
    )


def test_an_action_may_say_not_sent_unless_it_also_says_uncertain() -> None:
    assert classify(TransientError("smtp_refused", not_sent=True)).not_sent
    assert not classify(TransientError("smtp_refused", not_sent=True, uncertain=True)).not_sent
    assert not classify(TransientError("smtp_busy")).not_sent


def test_not_sent_is_given_back_unspent_past_the_attempt_budget() -> None:
    """Attempt 40 of a route of 2: still given back unspent, within half to all of
    `not_sent_retry_seconds`, starting the deadline's clock, and told to the breaker."""
    route = _route(max_attempts=2, not_sent_retry_seconds=4)
    failure = classify(httpx.ConnectError("refused"))
    rng = random.Random(3)
    delays = []
    for _ in range(50):
        outcome = after_failure(route, claim_at(attempt=40, spent=100), failure, False, rng, 30.0)
        assert isinstance(outcome, Deferred)
        assert (outcome.reason, outcome.starts_budget, outcome.not_sent) == (
            "connect_refused",
            True,
            failure,
        )
        delays.append(outcome.delay)
        heard = told(outcome)
        assert heard is not None and heard.failure == failure
    assert min(delays) >= 2.0 and max(delays) <= 4.0


def test_not_sent_ends_at_the_retry_deadline() -> None:
    route = _route(retry_deadline_seconds=600, not_sent_retry_seconds=5)
    failure = classify(httpx.ConnectError("refused"))
    ended = after_failure(route, claim_at(spent=599), failure, False, random.Random(1), 30.0)
    assert isinstance(ended, DeadLetter) and ended.kind == "retries_exhausted"


def test_a_sent_failure_still_spends_the_budget() -> None:
    """A 503 beside it: retried with backoff while attempts remain, then dead-lettered."""
    route = _route(max_attempts=2)
    failure = classify(TransientError("http_503", status_code=503))
    assert not failure.not_sent
    assert isinstance(
        after_failure(route, claim_at(attempt=1), failure, False, random.Random(1), 30.0),
        RetryLater,
    )
    spent = after_failure(route, claim_at(attempt=2), failure, False, random.Random(1), 30.0)
    assert isinstance(spent, DeadLetter) and spent.kind == "retries_exhausted"


def test_the_default_deadline_rides_out_hours() -> None:
    assert _route().retry_deadline_seconds == 6 * 3600


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (Failure(True, "connect_refused", "", not_sent=True), (5.0, 5.0)),
        (Failure(True, "http_503", ""), (10.0, 300.0)),
        (None, (10.0, 300.0)),
    ],
    ids=["not_sent", "sent", "answered"],
)
def test_a_circuit_opened_by_unsent_requests_reopens_shortly_and_never_doubles(
    failure: Failure | None, expected: tuple[float, float]
) -> None:
    cooldowns = _cooldowns(_route(), failure)
    assert (cooldowns["cooldown"], cooldowns["cooldown_cap"]) == expected
