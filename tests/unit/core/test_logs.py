"""What a process writes to its log: the gateway's own lines, no library narration at INFO,
no colour codes where the output is not a terminal."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter

import pytest

from outbox.core.logs import _NamedWriterFactory

# Logs one line of the gateway's, then what the libraries say in routine work and in trouble.
SCRIPT = """
import logging, sys
from outbox.core.logs import configure_logging, get_logger
configure_logging(sys.argv[1], "INFO")
get_logger("idem").info("gateway.line", n=1)
logging.getLogger("alembic.runtime.migration").info("Context impl PostgresqlImpl.")
logging.getLogger("alembic.runtime.plugins").info("setup plugin alembic.autogenerate.schemas")
logging.getLogger("pgserver").info("Running commandline: initdb")
logging.getLogger("uvicorn.error").info("Started server process")
logging.getLogger("celery.worker.consumer.connection").info("Connected to redis://")
logging.getLogger("httpx").info('HTTP Request: POST http://crm/t?api_key=SECRETVALUE "200 OK"')
logging.getLogger("pgserver").error("Failed postgres command initdb")
logging.getLogger("alembic").warning("alembic.trouble")
"""


def _log(log_format: str, script: str = SCRIPT) -> str:
    """What `script` (run with `log_format` as its argument) wrote to its standard error."""
    done = subprocess.run(
        [sys.executable, "-c", script, log_format],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return done.stderr


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_libraries_routine_lines_are_left_out_and_their_trouble_kept(log_format: str) -> None:
    """alembic, pgserver, uvicorn, celery's connection and httpx say nothing at INFO; their
    warnings and errors show."""
    lines = _log(log_format).splitlines()
    assert any("gateway.line" in line for line in lines)
    routines = (
        "Context impl",
        "setup plugin",
        "Running commandline",
        "Started server",
        "Connected",
        "HTTP Request",
    )
    for routine in routines:
        assert not any(routine in line for line in lines), routine
    assert any("Failed postgres command" in line for line in lines)
    assert any("alembic.trouble" in line for line in lines)
    assert len(lines) == 3


# HTTP clients' request lines, at the levels each library writes them.
REQUEST_LINES = """
import logging, sys
from outbox.core.logs import configure_logging, get_logger
configure_logging("json", "DEBUG")
get_logger("idem").debug("gateway.debug_line")
logging.getLogger("httpx").info('HTTP Request: POST http://crm/t?api_key=SECRETVALUE "200 OK"')
logging.getLogger("httpcore.http11").debug("send_request_headers url=/t?api_key=SECRETVALUE")
logging.getLogger("urllib3.connectionpool").debug('http://crm:80 "POST /t?api_key=SECRETVALUE"')
logging.getLogger("kombu.connection").debug("connecting to redis://:SECRETVALUE@redis:6379")
"""


def test_http_clients_request_lines_stay_out_even_at_debug() -> None:
    """A route's URL may carry a credential in its query: httpx, httpcore, urllib3 and kombu
    write no request line at any LOG_LEVEL, while the gateway's own DEBUG lines show."""
    log = _log("json", REQUEST_LINES)
    assert "gateway.debug_line" in log
    assert "SECRETVALUE" not in log


def test_console_lines_carry_no_colour_codes_off_a_terminal() -> None:
    """The console format writes no ANSI escape codes into a pipe or a file."""
    log = _log("console")
    assert "gateway.line" in log
    assert "\x1b[" not in log


FORGING = """
import sys
from outbox.core.logs import configure_logging, get_logger
configure_logging(sys.argv[1], "INFO")
forged = 'x"}\\r\\n{"event": "forged", "log_level": "error"}\\n[error ] forged\\u2028\\x1b[2J'
get_logger("idem").info("gateway.line", correlation_id=forged, event_type=forged)
"""


@pytest.mark.parametrize("log_format", ["console", "json"])
def test_a_line_break_in_a_value_cannot_forge_a_log_line(log_format: str) -> None:
    """A value holding CR, LF, U+2028 and an escape sequence stays inside its one line, in
    either format: the JSON renderer escapes it, the console renderer writes its repr."""
    done = subprocess.run(
        [sys.executable, "-c", FORGING, log_format],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    assert "gateway.line" in lines[0]
    assert "\x1b" not in done.stderr


# Threads write short and long lines at once into a pipe, as a threads worker's attempts do.
THREADS_SCRIPT = """
import fcntl, sys, threading
from outbox.core.logs import configure_logging, get_logger
# A pipe of one page: a long line's write waits for the reader part-way, as a full pipe does,
# and a short line written meanwhile lands inside it unless the writer holds it off.
fcntl.fcntl(2, fcntl.F_SETPIPE_SZ, 4096)
configure_logging(sys.argv[1], "INFO")
log = get_logger("idem")
start = threading.Barrier(16)
def lines(thread):
    start.wait()
    for n in range(300):
        size = 9000 if n % 50 == 0 else 100  # a traceback's length now and then
        log.info("threads.line", thread=thread, n=n, pad="x" * size)
workers = [threading.Thread(target=lines, args=(t,)) for t in range(16)]
for w in workers: w.start()
for w in workers: w.join()
"""


def test_lines_written_from_many_threads_at_once_stay_whole() -> None:
    """Each line reaches a pipe whole and once, however many threads write at the same time
    and however long the line (a line that fits PIPE_BUF is written with no lock held, and a
    longer one holds those off while it is written)."""
    seen: Counter[tuple[int, int]] = Counter()
    for line in _log("json", THREADS_SCRIPT).splitlines():
        record = json.loads(line)  # a line cut or mixed with another fails here
        assert record["event"] == "threads.line"
        seen[(record["thread"], record["n"])] += 1
    assert seen == Counter({(t, n): 1 for t in range(16) for n in range(300)})


def test_a_stream_without_a_descriptor_is_written_as_before() -> None:
    """A stream with no file descriptor (an in-memory capture) still gets every line."""
    stream = io.StringIO()
    writer = _NamedWriterFactory(stream)("idem")
    writer.info('{"event": "one"}')
    writer.info('{"event": "two"}')
    assert stream.getvalue() == '{"event": "one"}\n{"event": "two"}\n'
