"""The terminal conventions every `idem` command shares, whichever context it belongs to.

Settings are loaded and checked once at start (broker, tokens, timing, routes: a wrong value is
a refusal before anything runs); a refusal is `idem: message` on stderr with exit 2; tables are
rich tables whose cells are never read as markup; `--json` prints one JSON document on stdout;
progress goes to stderr. Text a sender or a workflow wrote (a `fail` detail, a payload, a key)
reaches the operator's terminal with its control characters written as escapes (`\x1b`,
`\r`, `\u202e`): an escape sequence in a stored detail cannot clear the screen, colour it,
hide a link (OSC 8) or rewrite a line. Contexts' commands (`outbox.operate.commands`,
`outbox.maintenance.commands`, ...) import this module, and `outbox.cli` registers them; no
command module imports `outbox.cli`, so the entry point has no cycle.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from outbox.core.broker import BrokerError, check_broker
from outbox.core.logs import configure_logging
from outbox.core.routes import RoutesError, load_routes
from outbox.core.settings import Settings, get_settings
from outbox.core.timeouts import TimingError, check_timing
from outbox.core.tokens import TokenError, check_settings

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table
    from sqlalchemy import Engine

AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
By = Annotated[str | None, typer.Option(help="Operator name on record (default: $USER).")]


def load_settings(*, need_servers: bool = True, sources: bool = True) -> Settings:
    """The environment's settings, logging configured, every start-up check passed (the routes
    file's `[[sources]]` only when `sources`: see `load_routes`)."""
    settings = get_settings()
    configure_logging(settings.log_format, settings.log_level)
    if need_servers and not settings.database_url:
        fail("DATABASE_URL is not set (or use `idem dev`, which starts embedded servers)")
    if need_servers and not settings.broker():
        fail("BROKER_URL is not set (or use `idem dev`, which starts embedded servers)")
    try:
        check_broker(settings)
        check_settings(settings)
        check_timing(settings, load_routes(settings.routes_file, sources=sources))
    except (BrokerError, RoutesError, TimingError, TokenError) as error:
        fail(str(error))
    return settings


def fail(message: str) -> NoReturn:
    typer.echo(f"idem: {message}", err=True)
    raise typer.Exit(2)


@contextlib.contextmanager
def engine() -> Iterator[tuple[Settings, Engine]]:
    """Settings and a one-connection engine; an unreachable database is a refusal, not a trace."""
    from sqlalchemy.exc import OperationalError

    from outbox.store.engines import create_sync_engine

    # Operators' commands need the database only, not the broker.
    settings = load_settings(need_servers=False)
    if not settings.database_url:
        fail("DATABASE_URL is not set")
    engine = create_sync_engine(settings, pool_size=1)
    try:
        yield settings, engine
    except OperationalError as error:
        fail(f"database unavailable: {str(error.orig or error).strip().splitlines()[0]}")
    finally:
        engine.dispose()


def operator(by: str | None) -> str:
    return (by or "").strip() or os.environ.get("USER") or "cli"


def pick(item: dict[str, Any], fields: str) -> list[Any]:
    """The values of space-separated `fields`; instants (`*_at`) in UTC to the second."""
    values = []
    for field in fields.split():
        value = item[field]
        if field.endswith("_at") and value:
            value = datetime.fromisoformat(value).astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        values.append(value)
    return values


# What a terminal acts on: C0 controls but the line break and the tab, DEL, C1 controls (0x9b
# is a CSI of its own on some terminals) and the bidirectional overrides and isolates, which
# reorder what is shown.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return {0x0D: "\\r"}.get(code) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def shown(text: str) -> str:
    """`text` with every character a terminal would act on written as its escape."""
    return _CONTROLS.sub(_escape, text)


def json_text(doc: Any, indent: int = 2) -> str:
    """A JSON document for the terminal: the characters JSON itself leaves raw (DEL, C1,
    bidirectional controls) written as \\u escapes, so the text stays valid JSON."""
    text = json.dumps(doc, indent=indent, ensure_ascii=False, default=str)
    return _CONTROLS.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def print_json(doc: Any) -> None:
    typer.echo(json_text(doc))


def console() -> Console:
    from rich.console import Console

    return Console()


def table(headers: str, rows: Iterable[Iterable[Any]], **options: Any) -> Table:
    """A table of comma-separated `headers`; stored text is never read as rich markup and
    its control characters are shown escaped."""
    from rich.table import Column, Table
    from rich.text import Text

    # Folded, not cut short: an id or a key in a narrow terminal must stay whole to be copied.
    table = Table(*(Column(h, overflow="fold") for h in headers.split(",")), **options)
    for row in rows:
        table.add_row(*(Text("" if value is None else shown(str(value))) for value in row))
    return table


def progress(*, disable: bool) -> Progress:
    """A spinner and bar on stderr, so stdout stays the answer."""
    from rich import progress as p
    from rich.console import Console

    columns = [p.SpinnerColumn(), p.TextColumn("{task.description}"), p.BarColumn()]
    columns += [p.MofNCompleteColumn(), p.TimeElapsedColumn()]
    return p.Progress(*columns, console=Console(stderr=True), transient=True, disable=disable)
