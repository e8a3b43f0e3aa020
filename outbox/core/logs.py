"""Structured logs: JSON lines in production, console lines in development (coloured on a
terminal only, so a log file or a pipe never holds escape codes).

Context (correlation id, masked key, event type, attempt) is bound once at each edge (the HTTP
handler, the Celery task) with contextvars, so every line on an event's path carries it.
"""

from __future__ import annotations

import logging
import os
import select
import sys
import threading
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
    """Writes rendered lines, each in one write(2) of its own, with no lock of the process's
    threads; carries the name `add_logger_name` puts in each line.

    structlog's writer holds a lock through each line's write and flush. A threads worker
    finishes up to its concurrency of attempts at once, each with its line, and their threads
    then queued on that lock, each hand-over a wake-up and a trip through the interpreter's
    lock: draining a backlog, the worker spent twice the CPU per event it spends keeping up
    (docs/explanation/performance.md, "What keeps a worker with a backlog as cheap as one
    that keeps up"). A line of up to PIPE_BUF bytes reaches a pipe in one piece whatever else
    writes to it, and a file opened for append takes each write whole, so such lines need no
    lock between them; a longer line (a traceback) is written alone (`_LineGate`). A stream
    with no file descriptor (a test's capture) is written as structlog writes it."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name
        self._fd = _descriptor(file)
        self._gate = _gate_of(self._fd)
        self._encoding = getattr(file, "encoding", None) or "utf-8"
        self._errors = getattr(file, "errors", None) or "backslashreplace"

    def msg(self, message: str) -> None:
        if self._fd is None:
            super().msg(message)
            return
        line = (message + "\n").encode(self._encoding, self._errors)
        if len(line) <= select.PIPE_BUF:
            self._gate.write_short(self._fd, line)
        else:
            self._gate.write_long(self._fd, line)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _descriptor(file: TextIO) -> int | None:
    try:
        return file.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return None


class _LineGate:
    """Lets short lines be written side by side and a long line alone.

    A pipe takes a write of more than PIPE_BUF bytes in pieces when it is full, and a short
    line written meanwhile lands inside the long one. So a long line waits for the short lines
    being written and holds new ones off until it is out. The gate's own lock is held only for
    a counter's update, never through a write, so short lines do not queue on it."""

    def __init__(self) -> None:
        self._state = threading.Condition(threading.Lock())
        self._short = 0  # short lines being written
        self._held = False  # a long line waits for them or is being written
        self._long = threading.Lock()  # one long line at a time

    def write_short(self, fd: int, line: bytes) -> None:
        with self._state:
            while self._held:
                self._state.wait()
            self._short += 1
        try:
            _write_whole(fd, line)
        finally:
            with self._state:
                self._short -= 1
                if self._held and not self._short:
                    self._state.notify_all()

    def write_long(self, fd: int, line: bytes) -> None:
        with self._long:
            with self._state:
                self._held = True
                while self._short:
                    self._state.wait()
            try:
                _write_whole(fd, line)
            finally:
                with self._state:
                    self._held = False
                    self._state.notify_all()


_GATES: dict[int | None, _LineGate] = {}


def _gate_of(fd: int | None) -> _LineGate:
    """One gate per descriptor, shared by every logger that writes to it."""
    return _GATES.setdefault(fd, _LineGate())


def _write_whole(fd: int, line: bytes) -> None:
    view = memoryview(line)
    while view:
        view = view[os.write(fd, view) :]


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
