"""A key's attempt log as operators read it: `idem show KEY`, the console's key and dead-letter
pages, and `GET /v1/events/{key}/attempts` (the rows are written by the outcome statements,
`outbox.store.attempts`, which reads them for all three in one shape).
"""

from __future__ import annotations

from typing import Annotated

import typer

from outbox import terminal
from outbox.store.attempts import attempts_of
from outbox.terminal import AsJson

FIELDS = (
    "attempt started_at duration_ms outcome status_code error_code detail worker fence reconciled"
)


def show_command(
    key: Annotated[str, typer.Argument(metavar="KEY", help="The full idempotency key.")],
    as_json: AsJson = False,
) -> None:
    """A key's attempts, oldest first: when, how long, the outcome, what the downstream
    answered, which worker and fence (the newest 50 are kept)."""
    from outbox.store.ingest import KEY_EXISTS

    with terminal.engine() as (_, engine):
        with engine.connect() as conn:
            exists = conn.execute(KEY_EXISTS, {"key": key}).first() is not None
        found = attempts_of(engine, key) if exists else []
    if not exists:
        terminal.fail("no event is stored under this key")
    if as_json:
        return terminal.print_json({"key": key, "attempts": found})
    console = terminal.console()
    if not found:
        return console.print("no attempts recorded for this key yet")
    headers = "#,started,ms,outcome,status,error code,detail,worker,fence,reconciled"
    console.print(terminal.table(headers, (terminal.pick(a, FIELDS) for a in found)))
