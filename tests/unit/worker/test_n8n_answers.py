"""Unit tests for n8n's answers: "webhook not registered" is transient for a bounded window on an
n8n route, and the Idem Trigger's "in progress" is a wait that spends no attempt."""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest

from outbox.core.routes import Route
from tests.unit.worker.claims import claim_at
from worker.errors import classify, error_for_response
from worker.outcomes import DeadLetter, Deferred, after_failure, told

REQUEST = httpx.Request("POST", "http://n8n.test/webhook/crm")
NOT_REGISTERED = {
    "code": 404,
    "message": 'The requested webhook "POST crm" is not registered.',
    "hint": "Click the 'Execute workflow' button on the canvas, then try again.",
}


def _answer(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers, request=REQUEST)


def _route(**settings: Any) -> Route:
    return Route(match="crm.*", action="http", url="http://n8n.test/webhook/crm", **settings)


def _failure(response: httpx.Response, route: Route) -> Any:
    error = error_for_response(
        response, kind=route.kind, n8n_grace_seconds=route.n8n_unregistered_grace_seconds
    )
    assert error is not None
    return classify(error)


def test_not_registered_is_transient_and_certain_on_an_n8n_route_only() -> None:
    """n8n's 404 "not registered" is a transient, not uncertain `n8n_webhook_not_registered`
    with the route's window on an n8n route, and a plain permanent 404 on a generic one."""
    n8n = _route(kind="n8n", n8n_unregistered_grace_seconds=120)
    failure = _failure(_answer(404, NOT_REGISTERED), n8n)
    assert (failure.transient, failure.uncertain, failure.error_code) == (
        True,
        False,
        "n8n_webhook_not_registered",
    )
    assert failure.window_seconds == 120
    assert failure.at_downstream
    generic = _failure(_answer(404, NOT_REGISTERED), _route())
    assert (generic.transient, generic.error_code) == (False, "http_404")
    other_404 = _failure(_answer(404, {"message": "Not found"}), n8n)
    assert (other_404.transient, other_404.error_code) == (False, "http_404")


def test_not_registered_asks_again_within_seconds_and_ends_permanent_past_the_window() -> None:
    """Inside the window the key is given back unspent and asks again within
    `not_sent_retry_seconds` (never past the window's end); at or past the window it is
    dead-lettered as permanent."""
    route = _route(kind="n8n", n8n_unregistered_grace_seconds=60, backoff_cap_seconds=300)
    failure = _failure(_answer(404, NOT_REGISTERED), route)
    rng = random.Random(7)
    inside = after_failure(route, claim_at(attempt=6, spent=50), failure, False, rng, 30.0)
    assert isinstance(inside, Deferred)
    assert inside.not_sent == failure
    assert route.not_sent_retry_seconds / 2 <= inside.delay <= route.not_sent_retry_seconds
    last = after_failure(route, claim_at(attempt=6, spent=58), failure, False, rng, 30.0)
    assert isinstance(last, Deferred) and last.delay <= 2
    past = after_failure(route, claim_at(attempt=7, spent=60), failure, False, rng, 30.0)
    assert isinstance(past, DeadLetter)
    assert (past.kind, past.failure.transient) == ("permanent", False)
    heard = told(past)
    assert heard is not None
    assert heard.failure is None  # told as an answer: n8n did answer


def test_not_registered_inside_the_window_spends_no_attempt() -> None:
    """A re-publish outlasts a route's few quick attempts: inside the window the key is given
    back unspent whatever its attempt count; the window alone ends it. A 503 beside it spends
    the budget as before."""
    route = _route(kind="n8n", n8n_unregistered_grace_seconds=300, max_attempts=4)
    failure = _failure(_answer(404, NOT_REGISTERED), route)
    rng = random.Random(7)
    inside = after_failure(route, claim_at(attempt=9, spent=30), failure, False, rng, 30.0)
    assert isinstance(inside, Deferred) and inside.starts_budget
    heard = told(inside)
    assert heard is not None and heard.failure == failure  # the breaker hears of it
    past = after_failure(route, claim_at(attempt=40, spent=300), failure, False, rng, 30.0)
    assert isinstance(past, DeadLetter) and past.kind == "permanent"
    other = _failure(_answer(503, {"message": "busy"}), route)
    spent = after_failure(route, claim_at(attempt=4, spent=30), other, False, rng, 30.0)
    assert isinstance(spent, DeadLetter) and spent.kind == "retries_exhausted"


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"idem": "in_progress", "retry_after": 7}, {}, 7.0),
        ({"idem": "in_progress"}, {"Retry-After": "3"}, 3.0),
        ({"idem": "in_progress"}, {}, 5.0),
        ({"idem": "in_progress", "retry_after": 0}, {}, 1.0),
        ({"idem": "in_progress", "retry_after": "soon"}, {}, 5.0),
    ],
)
def test_in_progress_is_a_wait_of_the_triggers_asking(
    body: dict[str, Any], headers: dict[str, str], expected: float
) -> None:
    """A 409 `{"idem": "in_progress"}` on any route is a wait of its `retry_after` (else the
    Retry-After header, else five seconds; a second at least) that the breaker never counts."""
    failure = _failure(_answer(409, body, headers), _route())
    assert (failure.wait, failure.error_code) == (True, "in_progress")
    assert failure.retry_after == expected
    assert not failure.at_downstream


def test_a_plain_409_stays_a_permanent_refusal() -> None:
    """A 409 without the trigger's body is the permanent refusal it always was."""
    failure = _failure(_answer(409, {"error": "conflict"}), _route(kind="n8n"))
    assert (failure.transient, failure.wait, failure.error_code) == (False, False, "http_409")


def test_in_progress_defers_unspent_and_ends_at_the_retry_deadline() -> None:
    """An in-progress answer gives the key back unspent for retry_after (capped by the
    backoff cap), starting the deadline; a wait past the deadline dead-letters the key, and
    neither is told to the breaker."""
    route = _route(retry_deadline_seconds=100, backoff_cap_seconds=30, max_attempts=1)
    failure = _failure(_answer(409, {"idem": "in_progress", "retry_after": 60}), route)
    rng = random.Random(7)
    waiting = after_failure(route, claim_at(attempt=1), failure, False, rng, 30.0)
    assert waiting == Deferred("in_progress", 30, failure.detail, starts_budget=True)
    assert told(waiting) is None
    ended = after_failure(route, claim_at(attempt=1, spent=90), failure, False, rng, 30.0)
    assert isinstance(ended, DeadLetter)
    assert ended.kind == "retries_exhausted"
    assert told(ended) is None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"kind": "n8n", "action": "noop"}, "belongs to an http route"),
        ({"kind": "zapier"}, "generic"),
        ({"n8n_unregistered_grace_seconds": 0}, "greater than 0"),
    ],
)
def test_bad_n8n_settings_are_refused(settings: dict[str, Any], message: str) -> None:
    """A kind other than generic or n8n, n8n on a non-http route, or a window of zero is a
    validation error that says so."""
    fields: dict[str, Any] = {"match": "crm.*", "action": "http", "url": "http://n8n.test"}
    with pytest.raises(ValueError, match=message):
        Route(**{**fields, **settings})


@pytest.mark.parametrize(
    ("status", "body", "expected"),
    [
        (
            500,
            {
                "idem": "failed",
                "retryable": True,
                "error_code": "n8n_workflow_failed",
                "effect": "unknown",
            },
            (True, True, "n8n_workflow_failed"),
        ),
        (
            500,
            {"idem": "failed", "retryable": True, "error_code": "crm_down", "effect": "none"},
            (True, False, "crm_down"),
        ),
        (500, {"idem": "failed", "error_code": "not a code!"}, (True, True, "n8n_workflow_failed")),
        (
            409,
            {"idem": "failed", "retryable": False, "error_code": "crm_http_422"},
            (False, False, "crm_http_422"),
        ),
    ],
)
def test_a_failed_trigger_workflow_is_classified_as_the_trigger_says(
    status: int, body: dict[str, Any], expected: tuple[bool, bool, str]
) -> None:
    """The Idem Trigger's `{"idem": "failed"}`: transient with its error code (a code that is
    not one falls back to `n8n_workflow_failed`), uncertain unless `effect` is "none";
    `retryable: false` permanent. Never a wait; a transient one counts for the breaker."""
    failure = _failure(_answer(status, body), _route(kind="n8n"))
    assert (failure.transient, failure.uncertain, failure.error_code) == expected
    assert not failure.wait
    assert failure.at_downstream == failure.transient


def test_a_500_without_the_triggers_body_stays_an_uncertain_http_500() -> None:
    """n8n's own 500 ("Error in workflow") is the uncertain `http_500` it always was."""
    failure = _failure(_answer(500, {"message": "Error in workflow"}), _route(kind="n8n"))
    assert (failure.transient, failure.uncertain, failure.error_code) == (True, True, "http_500")


STARTING_404 = (
    b'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>Error</title>\n'
    b"</head>\n<body>\n<pre>Cannot POST /webhook/idem-trigger-crm</pre>\n</body>\n</html>\n"
)


@pytest.mark.parametrize(
    ("status", "content"),
    [(200, b"n8n is starting up. Please wait"), (404, STARTING_404)],
)
def test_n8n_starting_is_not_registered_yet_never_a_success(status: int, content: bytes) -> None:
    """What n8n answers between opening its port and registering its webhooks (measured in a
    restart of n8n 2.8.4): on an n8n route a transient `n8n_webhook_not_registered` that was
    never sent (no attempt spent), the 200 included; on a generic route the 200 is a success and
    the 404 the permanent `http_404` they always were."""
    answer = httpx.Response(
        status, content=content, headers={"content-type": "text/html"}, request=REQUEST
    )
    n8n = _failure(answer, _route(kind="n8n"))
    assert (n8n.transient, n8n.uncertain, n8n.not_sent, n8n.error_code) == (
        True,
        False,
        True,
        "n8n_webhook_not_registered",
    )
    generic = error_for_response(answer, kind="generic")
    if status == 200:
        assert generic is None
    else:
        assert generic is not None and classify(generic).error_code == "http_404"


def test_a_workflow_answering_like_n8n_starting_is_only_matched_exactly() -> None:
    """A workflow's own 200 whose body merely mentions the words is a success."""
    answer = _answer(200, {"message": "n8n is starting up. Please wait"})
    assert error_for_response(answer, kind="n8n") is None
