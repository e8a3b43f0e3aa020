"""The worker's counters and histogram (created after `metrics.prepare_directory`).

Every label value comes from the configuration or from the gateway's own closed sets: a route
is a configured route's label (OTHER_ROUTE for a key whose route is no longer configured), an
error code is one the classifier or an action names (worker/errors.py), never a sender's text.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

ATTEMPTS = Counter(
    "idem_attempts",
    "Finished attempts by outcome (succeeded, retry, dead_letter, lease_lost, blocked) and "
    "error code (empty when none).",
    ["outcome", "error_code"],
)
OTHER_ROUTE = "other"
"""The route label of a key whose stored route the routes file no longer has."""

ACTION_SECONDS = Histogram(
    "idem_action_seconds",
    "Time from claim to recorded outcome, by route.",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
RECONCILED = Counter("idem_reconciled", "Reconcile lookups by what they found.", ["found"])
THROTTLED = Counter(
    "idem_route_throttled",
    "Claims a route gave back unspent before acting, by route and reason (paused, "
    "circuit_open, rate_limited, in_flight_limit).",
    ["route", "reason"],
)
BREAKER_ERRORS = Counter(
    "idem_route_bookkeeping_errors",
    "Errors telling a route's breaker an outcome or releasing the keys its circuit held, by "
    "route (the outcome itself was recorded; see the route.tell_failed log line).",
    ["route"],
)
