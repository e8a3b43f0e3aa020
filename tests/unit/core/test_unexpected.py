"""An exception no handler answers is a 500 problem document and one short log line, on the
framework's path and on the receiver's shortcut for events alike."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import Request
from structlog.testing import capture_logs

from outbox.app import create_app
from outbox.core.settings import Settings


class Surprise(RuntimeError):
    pass


def _answer(path: str) -> httpx.Response:
    app = create_app(
        Settings(database_url="postgresql+psycopg://unused/x", redis_url="redis://unused")
    )

    async def fails(_: Request) -> None:
        raise Surprise("a detail that must not reach the log")

    app.add_api_route("/v1/surprise", fails, methods=["POST"])
    app.ingest = fails

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, json={})

    return asyncio.run(post())


@pytest.mark.parametrize("path", ["/v1/surprise", "/v1/events"])
def test_an_unexpected_exception_is_a_500_problem_and_one_log_line(path: str) -> None:
    """The answer is 500 `internal_error` as problem+json; the log holds one error line with
    the exception's type, where it was raised, and neither its message nor a traceback."""
    with capture_logs() as logs:
        answer = _answer(path)
    assert answer.status_code == 500, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["error"] == "internal_error"
    failed = [entry for entry in logs if entry["event"] == "request.failed"]
    assert [(e["log_level"], e["error"]) for e in failed] == [("error", "Surprise")]
    assert failed[0]["at"].startswith("test_unexpected.py:")
    assert "must not reach" not in repr(logs)
    assert not any("exc_info" in entry or "exception" in entry for entry in logs)
