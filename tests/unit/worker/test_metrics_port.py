"""The worker's metrics endpoint: why it is not served, who may read it, where it may bind."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from worker import metrics


def test_a_taken_port_is_reported_with_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """serve() on a port another socket holds returns a reason naming the port."""
    monkeypatch.setenv(metrics.ENV, str(tmp_path))
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        reason = metrics.serve(port)
    assert reason is not None
    assert f"port {port}" in reason


TOKEN = "2483433c2ea714f3e48cf63e0fe5bce3"


def _app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"metrics\n"]


def _call(app: metrics.WsgiApp, authorization: str | None) -> tuple[str, bytes]:
    seen: list[str] = []
    environ = {} if authorization is None else {"HTTP_AUTHORIZATION": authorization}
    body = b"".join(app(environ, lambda status, headers: seen.append(status)))
    return seen[0], body


@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, "401 Unauthorized"),
        ("Bearer " + TOKEN[:-1] + "0", "401 Unauthorized"),
        ("Basic " + TOKEN, "401 Unauthorized"),
        ("Bearer " + TOKEN, "200 OK"),
        ("bearer  " + TOKEN + " ", "200 OK"),
    ],
)
def test_a_token_guards_the_metrics(authorization: str | None, status: str) -> None:
    """With a token, only `Authorization: Bearer <token>` reaches the metrics."""
    answered, body = _call(metrics.guarded(_app, TOKEN), authorization)
    assert answered == status
    assert (body == b"metrics\n") == (status == "200 OK")


def test_without_a_token_the_metrics_are_not_guarded() -> None:
    """No token: the app answers as it is (the worker then binds loopback only)."""
    assert metrics.guarded(_app, "") is _app


@pytest.mark.parametrize(
    ("host", "token", "refused"),
    [
        ("127.0.0.1", "", False),
        ("::1", "", False),
        ("localhost", "", False),
        ("0.0.0.0", "", True),
        ("", "", True),
        ("10.0.0.5", "", True),
        ("0.0.0.0", TOKEN, False),
    ],
)
def test_metrics_beyond_loopback_need_a_token(host: str, token: str, refused: bool) -> None:
    """Bound anywhere but loopback without METRICS_TOKEN, the worker refuses to start and the
    reason names both settings."""
    reason = metrics.exposure_refusal(host, token)
    assert (reason is not None) == refused
    if reason is not None:
        assert "WORKER_METRICS_HOST" in reason and "METRICS_TOKEN" in reason
