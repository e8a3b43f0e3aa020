"""The receiver's own counters: events accepted, repeats, payload conflicts, quarantines.

Counted in the process that answered; the state of the keys (by status, backlog, lag) is read
from the database at scrape time by `outbox.operate.metrics`, and `outbox.app` serves both from
one registry.

A label value comes from the configuration, never from a sender: an event type the routes file
names exactly is its own label, every other one (taken by a glob or the catch-all) is counted
as `other`. Otherwise each new type a sender makes up would add series to every scrape, without
bound (Prometheus keeps each for as long as it retains data).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from outbox.core.routes import RouteTable

OTHER = "other"
"""The label of every event type the routes file does not name exactly."""


class EventCounters:
    """What only the receiver sees, counted in the process and served from `registry`."""

    def __init__(self, registry: CollectorRegistry, routes: RouteTable | None = None) -> None:
        self.registry = registry
        self._named = routes.named_event_types() if routes is not None else frozenset()
        self.accepted = Counter(
            "idem_events_accepted",
            "New events stored, by event type (`other` for every type the routes file does "
            "not name exactly).",
            ["event_type"],
            registry=self.registry,
        )
        self.duplicates = Counter(
            "idem_events_duplicate",
            "Repeats answered with the first answer.",
            registry=self.registry,
        )
        self.conflicts = Counter(
            "idem_payload_conflicts",
            "Keys reused with another payload (refused).",
            registry=self.registry,
        )
        self.quarantined = Counter(
            "idem_events_quarantined",
            "Events accepted but quarantined by their contract.",
            registry=self.registry,
        )

    def event_type_label(self, event_type: str) -> str:
        """The label an event type is counted under: itself when named, else `other`."""
        return event_type if event_type in self._named else OTHER
