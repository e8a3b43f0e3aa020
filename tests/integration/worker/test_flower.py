"""Flower watches the workers: it finds the worker and a finished task, with safe arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from outbox.store.embedded import free_port, start_redis, wait_for_port
from tests.support import ROOT, Downstream, Stack, envelope, wait_until

AUTH = ("ops", "flower-secret")


def test_flower_sees_the_worker_and_a_finished_task_without_the_payload(
    own_database: str, routes_file: Path, downstream: Downstream, tmp_path: Path
) -> None:
    """A real worker and Flower: Flower's API lists the worker and the finished idem.process
    task with its masked key and correlation id, never the payload; it refuses anonymous calls."""
    downstream.reset()
    redis, redis_url = start_redis(tmp_path / "redis", appendonly=False)
    stack = Stack(own_database, redis_url, routes_file, tmp_path)
    port = free_port()
    with (tmp_path / "flower.log").open("wb") as log:
        flower = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--broker",
                redis_url,
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                f"--basic-auth={AUTH[0]}:{AUTH[1]}",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=log,
            env=stack.env(),
        )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", auth=AUTH, timeout=10)
    try:
        wait_for_port(port, flower, timeout=30)
        stack.start_all()

        def finished_task() -> dict[str, Any] | None:
            tasks = api.get("/api/tasks").json()
            done = [
                t
                for t in tasks.values()
                if t.get("name") == "idem.process" and t.get("state") == "SUCCESS"
            ]
            return done[0] if done else None

        # Workers send task events only once Flower has switched them on (it asks every 5 s,
        # WORKER_TASK_EVENTS being off by default): an event posted before that is processed
        # unseen, so post another until Flower has seen one finish.
        keys: list[str] = []
        task = None
        with stack.client() as client:
            for n in range(1, 7):
                keys.append(
                    client.post(
                        "/v1/events", json=envelope(f"flower-{n}", correlation_id="corr-flower")
                    ).json()["key"]
                )
                try:
                    task = wait_until(finished_task, timeout=8, interval=0.5)
                    break
                except AssertionError:
                    continue
        assert task is not None, "Flower saw no finished idem.process task in 48 s"
        workers = wait_until(
            lambda: api.get("/api/workers", params={"refresh": "true"}).json(),
            timeout=30,
            interval=0.5,
        )
        anonymous = httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=10)
        everything = api.get("/api/tasks").text
    finally:
        api.close()
        stack.stop_all()
        flower.terminate()
        flower.wait(timeout=15)
        redis.terminate()
        redis.wait(timeout=10)
    assert any(name.startswith("idem@") for name in workers)
    assert task["uuid"].startswith("outbox-")
    assert "…" in task["args"] and not any(key in task["args"] for key in keys)
    assert "corr-flower" in task["kwargs"]
    assert task["runtime"] is not None
    assert not any(f"flower-{n}@example.com" in everything for n in range(1, 7))
    assert anonymous.status_code == 401
