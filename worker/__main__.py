"""`python -m worker`: start the Celery worker with the environment's settings."""

from __future__ import annotations

import argparse
import sys

from worker import metrics

# Before anything imports prometheus_client: pool processes write their counters there.
metrics.prepare_directory()

from outbox.logs import get_logger  # noqa: E402
from outbox.publisher import TASK_QUEUE  # noqa: E402
from outbox.routes import RoutesError  # noqa: E402
from outbox.settings import get_settings  # noqa: E402
from outbox.timing import TimingError  # noqa: E402
from worker.app import create_worker_app  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="idem worker")
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--pool", default="prefork")
    args = parser.parse_args(argv)
    settings = get_settings()
    try:
        app = create_worker_app(settings)
    except (RoutesError, TimingError) as error:
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
            str(args.concurrency or settings.worker_concurrency),
            "--pool",
            args.pool,
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


if __name__ == "__main__":
    main()
