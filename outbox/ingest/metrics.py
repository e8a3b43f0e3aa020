"""The receiver's own counters: events accepted, repeats, payload conflicts, quarantines.

Counted in the process that answered; the state of the keys (by status, backlog, lag) is read
from the database at scrape time by `outbox.operate.metrics`, and `outbox.app` serves both from
one registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class EventCounters:
    """What only the receiver sees, counted in the process and served from `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.accepted = Counter(
            "idem_events_accepted", "New events stored.", ["event_type"], registry=self.registry
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
