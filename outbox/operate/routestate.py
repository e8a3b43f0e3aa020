"""The operators' side of routes: their state and load, pausing and resuming (audited).

A pause takes effect at the next claim of each of the route's keys (the claim reads the route's
state in its own statement): attempts already running finish, later ones are given back and
wait as `pending`. A resume un-pauses the route, then queues a delivery for every key the pause
held, in the order the keys were accepted, a batch per statement (`ENQUEUE_RESUMED`), reporting
each batch: hundreds of thousands of held keys never make one statement that outlasts the
statement timeout, and a resume that was interrupted is finished by running it again.

Destinations are listed, paused and resumed like routes, by their names: a delivery's key is
stored under its destination's name. A fan-out route runs nothing itself (its events' keys are
`fanned_out`), so a pause of its name would hold nothing: it is refused (`FansOut`), naming the
destinations to pause instead. A destination several fan-out routes deliver to is paused for
all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from outbox.core.actions import ActionSettings
from outbox.core.routes import Route, RouteTable
from outbox.core.timewindow import iso
from outbox.core.wire import PROCESS_TASK
from outbox.store import routes as q


def _state_name(row: Any) -> str:
    return "closed" if row is None else str(row.circuit)


def list_routes(engine: Engine, routes: RouteTable) -> list[dict[str, Any]]:
    """Every configured route, then every destination: state, limits, keys waiting and
    attempts running. A fan-out route has none of these (`kind` "fan_out", action "none"): it
    names the destinations its events go to (`fan_out`); a destination names the fan-out
    routes that deliver to it (`routes`)."""
    states, load = _read(engine)
    listed = []
    for route in routes.routes:
        if route.fan_out is not None:
            listed.append(_fan_out_item(route))
        else:
            listed.append(_acting_item(route, "route", states, load, match=route.match))
    for destination in routes.destinations.values():
        feeding = [r.label for r in routes.routes if destination.name in (r.fan_out or ())]
        item = _acting_item(destination, "destination", states, load, match=None)
        listed.append({**item, "routes": feeding})
    return listed


def _acting_item(
    route: ActionSettings,
    kind: str,
    states: dict[str, Any],
    load: dict[str, tuple[int, int]],
    *,
    match: str | None,
) -> dict[str, Any]:
    row = states.get(route.label)
    waiting, in_flight = load.get(route.label, (0, 0))
    return {
        "name": route.label,
        "kind": kind,
        "match": match,
        "action": route.action,
        "fan_out": None,
        "routes": None,
        "state": "paused" if row is not None and row.paused else _state_name(row),
        "circuit": _state_name(row),
        "paused": bool(row is not None and row.paused),
        "paused_reason": None if row is None else row.paused_reason,
        "paused_by": None if row is None else row.paused_by,
        "paused_at": None if row is None else iso(row.paused_at),
        "open_until": None if row is None else iso(row.open_until),
        "open_reason": None if row is None else row.open_reason,
        "window_calls": 0 if row is None else int(row.window_calls),
        "window_failures": 0 if row is None else int(row.window_failures),
        "trials_running": 0 if row is None else int(row.trials_running),
        "in_flight": in_flight,
        "backlog": waiting,
        **_limits(route),
    }


def _fan_out_item(route: Route) -> dict[str, Any]:
    """A fan-out route: it only matches and names its destinations; whatever state, limits
    and load there is are its destinations' (listed after the routes)."""
    return {
        "name": route.label,
        "kind": "fan_out",
        "match": route.match,
        "action": "none",
        "fan_out": list(route.fan_out or ()),
        "routes": None,
        "state": "fans_out",
        "circuit": None,
        "paused": False,
        **dict.fromkeys(("paused_reason", "paused_by", "paused_at", "open_until", "open_reason")),
        **dict.fromkeys(("window_calls", "window_failures", "trials_running")),
        "in_flight": None,
        "backlog": None,
        **dict.fromkeys(_limits(route)),
    }


def _limits(route: ActionSettings) -> dict[str, Any]:
    return {
        "max_in_flight": route.max_in_flight,
        "rate_per_second": route.rate_per_second,
        "burst": route.burst,
        "circuit_failure_rate": route.circuit_failure_rate,
        "circuit_minimum_calls": route.circuit_minimum_calls,
        "circuit_window_seconds": route.circuit_window_seconds,
        "circuit_half_open_calls": route.circuit_half_open_calls,
    }


class FansOut(ValueError):
    """A pause or resume named a fan-out route; the message names its destinations."""

    def __init__(self, route: Route, action: str) -> None:
        self.destinations = list(route.fan_out or ())
        super().__init__(
            f"route {route.label!r} fans out to {', '.join(self.destinations)} and runs nothing"
            f" itself: {action} its destinations instead, each by its name"
        )


def check_pausable(engine: Engine, routes: RouteTable, name: str, action: str) -> None:
    """Raise `FansOut` when `name` is a fan-out route, unless the action is a resume of a
    pause on record under that name (one made before the route fanned out, or before such
    pauses were refused): lifting it is allowed, and queues the keys it held."""
    found = routes.by_label(name)
    if not isinstance(found, Route) or found.fan_out is None:
        return
    if action == "resume":
        with engine.connect() as conn:
            if any(r.route == name and r.paused for r in conn.execute(q.ROUTE_STATES)):
                return
    raise FansOut(found, action)


def held_routes(engine: Engine) -> dict[str, dict[str, Any]]:
    """Routes whose keys wait on them (paused, or a circuit not closed), with their backlog."""
    states, load = _read(engine)
    return {
        name: {
            "state": "paused" if row.paused else str(row.circuit),
            "backlog": load.get(name, (0, 0))[0],
            "probe_in_seconds": round(float(row.probe_in_seconds or 0), 1),
        }
        for name, row in sorted(states.items())
        if row.paused or row.circuit != "closed"
    }


def _read(engine: Engine) -> tuple[dict[str, Any], dict[str, tuple[int, int]]]:
    with engine.connect() as conn:
        states = {row.route: row for row in conn.execute(q.ROUTE_STATES)}
        load: dict[str, tuple[int, int]] = {}
        for row in conn.execute(q.ROUTE_LOAD):
            waiting, in_flight = load.get(row.route, (0, 0))
            load[row.route] = (waiting + int(row.waiting), in_flight + int(row.in_flight))
    return states, load


def pause(engine: Engine, route: str, reason: str, by: str) -> bool:
    """Pause a route; False when it was paused already (nothing changed, nothing audited)."""
    with engine.begin() as conn:
        done = conn.execute(q.PAUSE_ROUTE, {"route": route, "reason": reason, "by": by}).first()
        if done is not None:
            params = {"route": route, "action": "pause", "reason": reason, "by": by}
            conn.execute(q.RECORD_ROUTE_CHANGE, params)
    return done is not None


# Held keys queued per statement: a few milliseconds each, far inside the statement timeout.
RESUME_BATCH = 1000


@dataclass(frozen=True)
class Resumed:
    """What a resume did: whether this call un-paused the route, and how many keys it queued
    (keys an interrupted earlier resume left are queued too)."""

    changed: bool
    queued: int


def resume(
    engine: Engine,
    route: str,
    by: str,
    progress: Callable[[int], None] | None = None,
    batch: int = RESUME_BATCH,
) -> Resumed:
    """Resume a route (audited when it was paused) and queue the keys its pause held, a batch
    at a time; `progress` gets the running total after each batch that queued any."""
    with engine.begin() as conn:
        changed = conn.execute(q.RESUME_ROUTE, {"route": route}).first() is not None
        if changed:
            params = {"route": route, "action": "resume", "reason": None, "by": by}
            conn.execute(q.RECORD_ROUTE_CHANGE, params)
    queued = 0
    while True:
        with engine.begin() as conn:
            row = conn.execute(
                q.ENQUEUE_RESUMED, {"route": route, "task_name": PROCESS_TASK, "batch": batch}
            ).one()
        if row.queued == 0:
            return Resumed(changed, queued)
        queued += int(row.queued)
        if progress is not None:
            progress(queued)
