"""Unit tests for outbox.core.problems: error answers as RFC 9457 problem details."""

from __future__ import annotations

import json
from typing import Any

import pytest

from outbox.core.problems import PROBLEM_JSON, TITLES, Problem, problem_response


def body(problem: Problem) -> dict[str, Any]:
    data = json.loads(bytes(problem_response(problem).body))
    assert isinstance(data, dict)
    return data


def test_problem_response_renders_problem_json() -> None:
    """A Problem becomes application/problem+json with type, title, status, detail and error."""
    problem = Problem(422, "idempotency_key_reused", "the stored payload differs")
    response = problem_response(problem)
    assert response.status_code == 422
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert body(problem) == {
        "type": "urn:idem:error:idempotency_key_reused",
        "title": TITLES["idempotency_key_reused"],
        "status": 422,
        "detail": "the stored payload differs",
        "error": "idempotency_key_reused",
    }


def test_extras_are_top_level_members() -> None:
    """Keyword extras appear as extra members of the problem document."""
    problem = Problem(409, "in_flight", "still processing", key="stripe:x:ab…", retry_in=2.5)
    data = body(problem)
    assert data["key"] == "stripe:x:ab…"
    assert data["retry_in"] == 2.5
    assert data["error"] == "in_flight"


def test_headers_are_sent() -> None:
    """Headers given to a Problem are set on the response."""
    problem = Problem(503, "database_unavailable", "down", headers={"Retry-After": "5"})
    response = problem_response(problem)
    assert response.headers["retry-after"] == "5"


@pytest.mark.parametrize(
    ("error", "title"),
    [
        ("no_route", "No route accepts this event type"),
        ("some_new_code", "some new code"),  # no title registered: derived from the code
    ],
)
def test_title(error: str, title: str) -> None:
    """The title comes from TITLES, else from the error code with spaces for underscores."""
    assert body(Problem(400, error, "d"))["title"] == title


def test_problem_is_an_exception_carrying_its_detail() -> None:
    """A Problem can be raised anywhere in a request; its message is the detail."""
    with pytest.raises(Problem, match="bad header") as caught:
        raise Problem(400, "invalid_idempotency_key", "bad header")
    assert caught.value.status == 400
    assert caught.value.headers == {}
    assert caught.value.extra == {}
