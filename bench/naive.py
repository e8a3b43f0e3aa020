"""The naive design the gateway is compared with: no outbox, no claim.

`python -m bench.naive serve --port P`: a bare uvicorn endpoint (same server options as `idem
serve`) that calls Celery's `send_task` directly and answers 202.
`python -m bench.naive worker --concurrency 2 [--pool threads] [--downstream URL]`: a Celery
worker with the gateway worker's settings (prefetch 1, acks_late, reject on worker lost, JSON,
no task events as in the gateway's default WORKER_TASK_EVENTS=false, no mingle or gossip, log
level INFO) whose task POSTs to the downstream when one is given (the same call the gateway's
http action makes, Idempotency-Key included, no claim, no lease), then INCRs a counter in Redis
and pushes "accept done" (both `time.time()` on this machine) onto a list, from which the
benchmark reads latencies.

REDIS_URL names the broker; the queue, counter and list live in Redis database NAIVE_DB.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import redis

from bench.asgi import Receive, Scope, Send, answer, posted, serve

QUEUE = "naive"
TASK = "bench.naive"
COUNTER = "bench:naive:done"
TIMES = "bench:naive:times"
NAIVE_DB = 1


def broker_url() -> str:
    return os.environ["REDIS_URL"].rsplit("/", 1)[0] + f"/{NAIVE_DB}"


def _conf() -> dict[str, Any]:
    # The gateway worker's settings (worker/app.py), on the naive queue.
    return {
        "task_serializer": "json",
        "accept_content": ["json"],
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        "task_default_queue": QUEUE,
        "worker_hijack_root_logger": False,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"visibility_timeout": 3600},
    }


def celery_app(name: str) -> Any:
    from celery import Celery

    app = Celery(name, broker=broker_url(), set_as_current=True)
    app.conf.update(_conf())
    return app


class NaiveEndpoint:
    """POST anything: send the task with the accept time, answer 202."""

    def __init__(self) -> None:
        self.app = celery_app("naive-endpoint")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        document = await posted(scope, receive, send)
        if document is None:
            return
        accepted = time.time()
        # Directly from the request, as a naive design does: blocking send, no outbox.
        self.app.send_task(TASK, args=[str(document["external_id"]), accepted])
        await answer(send, 202, b'{"status":"queued"}')


def create_app() -> NaiveEndpoint:
    return NaiveEndpoint()


def worker(concurrency: int, pool: str = "prefork", downstream: str = "") -> None:
    import httpx

    logging.basicConfig(stream=sys.stderr, level=logging.INFO)
    app = celery_app("naive")
    state: dict[str, Any] = {}

    @app.task(name=TASK, ignore_result=True)  # type: ignore[untyped-decorator]
    def noop(external_id: str, accepted: float) -> None:
        client = state.get("redis")
        if client is None:
            client = state["redis"] = redis.Redis.from_url(broker_url())
        if downstream:
            http = state.get("http")
            if http is None:
                # One pool per process, shared by its threads, as large as the concurrency.
                limits = httpx.Limits(max_connections=concurrency)
                http = state["http"] = httpx.Client(limits=limits, timeout=10.0)
            http.post(
                downstream,
                json={"external_id": external_id},
                headers={"Idempotency-Key": external_id},
            ).raise_for_status()
        client.incr(COUNTER)
        client.rpush(TIMES, f"{accepted} {time.time()}")

    app.worker_main(
        [
            "worker",
            "--queues",
            QUEUE,
            "--concurrency",
            str(concurrency),
            "--pool",
            pool,
            "--loglevel",
            "INFO",
            "--hostname",
            "naive@%h",
            "--without-mingle",
            "--without-gossip",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "worker"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--pool", choices=["prefork", "threads"], default="prefork")
    parser.add_argument("--downstream", default="")
    args = parser.parse_args()
    if args.role == "serve":
        serve("bench.naive:create_app", args.port)
    else:
        worker(args.concurrency, args.pool, args.downstream)


if __name__ == "__main__":
    main()
