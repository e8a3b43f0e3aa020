"""After the soak: the fan-out route's events (tests/chaos/fan_out.py), each against what its
deliveries' behaviours make certain, and every delivery key against its event."""

from __future__ import annotations

from collections import Counter
from typing import Any
from urllib.parse import quote

import httpx

from outbox.core import fanout
from outbox.core.keys import DELIVERY_SEPARATOR
from tests.chaos import fan_out, plan
from tests.chaos.check import DbState, Violations, check_key
from tests.chaos.plan import PlannedEvent


def read_views(receiver_url: str, token: str, event_keys: list[str]) -> dict[str, Any]:
    """`GET /v1/events/{key}` of each event: what a caller is told of it (its status, read off
    its deliveries, and the deliveries themselves). A key that cannot be read maps to a string
    saying why."""
    views: dict[str, Any] = {}
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=receiver_url, headers=headers, timeout=10) as client:
        for key in event_keys:
            try:
                response = client.get(f"/v1/events/{quote(key, safe='')}")
            except httpx.HTTPError as error:
                views[key] = f"no answer: {type(error).__name__}"
                continue
            views[key] = response.json() if response.status_code == 200 else response.status_code
    return views


def expected_status(event: PlannedEvent) -> str:
    """The event's final status as its deliveries' behaviours make it: a refused (422)
    delivery ends `failed_final`, any other `succeeded`."""
    return fanout.event_status(
        "failed_final" if behaviour.kind == plan.INVALID else "succeeded"
        for behaviour in event.destinations.values()
    )


def verify_fan_out(
    events: list[PlannedEvent],
    crm: dict[str, Any],
    db: DbState,
    views: dict[str, Any],
    v: Violations,
) -> dict[str, Any]:
    """Check the fan-out route's events (adds to `v`): each event's key is `fanned_out` and
    never reached the CRM or the outbox itself; each of its deliveries is a key of the right
    event, destination and route, and ends as its own behaviour makes certain, with exactly
    one effect (none when refused); the event's status, as the database's deliveries make it
    and as `GET /v1/events/{key}` tells it, is what the behaviours make certain. Every
    delivery key in the database belongs to a planned event that exists, at a destination of
    its route; every destination's circuit ends closed. Returns the facts the report prints."""
    effects: dict[str, int] = crm["effects"]
    planned = [e for e in events if e.fanned_out]
    by_event: Counter[str] = Counter()
    by_delivery: Counter[str] = Counter()
    for event in planned:
        key = event.key
        row = db.keys.get(key)
        if row is None:
            v.add("key_missing", f"fan-out event {event.index}: no key {key}")
            continue
        if row["status"] != "fanned_out" or row["route"] != fan_out.ROUTE:
            v.add("fan_out_event_state", f"{key}: {row['status']} on route {row['route']!r}")
        if effects.get(key, 0) or crm["posts"].get(key, 0) or key in db.outbox_keys:
            v.add("fan_out_event_acted", f"{key}: reached the CRM or the outbox under its own key")
        for name, delivery in fan_out.delivery_keys(key).items():
            kind = event.destinations[name].kind
            drow = db.keys.get(delivery)
            if drow is not None:
                by_delivery[drow["status"]] += 1
                if (drow["event_key"], drow["destination"], drow["route"]) != (key, name, name):
                    v.add(
                        "delivery_misfiled",
                        f"{delivery}: event {drow['event_key']!r}, destination"
                        f" {drow['destination']!r}, route {drow['route']!r}",
                    )
            check_key(v, delivery, kind, f"fan-out event {event.index} to {name} ({kind})", crm, db)
        stored = fan_out.aggregate(db.keys, key)
        view = views.get(key)
        told = view.get("status") if isinstance(view, dict) else view
        want = expected_status(event)
        by_event[str(stored)] += 1
        if not stored == told == want:
            v.add(
                "fan_out_status_mismatch",
                f"{key}: deliveries make it {stored}, GET says {told}, behaviours {want}",
            )
        if isinstance(view, dict):
            listed = [(d["key"], d["status"]) for d in view.get("deliveries", [])]
            rows = [
                (k, (db.keys.get(k) or {}).get("status"))
                for k in fan_out.delivery_keys(key).values()
            ]
            if listed != rows:
                v.add("fan_out_view_deliveries", f"{key}: GET listed {listed}, stored {rows}")

    # No delivery without its event: every delivery key names a stored event of the route,
    # sits at one of its destinations, and is that event's key for it.
    fanned = {e.key for e in planned}
    orphans = 0
    for key, row in db.keys.items():
        event_key, destination = row["event_key"], row["destination"]
        if event_key is None and DELIVERY_SEPARATOR not in key:
            continue
        well_formed = (
            event_key in fanned
            and event_key in db.keys
            and event_key in db.payloads
            and destination in fan_out.DESTINATIONS
            and key == fan_out.delivery_keys(event_key)[destination]
        )
        if not well_formed:
            orphans += 1
            v.add("orphan_delivery", f"{key}: event {event_key!r}, destination {destination!r}")
    for name in fan_out.DESTINATIONS:
        if db.circuits.get(name, "closed") != "closed":
            v.add("circuit_left_open", f"{name} ends {db.circuits[name]}")

    delivery_keys = [k for e in planned for k in fan_out.delivery_keys(e.key).values()]
    results = [(db.keys.get(k) or {}).get("result") or {} for k in delivery_keys]
    return {
        "route": fan_out.ROUTE,
        "destinations": list(fan_out.DESTINATIONS),
        "events": len(planned),
        "deliveries": len(delivery_keys),
        "events_by_status": dict(by_event),
        "deliveries_by_status": dict(by_delivery),
        "delivery_behaviours": dict(
            Counter(b.kind for e in planned for b in e.destinations.values())
        ),
        "effects_total": sum(effects.get(k, 0) for k in delivery_keys),
        "keys_with_more_than_one": sum(1 for k in delivery_keys if effects.get(k, 0) > 1),
        "reconciled": sum(1 for result in results if result.get("reconciled")),
        "dead_letters": sum(len(db.dead_letters.get(k, [])) for k in delivery_keys),
        "views_read": sum(1 for e in planned if isinstance(views.get(e.key), dict)),
        "orphan_deliveries": orphans,
        "final_circuits": {n: db.circuits.get(n, "closed") for n in fan_out.DESTINATIONS},
    }
