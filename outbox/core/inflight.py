"""How long a request sent for a key may still land after its sender gave up on it.

A request whose answer never came (a read timeout, a dropped connection, an action past its
time limit) can reach the downstream later: a slow link delays it, a busy server applies it
late. Whoever acts on the key next looks it up first, and a lookup made before that request
landed finds nothing and acts again. So no one may act on a key before its last request can no
longer land: the store keeps that time on the key (`in_flight_until`) and every statement that
hands a key on honours it (docs/explanation/architecture.md, "The in-flight rule"). This module
says how long that is for a route; the statements are in `outbox.store`.
"""

from __future__ import annotations

import json

from outbox.core.actions import ActionSettings

# An action's time limit when its route sets none, in leases (see ActionSettings.timeout_seconds).
DEFAULT_TIMEOUT_LEASES = 3


def action_limit(route: ActionSettings, lease_seconds: float) -> float:
    """The hard limit of one attempt's action on `route`."""
    return route.timeout_seconds or lease_seconds * DEFAULT_TIMEOUT_LEASES


def window(route: ActionSettings, lease_seconds: float) -> float:
    """After its sender gave up, how long a request on `route` may still land: an http
    request's connect plus read timeout, a python action's time limit (its thread cannot be
    stopped), each with the route's margin; nothing for a noop, which sends nothing."""
    if route.action == "http":
        return route.action_timeout_seconds + route.in_flight_margin_seconds
    if route.action == "python":
        return action_limit(route, lease_seconds) + route.in_flight_margin_seconds
    return 0.0


def largest(routes: list[ActionSettings], lease_seconds: float) -> float:
    """The longest window of `routes`: what a key of a route no longer configured is given."""
    return max((window(route, lease_seconds) for route in routes), default=0.0)


def windows(routes: list[ActionSettings], lease_seconds: float) -> str:
    """Every route's window by its label, as the JSON object the claim statements read
    (`outbox.store.claiming.WINDOW`)."""
    return json.dumps({route.label: window(route, lease_seconds) for route in routes})
