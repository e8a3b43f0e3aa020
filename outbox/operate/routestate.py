"""The operators' side of routes: their state and load, pausing and resuming (audited).

A pause takes effect at the next claim of each of the route's keys (the claim reads the route's
state in its own statement): attempts already running finish, later ones are given back and
wait as `pending`. A resume, in one transaction, un-pauses the route and queues a delivery for
every key the pause held, in the order the keys were accepted.
"""

from __future__ import annotations

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
                "consecutive_failures": 0 if row is None else int(row.consecutive_failures),
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
        "circuit_failure_threshold": route.circuit_failure_threshold,
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


def resume(engine: Engine, route: str, by: str) -> int | None:
    """Resume a paused route and queue the keys it held; how many, or None when it was not
    paused (nothing changed, nothing audited)."""
    with engine.begin() as conn:
        if conn.execute(q.RESUME_ROUTE, {"route": route}).first() is None:
            return None
        queued = conn.execute(q.ENQUEUE_RESUMED, {"route": route, "task_name": PROCESS_TASK}).all()
        params = {"route": route, "action": "resume", "reason": None, "by": by}
        conn.execute(q.RECORD_ROUTE_CHANGE, params)
    return len(queued)
