"""Every endpoint bounds what it reads: one body limit with 413 (declared or chunked), a header
limit with 431, and malformed values in headers and bodies that answer 4xx, never 500."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support import AUTH, Stack, envelope, query

LIMIT = 1_048_576  # MAX_BODY_BYTES's default

# (method, path, headers) of endpoints that read a body, one of each kind.
BODY_ENDPOINTS = [
    ("POST", "/v1/claims", {"content-type": "application/json"}),
    ("POST", "/v1/claims/some-key/complete", {"content-type": "application/json"}),
    ("POST", "/v1/replays", {"content-type": "application/json", **AUTH}),
    ("POST", "/v1/dead-letters/1/discard", {"content-type": "application/json", **AUTH}),
    ("POST", "/console/sign-in", {"content-type": "application/x-www-form-urlencoded"}),
]


def _chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
    """A body sent chunked (no Content-Length), `total` bytes in all."""
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


@pytest.mark.parametrize(("method", "path", "headers"), BODY_ENDPOINTS)
def test_every_body_over_the_limit_gets_413(
    stack: Stack, method: str, path: str, headers: dict[str, str]
) -> None:
    """A body above MAX_BODY_BYTES gets 413 payload_too_large on every endpoint that reads one,
    whether its size is declared or it arrives chunked."""
    with stack.client() as client:
        declared = client.request(method, path, content=b"x" * (LIMIT + 1), headers=headers)
        chunked = client.request(method, path, content=_chunks(LIMIT + 1), headers=headers)
    for answer in (declared, chunked):
        assert answer.status_code == 413, (path, answer.status_code, answer.text[:300])
        if answer.headers["content-type"].startswith("text/html"):
            # The console answers its pages' errors as a page.
            assert f"The body exceeds {LIMIT} bytes." in answer.text
        else:
            assert answer.json()["error"] == "payload_too_large"
            assert answer.json()["limit"] == LIMIT
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_a_body_within_the_limit_still_reaches_the_endpoint(stack: Stack) -> None:
    """A chunked body under the limit is read whole: the claim is taken."""
    body = json.dumps({"key": "limits-ok", "payload": {"pad": "x" * 100_000}}).encode()
    with stack.client() as client:
        answer = client.post(
            "/v1/claims",
            content=iter([body[:50_000], body[50_000:]]),
            headers={"content-type": "application/json"},
        )
    assert answer.status_code == 201, answer.text


def test_oversized_headers_get_431(stack: Stack) -> None:
    """Headers larger than 16 KiB in total get 431 headers_too_large on the event path and on
    every other endpoint, before anything reads them."""
    padding = {f"x-pad-{i}": "y" * 1000 for i in range(17)}
    with stack.client() as client:
        event = client.post("/v1/events", json=envelope("hdr-1"), headers=padding)
        claim = client.post("/v1/claims", json={"key": "hdr-1"}, headers=padding)
        stats = client.get("/v1/stats", headers={**AUTH, **padding})
    for answer in (event, claim, stats):
        assert answer.status_code == 431, answer.text[:300]
        assert answer.json()["error"] == "headers_too_large"
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


def test_a_timestamp_of_thousands_of_digits_is_refused_not_a_500(stack: Stack) -> None:
    """An X-Idem-Timestamp of 5 000 digits on a signed source gets 401 invalid_signature."""
    body = json.dumps(envelope("long-stamp", "noop.signed", source="signed")).encode()
    with stack.client() as client:
        answer = client.post(
            "/v1/events",
            content=body,
            headers={
                "content-type": "application/json",
                "X-Idem-Timestamp": "1" * 5000,
                "X-Idem-Signature": "sha256=" + "0" * 64,
            },
        )
    assert answer.status_code == 401, answer.text[:300]
    assert answer.json()["error"] == "invalid_signature"
    assert query(stack.database_url, "SELECT count(*) FROM idempotency_keys") == [(0,)]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_in_a_claim_is_refused_not_a_500(stack: Stack, constant: str) -> None:
    """NaN and Infinity, which are not JSON, in a claim's payload or a completion's result get
    422 invalid_request and change nothing."""
    with stack.client() as client:
        claim = client.post(
            "/v1/claims",
            content=f'{{"key": "nan-1", "payload": {{"amount": {constant}}}}}',
            headers={"content-type": "application/json"},
        )
        taken = client.post("/v1/claims", json={"key": "nan-2"})
        assert taken.status_code == 201, taken.text
        token = taken.json()["lease_token"]
        complete = client.post(
            "/v1/claims/nan-2/complete",
            content=f'{{"lease_token": "{token}", "result": [1, {{"x": {constant}}}]}}',
            headers={"content-type": "application/json"},
        )
    for answer in (claim, complete):
        assert answer.status_code == 422, answer.text[:300]
        assert answer.json()["error"] == "invalid_request"
    assert query(stack.database_url, "SELECT idempotency_key, status FROM idempotency_keys") == [
        ("nan-2", "processing")
    ]
