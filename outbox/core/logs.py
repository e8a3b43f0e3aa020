"""Structured logs: JSON lines in production, console lines in development (coloured on a
terminal only, so a log file or a pipe never holds escape codes).

Context (correlation id, masked key, event type, attempt) is bound once at each edge (the HTTP
handler, the Celery task) with contextvars, so every line on an event's path carries it.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def configure_logging(log_format: str = "json", level: str = "INFO") -> None:
    """Route structlog and the standard library (uvicorn, celery, alembic) to one renderer.

    Our own lines skip the standard library: structlog filters by level before doing any work
    and writes the rendered line itself (a receiver writes one per event, a worker two per
    attempt, so this is on the hot path). Other libraries' records go through a
    `ProcessorFormatter` with the same processors, so every line looks the same.
    """
    threshold = logging.getLevelName(level.upper())
    if not isinstance(threshold, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=_is_terminal(sys.stderr))
        if log_format == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(threshold),
        logger_factory=_NamedWriterFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, structlog.processors.format_exc_info],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(threshold)
    # Access logs would repeat every request with its URL; the receiver logs what matters.
    logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
    # Libraries that narrate routine work at INFO. Their warnings and errors still show; what
    # the gateway did, it logs itself (`migrations.applied`, `receiver.starting`, ...).
    for name in QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(threshold, logging.WARNING))


QUIET_LIBRARIES = (
    # Two lines per migration context, which readiness opens on every /readyz probe, and a
    # line per plugin when the autogenerate package is imported.
    "alembic",
    # Every initdb and pg_ctl command line with its whole output (a failure is an ERROR with
    # the output, and still shows).
    "pgserver",
    # The server's start and stop narration; a port already taken is an ERROR and still shows.
    "uvicorn.error",
    # The worker's broker address on each connection; a lost connection is a WARNING or an
    # ERROR and still shows (the worker's "ready." line stays: tools wait for it).
    "celery.worker.consumer.connection",
    # A line per task received and per task ended (its retry, its expected dead letter), beside
    # the attempt's own `attempt.claimed` and `attempt.finished`, which say more (transition,
    # outcome, error code, duration): two of a worker's four lines per event, and a share of
    # its CPU per event (docs/explanation/performance.md). A task that raises unexpectedly is an
    # ERROR of `celery.app.trace` and still shows.
    "celery.worker.strategy",
    "celery.app.trace",
    # HTTP clients log each request line with its full URL (httpx at INFO, httpcore and
    # urllib3 at DEBUG), and a route's URL may carry a credential in its query
    # (`?api_key=${CRM_KEY}`) or its userinfo: below WARNING at any LOG_LEVEL. The worker
    # logs each attempt itself (`attempt.finished`), with the route's name, never its URL.
    "httpx",
    "httpcore",
    "urllib3",
    # Broker connection narration (kombu logs the broker's address, with its password masked
    # but its host and database, at INFO and DEBUG); its warnings and errors still show.
    "kombu",
)


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class _NamedWriter(structlog.WriteLogger):
    """Writes rendered lines; carries the name `add_logger_name` puts in each line."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


class _NamedWriterFactory:
    def __init__(self, file: TextIO) -> None:
        # The stream as it is now: Celery later replaces sys.stderr with a proxy that would
        # log every line a second time.
        self.file = file

    def __call__(self, *args: Any) -> _NamedWriter:
        return _NamedWriter(self.file, str(args[0]) if args else "")


def get_logger(name: str) -> Any:
    """A structlog logger named after its module (the `logger` field of each line)."""
    return structlog.get_logger(name)
