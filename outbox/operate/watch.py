"""Operators' commands for watching: stats, stuck keys, and routes (list, pause, resume).

Same conventions as every command (`outbox.terminal`, whose helpers these use): tables or
`--json`; exit 0 done, 1 an answer a script acts on (stuck keys found), 2 refused.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from outbox import terminal
from outbox.core.logs import get_logger
from outbox.terminal import AsJson, By

log = get_logger("idem.operator")

routes_app = typer.Typer(
    help="Routes and destinations: state (circuit, paused), limits, backlog; pause and resume.",
    invoke_without_command=True,
)


@routes_app.callback()
def routes_list(ctx: typer.Context, as_json: AsJson = False) -> None:
    """Every configured route, then every destination, with its state, attempts in flight,
    limits and backlog; a fan-out route with the destinations it delivers to."""
    if ctx.invoked_subcommand is not None:
        return
    from outbox.core.routes import load_routes
    from outbox.operate.routestate import list_routes

    with terminal.engine() as (settings, engine):
        items = list_routes(engine, load_routes(settings.routes_file))
    if as_json:
        return terminal.print_json(items)
    fields = (
        "name kind does state in_flight max_in_flight rate_per_second backlog open_until"
        " paused_reason"
    )
    headers = (
        "route,kind,action,state,in flight,max in flight,rate/s,backlog,probe at,paused because"
    )
    rows = (terminal.pick({**item, **_shown(item)}, fields) for item in items)
    terminal.console().print(terminal.table(headers, rows))


def _shown(item: dict[str, Any]) -> dict[str, Any]:
    """A row's kind and action in words: a fan-out route's destinations, a destination's
    routes."""
    if item["kind"] == "fan_out":
        does = f"none, fans out to {', '.join(item['fan_out'])}"
        return {"kind": "fan-out", "does": does, "state": "—"}
    if item["kind"] == "destination":
        feeding = ", ".join(item["routes"]) or "no route"
        return {"does": f"{item['action']} (from {feeding})"}
    return {"does": item["action"]}


def _known(name: str, action: str) -> None:
    """Refuse (exit 2) a name that is no route or destination, or a fan-out route's."""
    from outbox.core.routes import load_routes
    from outbox.operate.routestate import FansOut, check_pausable

    with terminal.engine() as (settings, engine):
        routes = load_routes(settings.routes_file)
        if routes.by_label(name) is None:
            terminal.fail(f"no configured route or destination is named {name!r}")
        try:
            check_pausable(engine, routes, name, action)
        except FansOut as refused:
            terminal.fail(str(refused))


@routes_app.command("pause")
def routes_pause(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The route or destination.")],
    reason: Annotated[str, typer.Option(help="Why (kept on record).")],
    by: By = None,
    as_json: AsJson = False,
) -> None:
    """Stop acting on a route's or destination's keys: they are accepted and wait as pending
    (a fan-out route is refused: pause its destinations)."""
    from outbox.operate.routestate import pause

    if not reason.strip():
        terminal.fail("--reason must not be empty")
    _known(name, "pause")
    operator = terminal.operator(by)
    with terminal.engine() as (_, engine):
        changed = pause(engine, name, reason.strip(), operator)
    if changed:
        log.info("route.paused", route=name, by=operator)
    if as_json:
        return terminal.print_json({"name": name, "paused": True, "changed": changed})
    terminal.console().print(
        f"paused route {name}" if changed else f"route {name} was already paused"
    )


@routes_app.command("resume")
def routes_resume(
    name: Annotated[str, typer.Argument(metavar="NAME", help="The route or destination.")],
    by: By = None,
    as_json: AsJson = False,
) -> None:
    """Act on a paused route's keys again, the held ones first, in the order they arrived."""
    from outbox.operate.routestate import resume

    _known(name, "resume")
    operator = terminal.operator(by)
    out = terminal.console()

    def report(queued: int) -> None:
        if not as_json:
            out.print(f"queued {queued} held keys so far")

    with terminal.engine() as (_, engine):
        done = resume(engine, name, operator, progress=report)
    if done.changed or done.queued:
        log.info("route.resumed", route=name, by=operator, changed=done.changed, queued=done.queued)
    if as_json:
        doc = {"name": name, "paused": False, "changed": done.changed, "queued": done.queued}
        return terminal.print_json(doc)
    state = f"resumed route {name}" if done.changed else f"route {name} was not paused"
    out.print(f"{state}: {done.queued} held keys queued in acceptance order")


def stuck_command(
    older_than: Annotated[str, typer.Option(help="How long untouched, e.g. 5m or 2h.")],
    limit: Annotated[int, typer.Option(min=1, max=10_000, help="Rows listed at most.")] = 100,
    as_json: AsJson = False,
) -> None:
    """Unfinished keys untouched too long, and lanes a dead letter blocks; exits 1 when there
    are any (for cron alerts)."""
    from outbox.core.timewindow import parse_duration
    from outbox.operate import stats

    try:
        seconds = parse_duration(older_than).total_seconds()
    except ValueError as error:
        terminal.fail(f"--older-than: {error}")
    with terminal.engine() as (_, engine):
        rows = stats.stuck(engine, seconds, limit)
        lanes = stats.blocked_lanes(engine, seconds, limit)
        waiting = stats.waiting_on_routes(engine)
    if waiting:  # on stderr, so --json's stdout stays what is stuck
        held = ", ".join(f"{name} {count}" for name, count in waiting.items())
        note = f"not stuck: {sum(waiting.values())} keys wait on paused or open routes ({held})"
        typer.echo(note, err=True)
    if as_json:
        terminal.print_json({"keys": rows, "blocked_lanes": lanes})
    else:
        _print_stuck(rows, lanes, older_than)
    raise typer.Exit(1 if rows or lanes else 0)


def _print_stuck(rows: list[dict[str, Any]], lanes: list[dict[str, Any]], older_than: str) -> None:
    console = terminal.console()
    if not rows:
        console.print(f"no keys stuck longer than {older_than}")
    else:
        fields = "key status event_type attempts updated_at age_seconds"
        headers = "key,status,event type,attempts,last change,age (s)"
        console.print(terminal.table(headers, (terminal.pick(r, fields) for r in rows)))
    if lanes:
        # Each lane once, with its head: replay or discard the head's dead letter to go on.
        fields = "route lane head_key head_status head_error_code held_by dead_letter_id waiting"
        headers = "route,lane,head key,head status,error code,held by,dead letter,waiting behind"
        options = {"title": "blocked lanes", "title_justify": "left"}
        console.print(terminal.table(headers, (terminal.pick(r, fields) for r in lanes), **options))


def stats_command(as_json: AsJson = False) -> None:
    """Keys by status, outbox backlog and lag, processing, open dead letters, duplicates, and
    each destination's deliveries on their way or failed."""
    from outbox.core.routes import load_routes
    from outbox.operate import stats

    with terminal.engine() as (settings, engine):
        configured = load_routes(settings.routes_file, sources=False).destinations
        doc = stats.collect(engine, configured)
    if as_json:
        return terminal.print_json(doc)
    held = doc.pop("routes")
    destinations = doc.pop("destinations")
    rows: list[tuple[str, Any]] = []
    for section, value in doc.items():  # a section of numbers, or one number
        nested = value.items() if isinstance(value, dict) else []
        rows += [(section, "" if nested else value)]
        rows += [(f"  {n}", "none" if v is None else v) for n, v in nested]
    rows += [("routes held (paused or open)", "" if held else "none")]
    rows += [(f"  {n}", f"{r['state']}, {r['backlog']} waiting") for n, r in held.items()]
    if destinations:
        rows += [("deliveries by destination", "")]
        rows += [(f"  {n}", _destination_counts(c)) for n, c in destinations.items()]
    readable = [(name.replace("_", " "), value) for name, value in rows]
    table = terminal.table("metric,value", readable, show_header=False, box=None)
    table.columns[1].justify = "right"
    terminal.console().print(table)


def _destination_counts(counts: dict[str, int]) -> str:
    """`2 pending, 1 failed final, 1 open dead letters`: the counts that are not 0, or none."""
    shown = [f"{n} {name.replace('_', ' ')}" for name, n in counts.items() if n]
    return ", ".join(shown) or "none"
