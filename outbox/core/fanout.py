"""One event, several deliveries: the event's status as its deliveries make it.

A fan-out event's own key never runs (`fanned_out`); each delivery is a key that runs by
itself. Callers (a duplicate's answer, `GET /v1/events/{key}`, the console, `idem show`) see
one status for the event, read off its deliveries, so it is never stale and never written.
"""

from __future__ import annotations

from collections.abc import Iterable

# Done, nothing more will happen: the delivery's downstream has the effect or never needs it.
_DONE = frozenset({"succeeded", "superseded"})
# Finished without the effect: a person decides (replay, discard).
_FAILED = frozenset({"failed_final", "quarantined"})

PARTIALLY_FAILED = "partially_failed"
"""Every delivery finished and some dead-lettered while others succeeded."""

EVENT_STATUSES = ("pending", "processing", "succeeded", "failed_final", PARTIALLY_FAILED)
"""What a fan-out event's status can be."""


def event_status(deliveries: Iterable[str]) -> str:
    """The event's status from its deliveries' statuses.

    `succeeded` when every delivery is done; `failed_final` when every one finished and none
    succeeded; `partially_failed` when every one finished, some with the effect and some
    without; while any is on its way, `pending` if none has started, else `processing`."""
    statuses = list(deliveries)
    if not statuses:
        return "pending"
    if all(status in _DONE for status in statuses):
        return "succeeded"
    if all(status in _DONE | _FAILED for status in statuses):
        if any(status in _DONE for status in statuses):
            return PARTIALLY_FAILED
        return "failed_final"
    if all(status == "pending" for status in statuses):
        return "pending"
    return "processing"


FINISHED = frozenset({"succeeded", "failed_final", PARTIALLY_FAILED})
"""An event in one of these will not change by itself: a repeat is answered 200."""
