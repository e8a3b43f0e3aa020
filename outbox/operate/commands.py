"""Operators' terminal commands: dead letters and replays (stats, stuck keys and routes are in
`outbox.operate.watch`, the purge in `outbox.maintenance.commands`).

Each command calls one synchronous store (`deadletters`, `replay`, `stats` own the SQL and the
transactions) and prints rich tables, or with `--json` one JSON document on stdout.
Exit codes: 0 done; 1 an answer a script acts on (stuck keys found, a replay whose set changed
since its dry run); 2 refused (`idem: message` on stderr; click's usage errors are 2 as well).
The conventions they share with every command are in `outbox.terminal`. Stores and rich are
imported inside the commands so that `idem --help` stays quick.
"""

from __future__ import annotations

import shlex
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from outbox import terminal
from outbox.core.logs import get_logger
from outbox.terminal import AsJson, By

if TYPE_CHECKING:
    from outbox.operate.replay import ReplayReport, ReplayRequest

log = get_logger("idem.operator")

Instant = Annotated[str | None, typer.Option(help="ISO-8601, or how long ago such as 2h.")]
EventType = Annotated[str | None, typer.Option(help="Event type or glob, e.g. 'crm.*'.")]
Source = Annotated[str | None, typer.Option(help="The sender, e.g. stripe.")]
Destination = Annotated[
    str | None, typer.Option(help="A fan-out route's destination: its deliveries only.")
]
Id = Annotated[int, typer.Argument(metavar="ID", help="The dead letter's id (idem dlq list).")]
STATUS_HELP = "failed_retryable, failed_final, quarantined or processing; repeatable."

# Rows of a replay report shown before "… and N more": a screenful; --json lists them all.
SHOWN_ROWS = 20
# Replay options named otherwise than their ReplayRequest field.
FLAGS = {"statuses": "status", "keys": "key"}
# What `dlq show` lists about a dead letter, in this order (`_at` fields are instants).
DETAIL_FIELDS = (
    "key event_key destination source event_type external_id version route key_status"
    " correlation_id error_code"
    " error_detail attempts accepted_at first_failed_at last_failed_at resolved_by resolved_at"
    " resolution_note duplicate_count blocked_deliveries reclaimed_count"
)

dlq_app = typer.Typer(help="Dead letters: list, show, discard.", no_args_is_help=True)


@dlq_app.command("list")
def dlq_list(
    event_type: EventType = None,
    source: Source = None,
    destination: Destination = None,
    kind: Annotated[
        Literal["permanent", "retries_exhausted", "quarantined"] | None,
        typer.Option(help="Only dead letters of this kind."),
    ] = None,
    status: Annotated[
        Literal["open", "replayed", "discarded", "superseded"] | None,
        typer.Option(help="Only dead letters in this state."),
    ] = None,
    since: Instant = None,
    until: Instant = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Rows per page.")] = 50,
    cursor: Annotated[int | None, typer.Option(min=1, help="From a previous page.")] = None,
    as_json: AsJson = False,
) -> None:
    """Dead letters, newest first, a page at a time."""
    from outbox.operate.deadletters import DeadLetterFilter, list_dead_letters

    window = _instant("--since", since), _instant("--until", until)
    where = DeadLetterFilter(event_type, source, kind, status, *window, destination=destination)
    with terminal.engine() as (_, engine):
        items, next_cursor = list_dead_letters(engine, where, limit, cursor)
    if as_json:
        return terminal.print_json({"items": items, "next_cursor": next_cursor})
    console = terminal.console()
    if not items:
        return console.print("no dead letters match")
    fields = "id masked_key kind error_code attempts event_type destination status last_failed_at"
    headers = "id,key,kind,error code,attempts,event type,destination,status,last failed"
    console.print(terminal.table(headers, (terminal.pick(item, fields) for item in items)))
    if next_cursor is not None:
        console.print(f"next page: --cursor {next_cursor}")


@dlq_app.command("show")
def dlq_show(dead_letter_id: Id, as_json: AsJson = False) -> None:
    """One dead letter: the event (secrets masked), the last error and the key's history."""
    from outbox.operate.deadletters import get_dead_letter

    with terminal.engine() as (_, engine):
        found = get_dead_letter(engine, dead_letter_id)
    if found is None:
        terminal.fail(f"no dead letter has id {dead_letter_id}")
    if as_json:
        return terminal.print_json(found)
    console = terminal.console()
    console.print(f"dead letter {found['id']}: {found['status']}, {found['kind']}", style="bold")
    flat = {**found, "error_detail": found["last_error"]["detail"]}
    details = [
        (name.removesuffix("_at").replace("_", " "), value)
        for name, value in zip(
            DETAIL_FIELDS.split(), terminal.pick(flat, DETAIL_FIELDS), strict=True
        )
        if value not in (None, "")
    ]
    console.print(terminal.table("field,value", details, show_header=False, box=None))
    console.print("payload", style="bold")
    # Not rich's JSON, which parses the text again and writes C1 controls back raw.
    console.print(terminal.json_text(found["payload"]), markup=False)
    fields = "id kind error_code attempts first_failed_at last_failed_at resolution resolved_by"
    headers = "id,kind,error code,attempts,first failed,last failed,resolution,by,resolved"
    history = (terminal.pick(h, f"{fields} resolved_at") for h in found["history"])
    console.print(terminal.table(headers, history, title="history", title_justify="left"))


@dlq_app.command("discard")
def dlq_discard(
    dead_letter_id: Id,
    reason: Annotated[str, typer.Option(help="Why it will not be replayed (kept on record).")],
    by: By = None,
    as_json: AsJson = False,
) -> None:
    """Close an open dead letter without replaying it."""
    from outbox.operate.deadletters import discard_dead_letter

    if not reason.strip():
        terminal.fail("--reason must not be empty")
    operator = terminal.operator(by)
    with terminal.engine() as (_, engine):
        done = discard_dead_letter(engine, dead_letter_id, reason.strip(), operator)
    if not done:
        terminal.fail(f"dead letter {dead_letter_id} does not exist or is no longer open")
    log.info("dead_letter.discarded", id=dead_letter_id, by=operator)
    if as_json:
        return terminal.print_json({"id": dead_letter_id, "status": "discarded"})
    terminal.console().print(f"discarded dead letter {dead_letter_id}")


def replay_command(
    status: Annotated[list[str] | None, typer.Option(metavar="STATUS", help=STATUS_HELP)] = None,
    event_type: EventType = None,
    source: Source = None,
    destination: Destination = None,
    since: Instant = None,
    until: Instant = None,
    key: Annotated[list[str] | None, typer.Option(metavar="KEY", help="Repeatable.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many keys (1-100000).")] = 100,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Report only (the default).")] = False,
    confirm: Annotated[str | None, typer.Option(help="The dry run's token: execute.")] = None,
    by: By = None,
    as_json: AsJson = False,
) -> None:
    """Put failed keys back on the path: a dry run first, then --confirm with its token."""
    from pydantic import ValidationError

    from outbox.core.routes import load_routes
    from outbox.operate import replay

    if dry_run and confirm:
        terminal.fail("choose --dry-run or --confirm, not both")
    try:
        # Validated from plain values: the model is where the rules of a replay filter live.
        filters = {"statuses": status or None, "keys": key or None, "limit": limit}
        bounds = {"event_type": event_type, "source": source, "since": since, "until": until}
        bounds["destination"] = destination
        mode = {"dry_run": confirm is None, "confirm": confirm}
        request = replay.ReplayRequest.model_validate({**filters, **bounds, **mode})
    except ValidationError as error:
        terminal.fail(_validation_message(error))
    operator = terminal.operator(by)
    with terminal.engine() as (settings, engine):
        routes, secret = load_routes(settings.routes_file), replay.confirm_secret(settings)
        if request.dry_run:
            report = replay.dry_run(engine, request, routes, secret=secret)
            return _print_report(report, request, as_json)
        with terminal.progress(disable=as_json) as progress:
            task = progress.add_task("replaying", total=None)

            def advance(replayed: int, of: int) -> None:
                # A set larger than one batch commits batch by batch: say how far it got.
                progress.update(task, completed=replayed, total=of)
                log.info("replay.progress", replayed=replayed, of=of)

            outcome = replay.execute(
                engine, request, routes, operator, secret=secret, progress=advance
            )
    match outcome:
        case replay.Stale(report):
            typer.echo("idem: the set changed; nothing replayed", err=True)
            _print_report(report, request, as_json, stale=True)
            raise typer.Exit(1)
        case replay.Executed(replay_id, report):
            count = len(report.to_replay)
            log.info("replay.executed", replay_id=replay_id, by=operator, keys=count)
            if as_json:
                return terminal.print_json(
                    {"dry_run": False, "replay_id": replay_id, **report.as_dict()}
                )
            changed = report.changed_since_dry_run
            left = f"; {changed} changed since the dry run and were left alone" if changed else ""
            terminal.console().print(f"replayed {count} keys (replay {replay_id}){left}")


def _print_report(
    report: ReplayReport, request: ReplayRequest, as_json: bool, *, stale: bool = False
) -> None:
    summary = report.as_dict()
    command = _confirm_command(request, report.confirm)
    if as_json:
        return terminal.print_json({"dry_run": True, "stale": stale, **summary, "command": command})
    console = terminal.console()
    head = f"matched {report.matched}: {len(report.to_replay)} to replay"
    console.print(f"{head}, {len(report.skipped)} skipped", style="bold")
    for title, rows in (
        ("to replay", [(k,) for k in summary["keys"]]),
        ("skipped", [(s["key"], s["reason"]) for s in report.skipped]),
        ("by event type", sorted(report.by_event_type.items())),
        ("by target", sorted(report.by_target.items())),
    ):
        if rows:
            options = {"title": title, "title_justify": "left", "show_header": False}
            console.print(
                terminal.table("1,2"[: 2 * len(rows[0]) - 1], rows[:SHOWN_ROWS], **options)
            )
        if len(rows) > SHOWN_ROWS:
            console.print(f"… and {len(rows) - SHOWN_ROWS} more (--json lists them all)")
    if not report.to_replay:
        return console.print("nothing to replay")
    console.print("to replay them, run:")
    console.print(f"  {command}", markup=False, highlight=False, soft_wrap=True)


def _confirm_command(request: ReplayRequest, token: str) -> str:
    """The command line that executes exactly this filter (the document the token binds)."""
    args = ["idem", "replay"]
    for field, value in request.filter_document().items():
        for one in value if isinstance(value, list) else [value]:
            args += [f"--{FLAGS.get(field, field).replace('_', '-')}", str(one)]
    return shlex.join([*args, "--confirm", token])


def _instant(option: str, value: str | None) -> datetime | None:
    from outbox.core.timewindow import parse_instant

    try:
        return None if value is None else parse_instant(value)
    except ValueError as error:
        terminal.fail(f"{option}: {error}")


def _validation_message(error: Any) -> str:
    """A pydantic ValidationError as one line: `field: message; ...`."""
    parts = []
    for problem in error.errors():
        where = ".".join(str(p) for p in problem["loc"])
        message = str(problem["msg"]).removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return "; ".join(parts)


def deliver_command(
    route: Annotated[str, typer.Option(help="The fan-out route whose events to deliver.")],
    destination: Annotated[str, typer.Option(help="The [[destinations]] table to deliver to.")],
    since: Annotated[str, typer.Option(help="Events accepted from: ISO-8601 or e.g. 7d.")],
    until: Instant = None,
    execute: Annotated[bool, typer.Option("--execute", help="Add the deliveries.")] = False,
    as_json: AsJson = False,
) -> None:
    """Deliver a fan-out route's past events to a destination they did not have (one added to
    the route later): a dry run by default, then --execute. Each event gets one delivery
    there, however often this runs."""
    from outbox.core.routes import load_routes
    from outbox.core.timewindow import parse_instant
    from outbox.operate.backfill import BackfillRefused, backfill

    try:
        window = (parse_instant(since), parse_instant(until) if until else None)
    except ValueError as error:
        terminal.fail(str(error))
    with terminal.engine() as (settings, engine):
        try:
            report = backfill(
                engine,
                load_routes(settings.routes_file, sources=False),
                route,
                destination,
                *window,
                execute=execute,
            )
        except BackfillRefused as error:
            terminal.fail(str(error))
    if execute:
        log.info("deliveries.added", route=route, destination=destination, added=report.added)
    if as_json:
        return terminal.print_json(report.__dict__)
    if report.dry_run:
        terminal.console().print(
            f"dry run: {report.events} events of route {route} have no delivery to"
            f" {destination}; run again with --execute to deliver them"
        )
    else:
        terminal.console().print(f"{report.added} deliveries added to {destination}")
