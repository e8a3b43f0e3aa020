"""procrastinate as a peer: the pipeline a user would build with it for the gateway's job.

`python -m bench.peer_procrastinate install`: procrastinate's schema in DATABASE_URL.
`python -m bench.peer_procrastinate serve --port P`: the endpoint (bench/peer_apps.py) defers
one job per event with the key as its `queueing_lock` (procrastinate refuses a second job with
the same queueing lock while one waits in `todo`: AlreadyEnqueued, answered 200) and as its
`lock` (jobs of one lock run one at a time).
`python -m bench.peer_procrastinate worker --concurrency N [--downstream URL]`: one
procrastinate worker running N jobs at once on its event loop (procrastinate's own
concurrency), logging at INFO like the other workers.
"""

from __future__ import annotations

import logging
from typing import Any

from bench.peer_apps import (
    ENDPOINT_CONNECTIONS,
    TASK,
    WORKER_CONNECTIONS,
    Action,
    Endpoint,
    Enqueue,
    conninfo,
    main,
)

DESIGN = "procrastinate"


def build(connections: int, action: Action | None = None) -> tuple[Any, Any]:
    """The procrastinate app on DATABASE_URL and its one task (which runs `action`)."""
    import procrastinate

    connector = procrastinate.PsycopgConnector(
        conninfo=conninfo(), min_size=connections, max_size=connections
    )
    app = procrastinate.App(connector=connector)

    @app.task(name=TASK)  # type: ignore[untyped-decorator]
    async def act(external_id: str, accepted: float) -> None:
        assert action is not None, "the endpoint never runs the task"
        await action(external_id, accepted)

    return app, act


async def open_endpoint() -> Enqueue:
    from procrastinate.exceptions import AlreadyEnqueued

    app, act = build(ENDPOINT_CONNECTIONS)
    await app.open_async()

    async def enqueue(key: str, accepted: float) -> bool:
        try:
            await act.configure(queueing_lock=key, lock=key).defer_async(
                external_id=key, accepted=accepted
            )
        except AlreadyEnqueued:
            return False
        return True

    return enqueue


def create_app() -> Endpoint:
    return Endpoint(open_endpoint)


async def work(concurrency: int, downstream: str) -> None:
    app, _ = build(WORKER_CONNECTIONS, Action(DESIGN, downstream, concurrency))
    async with app.open_async():
        logging.getLogger("bench").info("peer worker ready")
        await app.run_worker_async(concurrency=concurrency, wait=True)


async def install() -> None:
    app, _ = build(1)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


if __name__ == "__main__":
    main("bench.peer_procrastinate:create_app", install, work)
