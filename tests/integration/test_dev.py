"""`idem dev` on a machine with only Python: embedded servers, all processes, operator tools
from a second shell, clean stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from sqlalchemy.engine import make_url

from outbox.store.ports import free_port, wait_for_port
from tests.support import ROOT, run_idem, system_state, wait_until


def _ports(shared: dict[str, str]) -> list[int]:
    """The embedded PostgreSQL's and Redis's ports, from the URLs `idem dev` wrote."""
    return [make_url(shared[name]).port or 0 for name in ("DATABASE_URL", "REDIS_URL")]


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def _second_shell(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """An `idem` command from another shell in the same folder: none of the servers' settings
    in its environment."""
    unset = ("DATABASE_URL", "REDIS_URL", "OPERATOR_TOKEN", "DATA_DIR", "ROUTES_FILE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(ROOT)
    return run_idem(*args, env=env, cwd=cwd, timeout=60)


def _dev_env(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def test_dev_runs_everything_on_embedded_servers_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """Without DATABASE_URL/REDIS_URL, `idem dev` starts embedded PostgreSQL and Redis, runs an
    event to `succeeded`, lets `idem stats`, `idem dlq list` and the operator API of a second
    shell reach them with nothing set, changes nothing outside its folder, and Ctrl-C stops
    every process it started, each once."""
    port = free_port()
    project = tmp_path / "project"  # under pytest's private tree, as a clone under /root is
    project.mkdir()
    data_dir = project / ".idem"
    before = system_state(project)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "ROUTES_FILE", "OPERATOR_TOKEN", "DATA_DIR")
    }
    env.update(PORT=str(port), PYTHONPATH=str(ROOT), LOG_FORMAT="json")
    with (tmp_path / "dev.log").open("wb") as log:
        dev = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "dev", "--concurrency", "1"],
            cwd=project,
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_port(port, dev, timeout=60)
        shared = _dev_env(data_dir / "env")
        assert shared["OPERATOR_TOKEN"] in (tmp_path / "dev.log").read_text()
        bearer = {"Authorization": f"Bearer {shared['OPERATOR_TOKEN']}"}
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}", timeout=10, headers=bearer
        ) as client:
            answer = client.post(
                "/v1/events",
                json={
                    "source": "demo",
                    "event_type": "demo.created",
                    "external_id": "1",
                    "payload": {"hello": "world"},
                },
            )
            assert answer.status_code == 202
            key = answer.json()["key"]
            wait_until(
                lambda: client.get(f"/v1/events/{key}").json()["status"] == "succeeded", timeout=60
            )
            assert client.get("/v1/dead-letters").status_code == 200
        stats = _second_shell(project, "stats", "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["keys_by_status"]["succeeded"] == 1
        dead_letters = _second_shell(project, "dlq", "list", "--json")
        assert dead_letters.returncode == 0, dead_letters.stderr
        assert all(_listening(port) for port in _ports(shared)), "embedded servers run"
    finally:
        dev.send_signal(signal.SIGINT)
        code = dev.wait(timeout=60)
    output = (tmp_path / "dev.log").read_text()
    assert code == 0, output[-3000:]
    # One shutdown line per process: each child was told once.
    assert output.count("Warm shutdown") == 1, output[-3000:]
    for stopped in ("receiver.stopped", "relay.stopped", "sweeper.stopped", "dev.stopped"):
        assert output.count(f'"{stopped}"') == 1, (stopped, output[-3000:])
    assert not (data_dir / "env").exists()
    wait_until(lambda: not any(_listening(port) for port in _ports(shared)), timeout=20)
    assert system_state(project) == before
