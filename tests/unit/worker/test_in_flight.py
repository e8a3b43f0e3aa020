"""Unit tests for the wait after a request that got no answer (`worker.outcomes.in_flight_after`,
`outbox.core.inflight`): the next attempt's lookup comes no sooner than the request's own
connect plus read timeout and the route's margin, an answered failure keeps its backoff, a
python action past its limit is given its limit, and the deadline still ends the key."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import claim_at
from tests.unit.worker.test_n8n_answers import _answer
from worker.errors import Failure, TransientError, classify, error_for_response
from worker.outcomes import DeadLetter, Deferred, RetryLater, after_failure, in_flight_after

REQUEST = httpx.Request("POST", "http://crm.test/tasks")
LEASE = 30.0


def _route(**settings: Any) -> Route:
    fields: dict[str, Any] = {
        "match": "crm.*",
        "action": "http",
        "url": "http://crm.test/tasks",
        "connect_timeout_seconds": 1,
        "read_timeout_seconds": 2,
        "backoff_base_seconds": 0.2,
        "backoff_cap_seconds": 1,
    }
    return Route(**{**fields, **settings})


@pytest.mark.parametrize(
    "error",
    [
        httpx.ReadTimeout("timed out", request=REQUEST),
        httpx.WriteTimeout("timed out", request=REQUEST),
        httpx.RemoteProtocolError("closed", request=REQUEST),
        httpx.ReadError("reset", request=REQUEST),
    ],
    ids=["timeout_read", "timeout_write", "connection_dropped", "read_error"],
)
def test_a_request_without_an_answer_is_retried_after_its_own_timeouts(error: Exception) -> None:
    """However small the backoff draws, the retry of an unanswered request waits the route's
    connect plus read timeout and its margin (3 + 2 s here, against a 1 s backoff cap), and
    the store is told the same (the outcome's `in_flight`)."""
    route = _route()
    failure = classify(error)
    assert failure.uncertain and failure.status_code is None
    assert in_flight_after(route, failure, LEASE) == 5.0
    delays = []
    for seed in range(50):
        outcome = after_failure(
            route, claim_at(attempt=1), failure, False, random.Random(seed), LEASE
        )
        assert isinstance(outcome, RetryLater) and outcome.in_flight == 5.0
        delays.append(outcome.delay)
    assert min(delays) == 5.0


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectTimeout("timed out", request=REQUEST),
        httpx.ConnectError("refused", request=REQUEST),
    ],
    ids=["timeout_connect", "connect_refused"],
)
def test_a_request_never_sent_has_nothing_in_flight(error: Exception) -> None:
    """Nothing was sent: nothing can land late; the key is given back unspent and asks again
    within `not_sent_retry_seconds` (tests/unit/worker/test_not_sent.py)."""
    route = _route()
    failure = classify(error)
    assert in_flight_after(route, failure, LEASE) == 0.0
    outcome = after_failure(route, claim_at(attempt=1), failure, False, random.Random(1), LEASE)
    assert isinstance(outcome, Deferred) and outcome.delay <= route.not_sent_retry_seconds


def test_an_answered_failure_has_landed_and_keeps_its_backoff() -> None:
    """A 500 is uncertain (the work may be done) but the request has arrived: no floor."""
    route = _route()
    failure = classify(TransientError("http_500", "500", uncertain=True, status_code=500))
    assert failure.uncertain and failure.status_code == 500
    assert in_flight_after(route, failure, LEASE) == 0.0
    answered = error_for_response(_answer(500, {}))
    assert answered is not None
    assert in_flight_after(route, classify(answered), LEASE) == 0.0


def test_a_python_action_that_ended_keeps_its_margin_and_one_past_its_limit_its_limit() -> None:
    """An uncertain failure a python action raised has ended: only the margin is kept. One
    that ran past its time limit may still be running: its limit and the margin."""
    route = Route(match="crm.*", action="python", function="tests.actions:sleep_then_succeed")
    failure = classify(TransientError("flaky", "its own word", uncertain=True))
    assert in_flight_after(route, failure, LEASE) == 2.0
    late = Failure(True, "action_timeout", "past its limit", None, True)
    assert in_flight_after(route, late, LEASE) == 3 * LEASE + 2.0
    limited = Route(
        match="crm.*",
        action="python",
        function="tests.actions:sleep_then_succeed",
        timeout_seconds=7,
    )
    assert in_flight_after(limited, late, LEASE) == 9.0


def test_a_noop_sends_nothing() -> None:
    route = Route(match="crm.*", action="noop")
    late = Failure(True, "action_timeout", "past its limit", None, True)
    assert in_flight_after(route, late, LEASE) == 0.0


def test_the_deadline_still_ends_a_key_whose_floor_would_pass_it() -> None:
    """A floor that would carry the retry past the retry deadline dead-letters the key now."""
    route = _route(retry_deadline_seconds=10)
    failure = classify(httpx.ReadTimeout("timed out", request=REQUEST))
    inside = after_failure(
        route, claim_at(attempt=2, spent=4), failure, False, random.Random(1), LEASE
    )
    assert isinstance(inside, RetryLater) and inside.delay == 5.0
    past = after_failure(
        route, claim_at(attempt=2, spent=6), failure, False, random.Random(1), LEASE
    )
    assert isinstance(past, DeadLetter) and past.kind == "retries_exhausted"
