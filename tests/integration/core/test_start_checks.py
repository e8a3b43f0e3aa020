"""Settings that stop a process at start: weak secrets stop every process (the receiver, the
relay, the sweeper and the worker refuse `WEBHOOK_SECRETS="weak=a"` and a token of 31 spaces and
a letter, naming the setting and the source, never the value), so does a BROKER_URL naming no
supported broker, and worker metrics bound beyond loopback without a token stop the worker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.store.ports import free_port
from tests.support import OPERATOR_TOKEN, ROOT

PROCESSES = {
    "receiver": ["-m", "outbox.cli", "serve", "--port", "1"],
    "relay": ["-m", "outbox.cli", "relay"],
    "sweeper": ["-m", "outbox.cli", "sweep", "--once"],
    "worker": ["-m", "worker"],
}


def _start(args: list[str], tmp_path: Path, **settings: str) -> subprocess.CompletedProcess[str]:
    """A process with unreachable servers: a refusal must come before it needs them."""
    env = {k: v for k, v in os.environ.items() if k != "ROUTES_FILE"}
    env.update(
        DATABASE_URL="postgresql://nobody@127.0.0.1:1/none",
        REDIS_URL="redis://127.0.0.1:1/0",
        OPERATOR_TOKEN=OPERATOR_TOKEN,
        WORKER_METRICS_PORT="0",
        PYTHONPATH=str(ROOT),
    )
    env.update(settings)
    try:
        return subprocess.run(
            [sys.executable, *args],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{' '.join(args)} started instead of refusing its settings")


@pytest.mark.parametrize("process", PROCESSES)
def test_a_weak_webhook_secret_stops_the_start(process: str, tmp_path: Path) -> None:
    """WEBHOOK_SECRETS="weak=a,shop=<a weak secret>": exit 2 naming WEBHOOK_SECRETS and each
    weak source, without printing a secret."""
    weak = "shop-secret-shop-secret-shop-secret"
    run = _start(PROCESSES[process], tmp_path, WEBHOOK_SECRETS=f"weak=a,shop={weak}")
    assert run.returncode == 2, run.stderr
    assert "WEBHOOK_SECRETS (source 'weak')" in run.stderr
    assert "WEBHOOK_SECRETS (source 'shop')" in run.stderr
    assert weak not in run.stderr and "=a" not in run.stderr


def test_a_token_of_spaces_and_a_letter_stops_the_start(tmp_path: Path) -> None:
    """A CLAIMS_TOKEN of 31 spaces and one letter (32 characters) is refused by name."""
    run = _start(PROCESSES["receiver"], tmp_path, CLAIMS_TOKEN=" " * 31 + "a")
    assert run.returncode == 2, run.stderr
    assert "CLAIMS_TOKEN holds a space" in run.stderr


def test_a_worker_bound_beyond_loopback_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    """WORKER_METRICS_HOST=0.0.0.0 without METRICS_TOKEN: exit 2 before anything else, naming
    both settings."""
    run = _start(
        PROCESSES["worker"],
        tmp_path,
        WORKER_METRICS_HOST="0.0.0.0",
        WORKER_METRICS_PORT=str(free_port()),
        METRICS_TOKEN="",
    )
    assert run.returncode == 2, run.stderr
    assert "WORKER_METRICS_HOST=0.0.0.0" in run.stderr
    assert "METRICS_TOKEN" in run.stderr


@pytest.mark.parametrize("process", ["relay", "worker"])
def test_a_broker_url_of_another_scheme_stops_the_start(process: str, tmp_path: Path) -> None:
    """BROKER_URL=kafka://...: the relay (like every `idem` command) and the worker exit 2
    naming BROKER_URL, its scheme and the schemes that work, before reaching any server."""
    run = _start(PROCESSES[process], tmp_path, BROKER_URL="kafka://broker:9092")
    assert run.returncode == 2, run.stderr
    assert (
        "idem: BROKER_URL has the scheme 'kafka': a broker URL starts with redis://, rediss://,"
        " amqp://, amqps:// (redis: Redis, amqp: RabbitMQ)"
    ) in run.stderr
    assert "Traceback" not in run.stderr
