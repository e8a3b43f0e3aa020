"""One key as operators read it, a fan-out event's with its deliveries: `idem show KEY` and the
console's key page.

A fan-out event's own key is `fanned_out`: it never runs, has no attempts and no dead letter.
Each delivery is a key of its own (`<event key> @<destination>`, its `route` the destination's
name) with its attempts, dead letters and replays; the event's status is read off them
(`outbox.core.fanout.event_status`), as `GET /v1/events/{key}` reads it. A delivery names its
event (`event_key`) and its `destination`.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine

from outbox.core import fanout
from outbox.core.routes import Route, RouteTable
from outbox.core.timewindow import iso
from outbox.store.ingest import DELIVERIES_OF, GET_KEY

# What a delivery shows in an event's list (the JSON of `idem show`, the console's table).
DELIVERY_FIELDS = (
    "destination key status attempts error_code external_ref uncertain updated_at next_attempt_at"
)


def key_view(engine: Engine, key: str, routes: RouteTable) -> dict[str, Any] | None:
    """The key's stored view (`GET_KEY`), or None. `event_status` is the status to show: a
    fan-out event's is its deliveries' (listed in `deliveries`, in its route's order), any
    other key's is its own."""
    with engine.connect() as conn:
        row = conn.execute(GET_KEY, {"key": key}).mappings().first()
        if row is None:
            return None
        found = dict(row)
        found["deliveries"] = []
        found["event_status"] = found["status"]
        if found["status"] == "fanned_out":
            order = {"key": key, "destinations": destination_order(routes, found["route"])}
            found["deliveries"] = [dict(d) for d in conn.execute(DELIVERIES_OF, order).mappings()]
            found["event_status"] = fanout.event_status(d["status"] for d in found["deliveries"])
    return found


def destination_order(routes: RouteTable, label: str) -> list[str]:
    """The destinations of the fan-out route named `label`, in its order (deliveries to any
    other, one added later by `idem deliver`, come after them by name)."""
    route = routes.by_label(label)
    return list(route.fan_out or ()) if isinstance(route, Route) else []


def delivery_summary(delivery: dict[str, Any]) -> dict[str, Any]:
    """One delivery as `idem show --json` lists it: instants in ISO 8601."""
    shown = {name: delivery[name] for name in DELIVERY_FIELDS.split()}
    shown["updated_at"] = iso(shown["updated_at"])
    shown["next_attempt_at"] = iso(shown["next_attempt_at"])
    return shown
