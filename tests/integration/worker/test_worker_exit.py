"""The worker's exit status: 0 only when it was asked to stop, so a supervisor that restarts on
failure (systemd's Restart=on-failure, a Kubernetes OnFailure job) brings it back otherwise.

Each test runs `idem worker` against a redis-server of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support import ROOT, wait_until


@contextlib.contextmanager
def _worker(
    database_url: str, redis_url: str, routes_file: Path, log: Path
) -> Iterator[tuple[subprocess.Popen[bytes], redis.Redis[Any]]]:
    """`idem worker` on its own Redis, and a client of that Redis; killed if still running."""
    env = dict(
        os.environ,
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        ROUTES_FILE=str(routes_file),
        LOG_FORMAT="json",
        WORKER_METRICS_PORT="0",
        PYTHONPATH=str(ROOT),
    )
    with log.open("wb") as out:
        worker = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "worker", "--concurrency", "1"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    client: redis.Redis[Any] = redis.Redis.from_url(redis_url)
    try:
        yield worker, client
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        client.close()


def _consuming(client: redis.Redis[Any]) -> list[dict[str, Any]]:
    """The worker's connections blocked waiting for a task: it is consuming."""
    return [c for c in client.client_list() if c.get("cmd") in ("brpop", "blpop")]


def test_worker_exits_non_zero_when_celery_stops_by_itself(
    database_url: str, own_redis: str, routes_file: Path, tmp_path: Path
) -> None:
    """A broker error Celery cannot recover from (a blocked read answered with an error, as on
    a Redis fail-over) stops the worker, and `idem worker` then exits non-zero, not 0."""
    with _worker(database_url, own_redis, routes_file, tmp_path / "worker.log") as (worker, client):
        for blocked in wait_until(lambda: _consuming(client), timeout=60):
            client.execute_command("CLIENT", "UNBLOCK", blocked["id"], "ERROR")
        status = worker.wait(timeout=60)
    log = (tmp_path / "worker.log").read_text(errors="replace")
    assert status != 0, log[-2000:]
    assert "Unrecoverable error" in log
    assert "worker.stopped_by_itself" in log


def test_worker_exits_zero_when_asked_to_stop(
    database_url: str, own_redis: str, routes_file: Path, tmp_path: Path
) -> None:
    """SIGTERM (what `docker compose stop` and systemd send) is a stop that was asked for:
    the worker shuts down warm and exits 0."""
    with _worker(database_url, own_redis, routes_file, tmp_path / "worker.log") as (worker, client):
        wait_until(lambda: _consuming(client), timeout=60)
        worker.send_signal(signal.SIGTERM)
        status = worker.wait(timeout=60)
    assert status == 0, (tmp_path / "worker.log").read_text(errors="replace")[-2000:]


def test_worker_starts_without_the_providers_secrets(
    database_url: str, own_redis: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker verifies no signature, so it reads the routes file's routes and not its
    `[[sources]]`: a source whose secret is not in the worker's environment does not stop it
    (compose gives the worker no provider secret)."""
    monkeypatch.delenv("IDEM_TEST_PROVIDER_SECRET", raising=False)
    routes = tmp_path / "routes.toml"
    routes.write_text(
        '[[routes]]\nmatch = "*"\naction = "noop"\n\n'
        '[[sources]]\nname = "stripe"\nscheme = "stripe"\n'
        'secret = "${IDEM_TEST_PROVIDER_SECRET}"\n',
        encoding="utf-8",
    )
    with _worker(database_url, own_redis, routes, tmp_path / "worker.log") as (worker, client):
        wait_until(lambda: _consuming(client) or worker.poll() is not None, timeout=60)
        consuming = worker.poll() is None
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert consuming, (tmp_path / "worker.log").read_text(errors="replace")[-2000:]
