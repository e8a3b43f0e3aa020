"""What a worker tells the world: no credential of a route's URL in its log, and metrics on
this machine only unless a token guards them (tests/integration/core/test_start_checks.py: the
worker refuses to serve them elsewhere without one).

Each test runs real processes on a database and a Redis of its own (`protected`).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import Downstream, Stack, envelope, finished

# A credential in the route's URL, as `url = "${CRM_URL}"` with `?api_key=…` would carry it.
CREDENTIAL = "SECRETVALUE"
METRICS_TOKEN = "7f3c9a1e5b2d4f6081a3c5e7b9d1f2a4"


def _routes(path: Path) -> None:
    path.write_text(
        '[[routes]]\nmatch = "crm.*"\nname = "crm"\naction = "http"\n'
        'url = "${IDEM_TEST_CRM_URL}"\n'
        "read_timeout_seconds = 2\nconnect_timeout_seconds = 1\n",
        encoding="utf-8",
    )


def test_a_credential_in_a_route_url_never_reaches_a_log(
    protected: tuple[Stack, Path], downstream: Downstream
) -> None:
    """A route whose URL (from the environment) ends in `?api_key=SECRETVALUE`: the request
    reaches the downstream with it, and no line of the worker's, the relay's or the receiver's
    log holds it, at LOG_LEVEL=DEBUG."""
    stack, routes = protected
    _routes(routes)
    stack.extra_env.update(
        IDEM_TEST_CRM_URL=f"{downstream.url}/tasks?api_key={CREDENTIAL}", LOG_LEVEL="DEBUG"
    )
    stack.start_all()
    with stack.client() as client:
        answer = client.post("/v1/events", json=envelope("quiet-1"))
    assert answer.status_code == 202, answer.text
    state = finished(stack, answer.json()["key"])
    assert state["status"] == "succeeded"
    assert [r["path"] for r in downstream.requests] == [f"/tasks?api_key={CREDENTIAL}"]
    assert '"attempt.finished"' in stack.logs("worker")
    for name in ("worker", "relay", "receiver"):
        assert CREDENTIAL not in stack.logs(name), name


def test_worker_metrics_are_served_on_loopback_only_by_default(
    protected: tuple[Stack, Path],
) -> None:
    """Unconfigured, the worker's metrics answer on 127.0.0.1 and nowhere else (127.0.0.2 is
    another address of this machine, and is refused)."""
    stack, routes = protected
    _routes(routes)
    stack.extra_env["IDEM_TEST_CRM_URL"] = "http://127.0.0.1:9/tasks"
    stack.start_worker()
    port = stack.metrics_ports["worker"]
    assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.2:{port}/metrics", timeout=5)


def test_worker_metrics_bound_beyond_loopback_take_the_metrics_token(
    protected: tuple[Stack, Path],
) -> None:
    """WORKER_METRICS_HOST=0.0.0.0 with METRICS_TOKEN: 401 without the bearer token or with
    a wrong one, the Prometheus text with it."""
    stack, routes = protected
    _routes(routes)
    stack.extra_env.update(
        IDEM_TEST_CRM_URL="http://127.0.0.1:9/tasks",
        WORKER_METRICS_HOST="0.0.0.0",
        METRICS_TOKEN=METRICS_TOKEN,
    )
    stack.start_worker()
    url = f"http://127.0.0.2:{stack.metrics_ports['worker']}/metrics"
    refused = httpx.get(url, timeout=5)
    assert refused.status_code == 401
    assert refused.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN[:-1]}0"}, timeout=5)
    assert wrong.status_code == 401
    served = httpx.get(url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=5)
    assert served.status_code == 200
    # Prometheus' text format (empty until a pool process has counted something).
    assert served.headers["content-type"].startswith("text/plain; version=0.0.4")
