"""A key's attempt log as operators read it: `idem show KEY`, the console's key and dead-letter
pages, and `GET /v1/events/{key}/attempts` (the rows are written by the outcome statements,
`outbox.store.attempts`, which reads them for all three in one shape). A fan-out event has no
attempts of its own: `idem show` lists its deliveries (`outbox.operate.deliveries`).
"""

from __future__ import annotations

from typing import Annotated, Any

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
    answered, which worker and fence (the newest 50 are kept). A fan-out event lists its
    deliveries instead (each a key with attempts of its own); a delivery names its event."""
    from outbox.core.routes import load_routes
    from outbox.operate.deliveries import delivery_summary, key_view

    with terminal.engine() as (settings, engine):
        found = key_view(engine, key, load_routes(settings.routes_file, sources=False))
        attempts = attempts_of(engine, key) if found is not None else []
    if found is None:
        terminal.fail("no event is stored under this key")
    doc: dict[str, Any] = {"key": key}
    if found["event_key"] is not None:
        doc.update(event_key=found["event_key"], destination=found["destination"])
    if found["status"] == "fanned_out":
        doc["status"] = found["event_status"]
        doc["deliveries"] = [delivery_summary(d) for d in found["deliveries"]]
    doc["attempts"] = attempts
    if as_json:
        return terminal.print_json(doc)
    console = terminal.console()
    if "deliveries" in doc:
        return _print_deliveries(doc)
    if "event_key" in doc:
        console.print(
            terminal.shown(f"delivery to {doc['destination']} of event {doc['event_key']}"),
            markup=False,
            highlight=False,
        )
    if not attempts:
        return console.print("no attempts recorded for this key yet")
    headers = "#,started,ms,outcome,status,error code,detail,worker,fence,reconciled"
    console.print(terminal.table(headers, (terminal.pick(a, FIELDS) for a in attempts)))


def _print_deliveries(doc: dict[str, Any]) -> None:
    """A fan-out event: its status (its deliveries') and one row per delivery."""
    console = terminal.console()
    deliveries = doc["deliveries"]
    console.print(
        f"fan-out event, {doc['status']}: {len(deliveries)} deliveries (the event runs nothing"
        " itself; `idem show` a delivery's key for its attempts)",
        markup=False,
        highlight=False,
    )
    fields = "destination key status attempts error_code updated_at"
    headers = "destination,key,status,attempts,error code,last change"
    console.print(terminal.table(headers, (terminal.pick(d, fields) for d in deliveries)))
