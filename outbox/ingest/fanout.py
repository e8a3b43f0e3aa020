"""An accepted event's deliveries on a fan-out route: one per destination, each with its key and
its place in the destination's lanes (docs/explanation/architecture.md, "Fan-out").

Decided at intake, once: the deliveries are stored with the event in one statement, so a
duplicate, however many arrive at once, finds them all and makes none. A destination that
orders its deliveries places each in its own lanes (a lane is per destination), with the same
422s as an ordered route.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.core import keys
from outbox.core.routes import Route, RouteTable
from outbox.ingest import lanes


@dataclass(frozen=True)
class Delivery:
    """One destination's share of an event: its key, and its lane and rank there."""

    destination: str
    key: str
    lane: str | None = None
    lane_rank: int | None = None


def plan(
    routes: RouteTable,
    route: Route,
    event_key: str,
    payload: Any,
    external_id: str,
    version: str | None,
    source: str,
) -> tuple[Delivery, ...]:
    """The event's deliveries, in the route's `fan_out` order; none for a route that acts
    itself. Raises the 422 Problem of a destination that cannot place the event in a lane."""
    planned = []
    for destination in routes.destinations_of(route):
        where = lanes.place(
            destination,
            payload,
            external_id,
            version,
            source=source,
            shared=route.sources is not None,
        )
        planned.append(
            Delivery(
                destination=destination.name,
                key=keys.delivery_key(event_key, destination.name),
                lane=None if where is None else where.lane,
                lane_rank=None if where is None else where.rank,
            )
        )
    return tuple(planned)
