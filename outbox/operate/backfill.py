"""Delivering past events to a destination added later: `idem deliver`, dry run first.

A destination added to a fan-out route applies to events accepted from then on (an event's
deliveries are fixed when it is accepted). An operator who wants the events of a time window
delivered there too runs a backfill: the dry run counts the route's events of the window that
have no delivery to the destination and writes nothing; `--execute` adds those deliveries, a
bounded page per transaction, each a new key that runs like any other. Running it twice adds
nothing the second time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Engine

from outbox.core.keys import DELIVERY_SEPARATOR
from outbox.core.routes import RouteTable
from outbox.core.wire import PROCESS_TASK
from outbox.store import ingest as q

# Events per page: each page is one short statement (and one transaction when executing).
BACKFILL_PAGE = 500
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class BackfillRefused(ValueError):
    """The route or destination does not allow a backfill; the message says why."""


@dataclass(frozen=True)
class BackfillReport:
    route: str
    destination: str
    events: int
    added: int
    dry_run: bool
    sample: list[str] = field(default_factory=list)


def check(routes: RouteTable, route: str, destination: str) -> None:
    """Refuse what a backfill cannot do well: an unknown or non-fan-out route, an unknown
    destination, or one that orders its deliveries (past events would enter its lanes after
    newer ones)."""
    found = next((r for r in routes.routes if r.label == route), None)
    if found is None or found.fan_out is None:
        raise BackfillRefused(f"no fan-out route is named {route!r}")
    target = routes.destinations.get(destination)
    if target is None:
        raise BackfillRefused(f"no [[destinations]] table is named {destination!r}")
    if target.order_by is not None:
        raise BackfillRefused(
            f"destination {destination!r} orders its deliveries (order_by): past events would "
            "run after newer ones; a backfill is refused"
        )


def backfill(
    engine: Engine,
    routes: RouteTable,
    route: str,
    destination: str,
    since: datetime,
    until: datetime | None = None,
    *,
    execute: bool = False,
    page: int = BACKFILL_PAGE,
) -> BackfillReport:
    """Count (dry run) or add the missing deliveries, a page at a time."""
    check(routes, route, destination)
    events = added = 0
    sample: list[str] = []
    after_at, after_key = _EPOCH, ""
    while True:
        with engine.begin() as conn:
            rows = conn.execute(
                q.MISSING_DELIVERIES,
                {
                    "route": route,
                    "destination": destination,
                    "since": since,
                    "until": until,
                    "after_at": after_at,
                    "after_key": after_key,
                    "limit": page,
                },
            ).all()
            if not rows:
                break
            keys = [row.idempotency_key for row in rows]
            events += len(keys)
            sample.extend(keys[: max(0, 5 - len(sample))])
            if execute:
                added += conn.execute(
                    q.ADD_DELIVERIES,
                    {
                        "keys": keys,
                        "destination": destination,
                        "separator": DELIVERY_SEPARATOR,
                        "task_name": PROCESS_TASK,
                    },
                ).scalar_one()
        after_at, after_key = rows[-1].created_at, rows[-1].idempotency_key
    return BackfillReport(route, destination, events, added, not execute, sample)
