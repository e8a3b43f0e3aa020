"""Flower watches the workers: it finds the worker and a finished task, with safe arguments,
and shows each task in the state its attempt ended in, without Celery retrying anything."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis as redis_client
from prometheus_client.parser import text_string_to_metric_families

from outbox.core.wire import TASK_QUEUE
from outbox.store.embedded import start_redis
from outbox.store.ports import free_port, wait_for_port
from tests.support import ROOT, Downstream, Reply, Stack, envelope, finished, wait_until

AUTH = ("ops", "flower-secret")


@contextlib.contextmanager
def watched_stack(
    database_url: str, routes_file: Path, tmp_path: Path, **env: str
) -> Iterator[tuple[Stack, httpx.Client, int]]:
    """An unstarted stack on a Redis of its own, with a real Flower (basic auth) already
    answering on that broker: the stack, Flower's API client and port."""
    redis, redis_url = start_redis(tmp_path / "redis", appendonly=False)
    stack = Stack(database_url, redis_url, routes_file, tmp_path, extra_env=dict(env))
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
        yield stack, api, port
    finally:
        api.close()
        stack.stop_all()
        flower.terminate()
        flower.wait(timeout=15)
        redis.terminate()
        redis.wait(timeout=10)


def process_tasks(api: httpx.Client, correlation_id: str) -> list[dict[str, Any]]:
    """The idem.process tasks Flower knows of for one correlation id."""
    tasks = api.get("/api/tasks").json()
    return [
        t
        for t in tasks.values()
        if t.get("name") == "idem.process" and correlation_id in (t.get("kwargs") or "")
    ]


def post_until_flower_sees_one_succeed(
    stack: Stack, api: httpx.Client, correlation_id: str
) -> tuple[dict[str, Any], list[str]]:
    """Post events until Flower has seen one of them finish: the task and the keys posted.

    Workers send task events only once Flower has switched them on (it asks every 5 s,
    WORKER_TASK_EVENTS being off by default), and Flower hears only events sent after it
    listens: an event posted before that is processed unseen, so post another."""

    def succeeded() -> dict[str, Any] | None:
        done = [t for t in process_tasks(api, correlation_id) if t.get("state") == "SUCCESS"]
        return done[0] if done else None

    keys: list[str] = []
    with stack.client() as client:
        for n in range(1, 7):
            event = envelope(f"{correlation_id}-{n}", correlation_id=correlation_id)
            keys.append(client.post("/v1/events", json=event).json()["key"])
            try:
                return wait_until(succeeded, timeout=8, interval=0.5), keys
            except AssertionError:
                continue
    raise AssertionError("Flower saw no finished idem.process task in 48 s")


def test_flower_sees_the_worker_and_a_finished_task_without_the_payload(
    own_database: str, routes_file: Path, downstream: Downstream, tmp_path: Path
) -> None:
    """A real worker and Flower: Flower's API lists the worker and the finished idem.process
    task with its masked key and correlation id, never the payload; it refuses anonymous calls."""
    downstream.reset()
    with watched_stack(own_database, routes_file, tmp_path) as (stack, api, port):
        stack.start_all()
        task, keys = post_until_flower_sees_one_succeed(stack, api, "corr-flower")
        workers = wait_until(
            lambda: api.get("/api/workers", params={"refresh": "true"}).json(),
            timeout=30,
            interval=0.5,
        )
        anonymous = httpx.get(f"http://127.0.0.1:{port}/api/workers", timeout=10)
        everything = api.get("/api/tasks").text
    assert any(name.startswith("idem-") for name in workers)
    assert task["uuid"].startswith("outbox-")
    assert "…" in task["args"] and not any(key in task["args"] for key in keys)
    assert "corr-flower" in task["kwargs"]
    assert task["runtime"] is not None
    assert not any(f"corr-flower-{n}@example.com" in everything for n in range(1, 7))
    assert anonymous.status_code == 401


# The default pool in `make test`; prefork (its outcome crosses a pipe) in `make test-slow`.
@pytest.mark.parametrize("pool", ["threads", pytest.param("prefork", marks=pytest.mark.slow)])
def test_flower_shows_a_retry_as_retry_and_a_dead_letter_as_failure_with_their_codes(
    own_database: str, routes_file: Path, downstream: Downstream, tmp_path: Path, pool: str
) -> None:
    """A key refused with 422 is dead-lettered: its task is FAILURE in Flower, naming
    `http_422`. A key answered 503 then 201 has two tasks: RETRY naming `http_503`, then
    SUCCESS. Celery retries nothing itself: the downstream sees exactly one request per
    attempt, the worker counts no redelivery (`blocked`), and the broker ends with no message
    queued or unacknowledged. Under both pools (prefork carries the outcome across a pipe)."""
    downstream.reset()
    with watched_stack(own_database, routes_file, tmp_path, WORKER_POOL=pool) as (
        stack,
        api,
        _,
    ):
        stack.start_all()
        _, ok_keys = post_until_flower_sees_one_succeed(stack, api, "corr-ok")
        with stack.client() as client:
            downstream.behaviour = lambda key, n: Reply(422)
            dead = client.post("/v1/events", json=envelope("dead", correlation_id="corr-dead"))
            dead_key = dead.json()["key"]
            assert finished(stack, dead_key)["status"] == "failed_final"
            downstream.behaviour = lambda key, n: Reply(503) if n == 1 else Reply()
            retried = client.post("/v1/events", json=envelope("again", correlation_id="corr-re"))
            retried_key = retried.json()["key"]
            assert finished(stack, retried_key)["status"] == "succeeded"

        def states(correlation_id: str, count: int) -> list[dict[str, Any]] | None:
            tasks = process_tasks(api, correlation_id)
            settled = len(tasks) == count and all(
                t["state"] in ("SUCCESS", "FAILURE", "RETRY") for t in tasks
            )
            return sorted(tasks, key=lambda t: t["received"]) if settled else None

        dead_tasks = wait_until(lambda: states("corr-dead", 1), timeout=30, interval=0.5)
        retry_tasks = wait_until(lambda: states("corr-re", 2), timeout=30, interval=0.5)
        broker = redis_client.Redis.from_url(stack.broker_url)
        # Acknowledged: nothing waits in the queue, nothing is held unacknowledged (where a
        # Celery countdown retry or a message left for redelivery would sit).
        wait_until(lambda: broker.llen(TASK_QUEUE) == 0 and broker.hlen("unacked") == 0, timeout=15)
        everything = api.get("/api/tasks").text
        worker_metrics = httpx.get(
            f"http://127.0.0.1:{stack.metrics_ports['worker']}/metrics", timeout=5
        ).text
        broker.close()

    (dead_task,) = dead_tasks
    assert dead_task["state"] == "FAILURE"
    assert dead_task["exception"] == "DeadLettered('http_422')"
    first, second = retry_tasks
    assert first["state"] == "RETRY"
    assert first["exception"] == "RetryScheduled('http_503')"
    assert second["state"] == "SUCCESS"
    assert first["uuid"] != second["uuid"]  # two outbox rows, not one message sent again
    # One request per attempt, and none more.
    requests = Counter(r["key"] for r in downstream.requests)
    assert requests == Counter({**dict.fromkeys(ok_keys, 1), dead_key: 1, retried_key: 2})
    attempts = {
        (s.labels["outcome"], s.labels["error_code"]): s.value
        for family in text_string_to_metric_families(worker_metrics)
        for s in family.samples
        if s.name == "idem_attempts_total"
    }
    assert {k: v for k, v in attempts.items() if v} == {
        ("succeeded", ""): len(ok_keys) + 1,
        ("dead_letter", "http_422"): 1,
        ("retry", "http_503"): 1,
    }
    assert "@example.com" not in everything
