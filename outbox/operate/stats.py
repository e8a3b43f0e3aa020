"""What an operator (or Prometheus) asks first: how many keys in which state, how far behind."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, RowMapping, TextClause

from outbox.core import keys
from outbox.core.timewindow import iso
from outbox.operate import routestate
from outbox.store import operate as q

STATUSES = (
    "pending",
    "processing",
    "succeeded",
    "failed_retryable",
    "failed_final",
    "quarantined",
    "superseded",
    # A fan-out event's own key: it never runs (its deliveries do), so it is no pending work.
    "fanned_out",
)
# What is counted per destination: its deliveries not yet succeeded, and its open dead letters.
DESTINATION_COUNTS = ("pending", "processing", "failed_retryable", "failed_final", "quarantined")
DEAD_LETTER_KINDS = ("permanent", "retries_exhausted", "quarantined")


# Below this many keys (by the planner's estimate) succeeded keys are counted exactly; above
# it their count is the table's estimated size minus the other statuses' exact counts. A count
# at this size reads about a tenth of a second of pages, too much on every scrape of every
# replica; the estimate moves with the table's size at once and with its density at each
# (auto)ANALYZE.
EXACT_BELOW = 100_000
# Fan-out events on a table above that size: counted up to this many (a few milliseconds
# through their partial index), past it estimated from that index's statistics (its entries
# at the last VACUUM or ANALYZE, scaled to its size now).
FANNED_OUT_COUNTED_UP_TO = 10_000


def collect(engine: Engine, destinations: Iterable[str] = ()) -> dict[str, Any]:
    """Keys by status, outbox backlog, lag and the relay publishing it, processing age, open
    dead letters, duplicates, and each destination's deliveries (`destinations`: the
    configured ones, listed even with nothing to count).

    Nothing here reads every key: succeeded keys, and fan-out events past
    FANNED_OUT_COUNTED_UP_TO, are estimated on a large table (the answer says so in
    `keys_succeeded_estimated`, `keys_fanned_out_estimated`), the other statuses are counted
    through their partial indexes (superseded keys through the lane index: only lane keys are
    superseded), and the counters come from totals kept as they change.
    """
    per_destination: dict[str, Counter[str]] = {name: Counter() for name in destinations}
    with engine.connect() as conn:
        by_status: Counter[str] = Counter()
        for r in conn.execute(q.STATS_KEYS_UNFINISHED):
            by_status[r.status] += int(r.keys)
            if r.destination is not None:
                per_destination.setdefault(r.destination, Counter())[r.status] += int(r.keys)
        by_status["superseded"] = int(conn.execute(q.STATS_KEYS_SUPERSEDED).scalar_one())
        raw = conn.execute(q.STATS_KEYS_ESTIMATE).scalar()
        size = None if raw is None else float(raw)
        estimated = size is not None and size >= EXACT_BELOW
        by_status["fanned_out"], fanned_estimated = _fanned_out(conn, large=estimated)
        if size is not None and estimated:
            by_status["succeeded"] = max(0, round(size) - sum(by_status.values()))
        else:
            by_status["succeeded"] = int(conn.execute(q.STATS_KEYS_SUCCEEDED).scalar_one())
        counters = conn.execute(q.STATS_COUNTER_TOTALS).one()
        outbox = conn.execute(q.STATS_OUTBOX).one()
        relay_lead = conn.execute(q.STATS_RELAY_LEAD).scalar()
        processing = conn.execute(q.STATS_PROCESSING).one()
        open_dead: Counter[str] = Counter()
        for r in conn.execute(q.STATS_DEAD_LETTERS):
            open_dead[r.kind] += int(r.open)
            if r.destination is not None:
                counts = per_destination.setdefault(r.destination, Counter())
                counts["open_dead_letters"] += int(r.open)
    return {
        "keys_by_status": {s: by_status.get(s, 0) for s in STATUSES},
        "keys_succeeded_estimated": estimated,
        "keys_fanned_out_estimated": fanned_estimated,
        "outbox": {
            "due": int(outbox.due),
            "unpublished": int(outbox.unpublished),
            "oldest_due_age_seconds": round(float(outbox.oldest_due_age), 3),
            # The relay publishing now (host:pid:tag); None while none holds the lead.
            "relay_lead": relay_lead,
        },
        "processing": {
            "count": int(processing.processing),
            "oldest_age_seconds": round(float(processing.oldest_age), 3),
            "lease_expired": int(processing.lease_expired),
        },
        "open_dead_letters": {k: int(open_dead.get(k, 0)) for k in DEAD_LETTER_KINDS},
        "duplicates_blocked": {
            "receiver": int(counters.duplicates),
            "worker": int(counters.blocked),
            "claims": int(counters.refused_claims),
        },
        "leases_reclaimed": int(counters.reclaimed),
        # Routes whose keys wait on them: paused, or a circuit not closed.
        "routes": routestate.held_routes(engine),
        # Each destination's deliveries on their way or failed, and its open dead letters.
        "destinations": {
            name: {s: counts[s] for s in (*DESTINATION_COUNTS, "open_dead_letters")}
            for name, counts in sorted(per_destination.items())
        },
    }


def _fanned_out(conn: Connection, *, large: bool) -> tuple[int, bool]:
    """Fan-out events, and whether the number is an estimate: all counted on a small table,
    else up to FANNED_OUT_COUNTED_UP_TO and estimated past it (counted all the same while the
    index has no statistics yet)."""
    cap = FANNED_OUT_COUNTED_UP_TO if large else None
    counted = int(
        conn.execute(q.STATS_FANNED_OUT, {"limit": None if cap is None else cap + 1}).scalar_one()
    )
    if cap is None or counted <= cap:
        return counted, False
    estimate = conn.execute(q.STATS_FANNED_OUT_ESTIMATE).scalar()
    if estimate is None:
        return int(conn.execute(q.STATS_FANNED_OUT, {"limit": None}).scalar_one()), False
    return max(counted, round(float(estimate))), True


def waiting_on_routes(engine: Engine) -> dict[str, int]:
    """Keys that wait on a paused route or an open circuit (not stuck: held on purpose)."""
    return {name: route["backlog"] for name, route in routestate.held_routes(engine).items()}


def stuck(engine: Engine, older_than_seconds: float, limit: int = 100) -> list[dict[str, Any]]:
    """Unfinished keys untouched for longer than `older_than_seconds` (a retry not yet due is
    not stuck, nor is a key that waits on a paused route or an open circuit, nor one parked
    behind a dead letter of its lane: `blocked_lanes` shows that lane once, with its head)."""
    rows = _untouched(engine, q.STUCK_KEYS, older_than_seconds, limit)
    return [
        {
            "key": keys.mask_key(r["idempotency_key"]),
            "status": r["status"],
            "event_type": r["event_type"],
            "attempts": r["attempts"],
            "updated_at": iso(r["updated_at"]),
            "age_seconds": round(float(r["age_seconds"]), 1),
        }
        for r in rows
    ]


def blocked_lanes(
    engine: Engine, older_than_seconds: float, limit: int = 100
) -> list[dict[str, Any]]:
    """Lanes held by a dead letter (or by an uncertain one, under any mode) whose parked keys
    have waited longer than `older_than_seconds`: what to replay or discard (the head) to let
    the lane go on."""
    rows = _untouched(engine, q.BLOCKED_LANES, older_than_seconds, limit)
    return [
        {
            "route": r["route"],
            "lane": r["lane"],
            "head_key": keys.mask_key(r["head_key"]),
            "head_status": r["head_status"],
            "head_error_code": r["head_error_code"],
            "head_event_type": r["head_event_type"],
            # `uncertain`: its effect is unknown, so it holds the lane under every mode until
            # a replay's lookup answers; `dead_letter`: held by lane_on_failure = "block".
            "held_by": r["held_by"],
            "dead_letter_id": r["dead_letter_id"],
            "waiting": int(r["waiting"]),
            "blocked_since": iso(r["blocked_since"]),
            "waiting_since": iso(r["waiting_since"]),
            "blocked_seconds": round(float(r["blocked_seconds"]), 1),
        }
        for r in rows
    ]


def _untouched(
    engine: Engine, statement: TextClause, older_than_seconds: float, limit: int
) -> Sequence[RowMapping]:
    with engine.connect() as conn:
        bounds = {"older_than_seconds": older_than_seconds, "limit": limit}
        return conn.execute(statement, bounds).mappings().all()
