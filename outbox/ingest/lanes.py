"""Where an accepted event stands in its route's lanes: the lane its `order_by` names and its
rank there (docs/architecture.md, "Lanes").

Decided at intake, once, from what the sender sent: a worker only ever compares what was
stored. An event the route cannot place is refused before anything is stored (422), since an
ordered route cannot say where it belongs: `lane_missing`, `lane_invalid` (not printable
text: it is shown to operators), `version_required`, `version_invalid`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from outbox.core import keys
from outbox.core.actions import ActionSettings
from outbox.core.jsonbody import resolve_pointer
from outbox.core.problems import Problem
from outbox.core.versions import VersionInvalid, version_rank

# A lane is an object's id: as long as an external id may be.
MAX_LANE_CHARS = 1000


@dataclass(frozen=True)
class Place:
    """The event's lane, and its rank when the route compares versions (else None: the order
    of acceptance, numbered by the database)."""

    lane: str
    rank: int | None


def place(
    route: ActionSettings, payload: Any, external_id: str, version: str | None
) -> Place | None:
    """The event's place, or None on a route without lanes; raises a 422 Problem."""
    if route.order_by is None:
        return None
    if route.order_by == "external_id":
        lane: str | None = keys.normalize_text(external_id) or None
    else:
        value = resolve_pointer(payload, route.order_by)
        valid = isinstance(value, str | int) and not isinstance(value, bool)
        lane = keys.normalize_text(str(value)) or None if valid else None
    if lane is None or len(lane) > MAX_LANE_CHARS:
        raise Problem(
            422,
            "lane_missing",
            f"Route {route.label!r} orders its events by {route.order_by!r}: a non-empty string "
            f"(at most {MAX_LANE_CHARS} characters) or an integer is expected there. Nothing "
            "was stored.",
            order_by=route.order_by,
        )
    if not lane.isprintable():
        # The lane is shown to operators (`idem stuck`, the console): no escape sequence, bidi
        # override or private-use character from a sender reaches their screen.
        raise Problem(
            422,
            "lane_invalid",
            f"The lane at {route.order_by!r} holds a control, format or private-use character. "
            "Nothing was stored.",
            order_by=route.order_by,
        )
    if route.versions != "supersede":
        return Place(lane, None)
    if version is None:
        raise Problem(
            422,
            "version_required",
            f"Route {route.label!r} keeps the newest version of each object: every event needs "
            "a `version`. Nothing was stored.",
        )
    try:
        return Place(lane, version_rank(version, route.version_format))
    except VersionInvalid as error:
        raise Problem(
            422,
            "version_invalid",
            f"Route {route.label!r} compares versions as {route.version_format}s: {error}. "
            "Nothing was stored.",
            version_format=route.version_format,
        ) from error
