"""The soak's fan-out traffic: one route that delivers each of its events to three destinations.

A share of the lead events is sent as `crm.order.placed` instead. Its route, `crm-orders`,
acts on nothing itself: each event's key ends `fanned_out`, and the gateway delivers the event
to three `[[destinations]]`, each a CRM collection of its own under a key of its own
(`outbox.core.keys.delivery_key`). The CRM sees only those delivery keys and misbehaves per
delivery key as it does per key (a hash of seed and key), so one delivery of an event may be
refused for good while its siblings succeed, and the checker knows in advance how each
delivery, and so the event, must end. One destination writes to the collection the partial
failure makes flaky: it meets that spell beside the `crm-tasks` route, with a circuit of its
own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox.core import fanout
from outbox.core.keys import delivery_key

EVENT_TYPE = "crm.order.placed"
ROUTE = "crm-orders"
# Destination -> the CRM collection its deliveries write to, in the route's `fan_out` order.
# "tasks" is the partial failure's collection (plan.FLAKY_COLLECTION).
DESTINATIONS = {"orders-ledger": "ledger", "orders-mail": "mail", "orders-tasks": "tasks"}
# The share of the lead events (a third of the events posted to /v1/events) sent to the
# fan-out route instead: about 11 % of all events, each making three deliveries. They replace
# events rather than come on top, so the other routes' traffic and the run's length stay put.
SHARE_OF_LEADS = 0.4
REPLACES = "crm.lead.created"


def delivery_keys(event_key: str) -> dict[str, str]:
    """Destination -> the key of the event's delivery there, in the route's order."""
    return {name: delivery_key(event_key, name) for name in DESTINATIONS}


def routes_toml(crm_url: str, settings: str) -> str:
    """The fan-out route and its destinations; `settings` are the acting settings (timeouts,
    backoff, budget, circuit) every destination shares with the soak's other routes."""
    names = ", ".join(f'"{name}"' for name in DESTINATIONS)
    tables = [f'\n[[routes]]\nmatch = "{EVENT_TYPE}"\nname = "{ROUTE}"\nfan_out = [{names}]\n']
    for name, collection in DESTINATIONS.items():
        tables.append(
            f"""
[[destinations]]
name = "{name}"
action = "http"
url = "{crm_url}/{collection}"
external_ref_pointer = "/id"
reconcile_url = "{crm_url}/{collection}/by-key/{{key}}"
{settings}"""
        )
    return "".join(tables)


def aggregate(keys: Mapping[str, Mapping[str, Any]], event_key: str) -> str | None:
    """The event's status as its stored deliveries make it (None: a delivery is missing)."""
    rows = [keys.get(key) for key in delivery_keys(event_key).values()]
    if any(row is None for row in rows):
        return None
    return fanout.event_status(str(row["status"]) for row in rows if row is not None)
