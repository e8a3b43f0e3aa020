"""pgqueuer as a peer: the pipeline a user would build with it for the gateway's job.

`python -m bench.peer_pgqueuer install`: pgqueuer's tables in DATABASE_URL.
`python -m bench.peer_pgqueuer serve --port P`: the endpoint (bench/peer_apps.py) enqueues one
job per event with the key as its `dedupe_key` (pgqueuer refuses a second job with the same
key while one is queued or picked: DuplicateJobError, answered 200), through an asyncpg pool of
ENDPOINT_CONNECTIONS.
`python -m bench.peer_pgqueuer worker --concurrency N [--downstream URL]`: one QueueManager on
one asyncpg connection (pgqueuer's quickstart) with at most N jobs picked at once
(`max_concurrent_tasks`) and its default batch of 10, logging at INFO like the other workers.

asyncpg, not psycopg: pgqueuer's psycopg driver shares its one connection between queries and
a LISTEN loop that holds it for up to a second when no notification comes, so once events stop
arriving every dequeue waited that second (measured here: 20 jobs/s until the queue was empty).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any

from bench.peer_apps import ENDPOINT_CONNECTIONS, TASK, Action, Endpoint, Enqueue, main
from bench.peer_apps import conninfo as database

DESIGN = "pgqueuer"


async def driver() -> Any:
    import asyncpg
    from pgqueuer import AsyncpgDriver

    return AsyncpgDriver(await asyncpg.connect(database()))


async def open_endpoint() -> Enqueue:
    import asyncpg
    from pgqueuer import AsyncpgPoolDriver, Queries
    from pgqueuer.domain.errors import DuplicateJobError

    pool = await asyncpg.create_pool(
        database(), min_size=ENDPOINT_CONNECTIONS, max_size=ENDPOINT_CONNECTIONS
    )
    queries = Queries(AsyncpgPoolDriver(pool))

    async def enqueue(key: str, accepted: float) -> bool:
        payload = json.dumps({"external_id": key, "accepted": accepted}).encode()
        try:
            await queries.enqueue(TASK, payload, dedupe_key=key)
        except DuplicateJobError:
            return False
        return True

    return enqueue


def create_app() -> Endpoint:
    return Endpoint(open_endpoint)


async def work(concurrency: int, downstream: str) -> None:
    from pgqueuer import Job, Queries, QueueManager

    action = Action(DESIGN, downstream, concurrency)
    manager = QueueManager(Queries(await driver()))

    @manager.entrypoint(TASK)  # type: ignore[untyped-decorator]
    async def act(job: Job) -> None:
        document = json.loads(job.payload or b"{}")
        await action(document["external_id"], document["accepted"])

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, manager.shutdown.set)
    logging.getLogger("bench").info("peer worker ready")
    await manager.run(max_concurrent_tasks=concurrency)


async def install() -> None:
    from pgqueuer import Queries

    await Queries(await driver()).install()


if __name__ == "__main__":
    main("bench.peer_pgqueuer:create_app", install, work)
