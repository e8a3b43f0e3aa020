"""The operators' side of routes: their state and load, pausing and resuming (audited).

A pause takes effect at the next claim of each of the route's keys (the claim reads the route's
state in its own statement): attempts already running finish, later ones are given back and
wait as `pending`. A resume un-pauses the route, then queues a delivery for every key the pause
held, in the order the keys were accepted, a batch per statement (`ENQUEUE_RESUMED`), reporting
each batch: hundreds of thousands of held keys never make one statement that outlasts the
statement timeout, and a resume that was interrupted is finished by running it again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from outbox.core.routes import Route, RouteTable
from outbox.core.timewindow import iso
from outbox.core.wire import PROCESS_TASK
from outbox.store import routes as q


def _state_name(row: Any) -> str:
    return "closed" if row is None else str(row.circuit)


def list_routes(engine: Engine, routes: RouteTable) -> list[dict[str, Any]]:
    """Every configured route: state, limits, keys waiting and attempts running."""
    states, load = _read(engine)
    listed = []
    for route in routes.routes:
        row = states.get(route.label)
        waiting, in_flight = load.get(route.label, (0, 0))
        listed.append(
            {
                "name": route.label,
                "match": route.match,
                "action": route.action,
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
        )
    return listed


def _limits(route: Route) -> dict[str, Any]:
    return {
        "max_in_flight": route.max_in_flight,
        "rate_per_second": route.rate_per_second,
        "burst": route.burst,
        "circuit_failure_rate": route.circuit_failure_rate,
        "circuit_minimum_calls": route.circuit_minimum_calls,
        "circuit_window_seconds": route.circuit_window_seconds,
        "circuit_half_open_calls": route.circuit_half_open_calls,
    }


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
