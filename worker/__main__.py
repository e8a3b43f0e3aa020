"""`python -m worker`: start the Celery worker with the environment's settings.

The exit status tells a supervisor whether to start the worker again: 0 only after a shutdown
signal (SIGTERM, SIGINT, SIGQUIT), non-zero whenever Celery stopped by itself. Celery's own
`worker_main` returns normally after an "Unrecoverable error" (a broker that restarted, failed
over or answered an error), so without this a worker under `Restart=on-failure` stays down.
A worker refused its name on RabbitMQ (another connection holds its control queue:
`worker.control`) exits 75.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import warnings
from typing import Any

from sqlalchemy.exc import OperationalError

from worker import metrics

# Before anything imports prometheus_client: pool processes write their counters there.
metrics.prepare_directory()

from celery import signals  # noqa: E402
from celery.exceptions import SecurityWarning  # noqa: E402

from outbox.core.broker import BrokerError, check_broker  # noqa: E402
from outbox.core.logs import configure_logging, get_logger  # noqa: E402
from outbox.core.routes import RoutesError  # noqa: E402
from outbox.core.settings import Settings, get_settings  # noqa: E402
from outbox.core.timeouts import TimingError  # noqa: E402
from outbox.core.tokens import TokenError, check_settings  # noqa: E402
from outbox.core.wire import TASK_QUEUE  # noqa: E402
from outbox.store.connections import ConnectionBudgetError, check_budget, worker_budget  # noqa: E402
from outbox.store.engines import create_sync_engine  # noqa: E402
from worker import control  # noqa: E402
from worker.app import create_worker_app  # noqa: E402

# The status of a worker that stopped without being asked to (EX_SOFTWARE, sysexits.h).
EXIT_STOPPED_BY_ITSELF = 70

log = get_logger("worker")


def exit_status(celery_status: object, asked_to_stop: bool) -> int:
    """The process's exit status from Celery's and whether a shutdown signal came first.

    Celery reports an unrecoverable error as 1, a remote shutdown as its message (a string),
    and a signalled shutdown as 0; a 0 without a signal is a stop nobody asked for.
    """
    if isinstance(celery_status, int) and not isinstance(celery_status, bool):
        if celery_status != 0:
            return celery_status
    elif celery_status is not None:
        return 1
    return 0 if asked_to_stop else EXIT_STOPPED_BY_ITSELF


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
    # The lines before Celery starts (metrics, connections) look like every other line; Celery
    # configures logging again the same way when it starts (worker/app.py, setup_logging).
    configure_logging(settings.log_format, settings.log_level)
    try:
        check_broker(settings)
        check_settings(settings)
        _check_metrics_exposure(settings)
        app = create_worker_app(settings)
        _check_connections(settings)
    except (BrokerError, RoutesError, TimingError, TokenError, ConnectionBudgetError) as error:
        print(f"idem: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if settings.worker_metrics_port:
        host, port = settings.worker_metrics_host, settings.worker_metrics_port
        refused = metrics.serve(port, host, settings.metrics_token)
        if refused is None:
            log.info("worker.metrics", host=host, port=port, served=True)
        else:
            log.warning("worker.metrics", host=host, port=port, served=False, reason=refused)

    asked = threading.Event()

    @signals.worker_shutting_down.connect(weak=False)  # type: ignore[untyped-decorator]
    def _asked_to_stop(sig: str | None = None, **_: Any) -> None:
        asked.set()

    # Started by root, Celery refuses to run when it accepts pickle and otherwise warns, in
    # eight lines, on every start. This worker accepts JSON only (worker/app.py), so the warning
    # says nothing it does not already know; C_FORCE_ROOT stays unset, since it would also lift
    # the refusal for pickle.
    warnings.filterwarnings("ignore", category=SecurityWarning)
    # `start`, not `worker_main`: the latter drops the worker's exit code.
    celery_status = app.start(
        [
            # No banner: it is not a log line (and breaks JSON logs); "ready." still is one.
            "--quiet",
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
            settings.worker_name or f"idem-{os.getpid()}@%h",
            # Task events only when asked for (WORKER_TASK_EVENTS; Flower asks by itself).
            *(["--task-events"] if settings.worker_task_events else []),
            "--without-mingle",
            "--without-gossip",
        ]
    )
    status = exit_status(celery_status, asked.is_set())
    if control.name_refused.is_set():
        status = control.EXIT_NAME_IN_USE
    if not asked.is_set():
        log.error("worker.stopped_by_itself", celery_status=str(celery_status), exit_status=status)
    raise SystemExit(status)


def _check_metrics_exposure(settings: Settings) -> None:
    """Refuse to serve metrics beyond this machine without a token (worker/metrics.py)."""
    if settings.worker_metrics_port:
        refusal = metrics.exposure_refusal(settings.worker_metrics_host, settings.metrics_token)
        if refusal is not None:
            raise TokenError(refusal)


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
