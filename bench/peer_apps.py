"""What the peer pipelines (bench/peer_procrastinate.py, bench/peer_pgqueuer.py) share: the
webhook endpoint and the action their workers run.

The endpoint is a bare ASGI app under uvicorn, like the naive design's (bench/naive.py): POST
an event envelope; its `external_id` is the key the peer dedupes by. A new key is queued and
answered 202; a key the peer refuses as a duplicate is answered 200. The action is the naive
worker's: POST to the fake downstream when one is given (with the key as `Idempotency-Key`),
then INCR a counter and push "accept done" (both `time.time()` on this machine) onto the peer's
list in Redis database NAIVE_DB, from which the benchmark reads rates and latencies.

DATABASE_URL names the peer's own database (SQLAlchemy form, as the gateway's), REDIS_URL the
Redis.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.asgi import Receive, Scope, Send, answer, posted, serve
from bench.naive import broker_url

# Connections: the worker's pool as the gateway worker's (WORKER_DB_POOL_SIZE 4, plus one); the
# endpoint's half the receiver's DB_POOL_SIZE (20), so that four pipelines side by side stay
# within PostgreSQL's default max_connections of 100 (a queueing statement takes about a
# millisecond: ten connections carry thousands a second).
ENDPOINT_CONNECTIONS = 10
WORKER_CONNECTIONS = 5
TASK = "bench.act"
# Connections per HTTP client pool in a peer's action (see Action).
SHARD = 16


def times_key(design: str) -> str:
    return f"bench:{design}:times"


def counter_key(design: str) -> str:
    return f"bench:{design}:done"


def conninfo() -> str:
    return os.environ["DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://", 1)


# Queue one event: True when queued, False when the peer refused the key as a duplicate.
Enqueue = Callable[[str, float], Awaitable[bool]]


class Endpoint:
    """POST an envelope: `enqueue(external_id, accept time)`; 202 queued, 200 duplicate.
    `opener` builds the enqueue function on the server's event loop, at the first request."""

    def __init__(self, opener: Callable[[], Awaitable[Enqueue]]) -> None:
        self.opener = opener
        self.enqueue: Enqueue | None = None
        self.opening = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        document = await posted(scope, receive, send)
        if document is None:
            return
        accepted = time.time()
        if self.enqueue is None:
            async with self.opening:
                if self.enqueue is None:
                    self.enqueue = await self.opener()
        if await self.enqueue(str(document["external_id"]), accepted):
            await answer(send, 202, b'{"status":"queued"}')
        else:
            await answer(send, 200, b'{"status":"duplicate"}')


class Action:
    """The job every peer's worker runs once per event (async: the peers' workers are)."""

    def __init__(self, design: str, downstream: str, concurrency: int) -> None:
        self.design = design
        self.downstream = downstream
        self.concurrency = concurrency
        self.redis: Any = None
        self.http: list[Any] = []
        self.calls = 0

    async def __call__(self, external_id: str, accepted: float) -> None:
        if self.redis is None:
            import redis.asyncio

            # Jobs wait for a free connection rather than fail (the default pool refuses
            # more than its size).
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                broker_url(), max_connections=self.concurrency
            )
            self.redis = redis.asyncio.Redis(connection_pool=pool)
        if self.downstream:
            if not self.http:
                import httpx

                # Several small pools rather than one of `concurrency` connections: httpcore's
                # async pool walks all its connections and waiting requests at every change
                # (is_idle, getpeername), which with 128 jobs in flight in one pool cost
                # pgqueuer's worker 8 ms of CPU per event here (py-spy), more than the queue.
                size = min(SHARD, self.concurrency)
                limits = httpx.Limits(max_connections=size, max_keepalive_connections=size)
                shards = -(-self.concurrency // size)
                self.http = [httpx.AsyncClient(limits=limits, timeout=10.0) for _ in range(shards)]
            self.calls += 1
            response = await self.http[self.calls % len(self.http)].post(
                self.downstream,
                json={"external_id": external_id},
                headers={"Idempotency-Key": external_id},
            )
            response.raise_for_status()
        await self.redis.incr(counter_key(self.design))
        await self.redis.rpush(times_key(self.design), f"{accepted} {time.time()}")


def main(
    factory: str,
    install: Callable[[], Awaitable[None]],
    work: Callable[[int, str], Awaitable[None]],
) -> None:
    """A peer's command line: `serve --port P` (the endpoint, `factory` under uvicorn),
    `install` (its schema), `worker --concurrency N [--downstream URL]`."""
    import argparse
    import logging
    import sys

    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["serve", "worker", "install"])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--downstream", default="")
    args = parser.parse_args()
    if args.role == "serve":
        serve(factory, args.port)
    elif args.role == "install":
        asyncio.run(install())
    else:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO)
        asyncio.run(work(args.concurrency, args.downstream))
