"""`python -m worker`: start the Celery worker with the environment's settings."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sqlalchemy.exc import OperationalError

from worker import metrics

# Before anything imports prometheus_client: pool processes write their counters there.
metrics.prepare_directory()

from outbox.connections import ConnectionBudgetError, check_budget, worker_budget  # noqa: E402
from outbox.db import create_sync_engine  # noqa: E402
from outbox.logs import get_logger  # noqa: E402
from outbox.publisher import TASK_QUEUE  # noqa: E402
from outbox.routes import RoutesError  # noqa: E402
from outbox.settings import Settings, get_settings  # noqa: E402
from outbox.timing import TimingError  # noqa: E402
from worker.app import create_worker_app  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="idem worker")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--pool", choices=["threads", "prefork"], default=None)
    args = parser.parse_args(argv)
    overrides: dict[str, Any] = {}
    if args.pool:
        overrides["worker_pool"] = args.pool
    if args.concurrency:
        overrides["worker_concurrency"] = args.concurrency
    settings = get_settings().model_copy(update=overrides)
    try:
        app = create_worker_app(settings)
        _check_connections(settings)
    except (RoutesError, TimingError, ConnectionBudgetError) as error:
        print(f"idem: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings.worker_metrics_port:
        served = metrics.serve(settings.worker_metrics_port)
        get_logger("worker").info(
            "worker.metrics", port=settings.worker_metrics_port, served=served
        )
    app.worker_main(
        [
            "worker",
            "--queues",
            TASK_QUEUE,
            "--concurrency",
            str(settings.concurrency()),
            "--pool",
            settings.worker_pool,
            "--loglevel",
            settings.log_level,
            "--hostname",
            "idem@%h",
            # Task events only when asked for (WORKER_TASK_EVENTS; Flower asks by itself).
            *(["--task-events"] if settings.worker_task_events else []),
            "--without-mingle",
            "--without-gossip",
        ]
    )


def _check_connections(settings: Settings) -> None:
    """Exit 2 before consuming anything when this worker's pools cannot fit the server."""
    budget = worker_budget(
        settings.worker_pool, settings.concurrency(), settings.worker_db_pool_size
    )
    engine = create_sync_engine(settings, pool_size=1, max_overflow=0)
    try:
        check_budget(engine, budget)
    except OperationalError as error:
        # The database may come later; the worker waits for it like for any outage.
        get_logger("worker").warning("connections.unchecked", error=type(error.orig).__name__)
    finally:
        engine.dispose()


if __name__ == "__main__":
    main()
