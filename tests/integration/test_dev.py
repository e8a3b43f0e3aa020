"""`idem dev` on a machine with only Python: embedded servers, all processes, clean stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from outbox.store.embedded import free_port, wait_for_port
from tests.support import ROOT, wait_until


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry.name))
    return found


def test_dev_runs_everything_on_embedded_servers_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """Without DATABASE_URL/REDIS_URL, `idem dev` starts embedded PostgreSQL and Redis, runs an
    event to `succeeded`, and Ctrl-C stops every process it started."""
    port = free_port()
    # Outside pytest's private temporary tree (the embedded server may run as its own user).
    data_dir = Path(tempfile.mkdtemp(prefix="idem-test-dev-"))
    env = {
        k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL", "ROUTES_FILE")
    }
    env.update(PORT=str(port), DATA_DIR=str(data_dir), PYTHONPATH=str(ROOT), LOG_FORMAT="json")
    with (tmp_path / "dev.log").open("wb") as log:
        dev = subprocess.Popen(
            [sys.executable, "-m", "outbox.cli", "dev", "--concurrency", "1"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        wait_for_port(port, dev, timeout=60)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
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
        assert _processes_mentioning(str(data_dir)), "embedded servers should be running"
    finally:
        dev.send_signal(signal.SIGINT)
        code = dev.wait(timeout=60)
    assert code == 0, (tmp_path / "dev.log").read_text()[-3000:]
    wait_until(lambda: not _processes_mentioning(str(data_dir)), timeout=20)
    shutil.rmtree(data_dir, ignore_errors=True)
