"""Where an accepted event stands in its route's lanes: the lane its `order_by` names and its
rank there (docs/explanation/architecture.md, "Lanes").

Decided at intake, once, from what the sender sent: a worker only ever compares what was
stored. An event the route cannot place is refused before anything is stored (422), since an
ordered route cannot say where it belongs: `lane_missing`, `lane_invalid` (not printable
text: it is shown to operators), `version_required`, `version_invalid`, `version_ahead`.

A lane belongs to its source, as a key does (invariant 17): its stored name is the source's
namespace, ":" and the value (`webform:customer-7`), so no source can hold up or supersede
another's updates of an object by sending a huge version for the same id. A route that names
its `sources` shares lanes among them (the operator said they speak of the same objects): the
stored name is then the value alone. A timestamp version may be at most the route's
`max_version_ahead_seconds` ahead of the receiver's clock, so even a shared lane cannot be
held for a century by one event; integer versions have no clock to compare with, and rest on
the lane's owner: a source can only ever supersede its own updates, or those of the sources
the route names together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from outbox.core import keys
from outbox.core.actions import ActionSettings
from outbox.core.jsonbody import resolve_pointer
from outbox.core.problems import Problem
from outbox.core.versions import VersionInvalid, version_rank

# A lane is an object's id: as long as an external id may be.
MAX_LANE_CHARS = 1000
# A timestamp version's rank is microseconds since the epoch (outbox.core.versions).
MICROSECONDS = 1_000_000


@dataclass(frozen=True)
class Place:
    """The event's lane, and its rank when the route compares versions (else None: the order
    of acceptance, numbered by the database)."""

    lane: str
    rank: int | None


def place(
    route: ActionSettings,
    payload: Any,
    external_id: str,
    version: str | None,
    *,
    source: str,
    shared: bool,
    now: float | None = None,
) -> Place | None:
    """The event's place, or None on a route without lanes; raises a 422 Problem. `source` is
    the normalized source; `shared`: the route names its sources, which then share lanes;
    `now`: the receiver's clock (seconds since the epoch) that timestamp versions are bounded
    by."""
    found = _place(route, payload, external_id, version, time.time() if now is None else now)
    if found is None or shared:
        return found
    return Place(f"{keys.source_namespace(source)}:{found.lane}", found.rank)


def _place(
    route: ActionSettings, payload: Any, external_id: str, version: str | None, now: float
) -> Place | None:
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
        rank = version_rank(version, route.version_format)
    except VersionInvalid as error:
        raise Problem(
            422,
            "version_invalid",
            f"Route {route.label!r} compares versions as {route.version_format}s: {error}. "
            "Nothing was stored.",
            version_format=route.version_format,
        ) from error
    ahead = route.max_version_ahead_seconds
    if route.version_format == "timestamp" and rank > (now + ahead) * MICROSECONDS:
        raise Problem(
            422,
            "version_ahead",
            f"Route {route.label!r} takes versions at most {ahead:g} s ahead of the receiver's "
            "clock; this one is further ahead, and would supersede every update of its object "
            "until then. Nothing was stored.",
            max_version_ahead_seconds=ahead,
        )
    return Place(lane, rank)
