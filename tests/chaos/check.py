"""After the soak: read what the database, the fake CRM, the clients and the workers' counters
say, and compare every event with the final state its key's behaviour makes certain."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg

from tests.chaos import fan_out, plan
from tests.chaos.client import Answer
from tests.chaos.crm import GATEWAY, WORKFLOW
from tests.chaos.plan import SOURCE, Delivery, PlannedEvent
from tests.chaos.workflow import Call, Ledger
from tests.support import libpq

FINAL_STATUSES = ("succeeded", "failed_final", "quarantined")
# How a claims delivery may end (workflow.Done.how): the key succeeded, or it is refused.
CLAIMS_FINAL_ANSWERS = frozenset(
    {"completed_via_create", "completed_via_lookup", "already_succeeded", "failed_final"}
)
# No request may take longer than this, whatever it answers (the receiver's own bound is
# twice DB_TIMEOUT_SECONDS, 6 s).
MAX_REQUEST_SECONDS = 10.0


def connect(database_url: str) -> psycopg.Connection[Any]:
    return psycopg.connect(
        libpq(database_url),
        autocommit=True,
        connect_timeout=3,
        options="-c statement_timeout=30000",
    )


def progress(database_url: str) -> dict[str, int]:
    """Keys by status plus the outbox backlog: for the live progress line and quiescence."""
    with connect(database_url) as conn:
        counts = dict(
            conn.execute("SELECT status, count(*) FROM idempotency_keys GROUP BY 1").fetchall()
        )
        due, unpublished = conn.execute(
            "SELECT count(*) FILTER (WHERE available_at <= now()), count(*)"
            " FROM outbox WHERE published_at IS NULL"
        ).fetchone() or (0, 0)
    counts["outbox_due"] = due
    counts["outbox_unpublished"] = unpublished
    return counts


def unfinished(counts: dict[str, int]) -> int:
    return sum(
        n for status, n in counts.items() if status in ("pending", "processing", "failed_retryable")
    )


@dataclass
class DbState:
    keys: dict[str, dict[str, Any]]
    payloads: dict[str, Any]
    dead_letters: dict[str, list[tuple[str, str]]]
    outbox_keys: set[str]
    outbox_due: int
    outbox_unpublished: int
    outbox_rows: int
    circuits: dict[str, str]  # route -> circuit state (closed | open | half_open)
    # (route, lane) -> the version the lane remembers as applied (None: none yet)
    lanes: dict[tuple[str, str], str | None] = field(default_factory=dict)


def read_db(database_url: str) -> DbState:
    with connect(database_url) as conn:
        cur = conn.execute(
            "SELECT idempotency_key, status, attempts, error_code, external_ref, result,"
            " reclaimed_count, blocked_deliveries, duplicate_count, lane, superseded_by,"
            " route, event_key, destination,"
            " COALESCE(locked_until > now(), false) AS lease_live FROM idempotency_keys"
        )
        names = [c.name for c in cur.description or ()]
        keys = {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
        payloads = dict(conn.execute("SELECT idempotency_key, payload FROM events").fetchall())
        dead: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for key, kind, code in conn.execute(
            "SELECT idempotency_key, kind, error_code FROM dead_letters ORDER BY id"
        ).fetchall():
            dead[key].append((kind, code))
        outbox_keys = {r[0] for r in conn.execute("SELECT DISTINCT idempotency_key FROM outbox")}
        due, unpublished, rows = conn.execute(
            "SELECT count(*) FILTER (WHERE published_at IS NULL AND available_at <= now()),"
            " count(*) FILTER (WHERE published_at IS NULL), count(*) FROM outbox"
        ).fetchone() or (0, 0, 0)
        circuits = dict(conn.execute("SELECT route, circuit FROM route_state").fetchall())
        lanes = {
            (route, lane): version
            for route, lane, version in conn.execute(
                "SELECT route, lane, applied_version FROM lanes"
            ).fetchall()
        }
    return DbState(keys, payloads, dict(dead), outbox_keys, due, unpublished, rows, circuits, lanes)


def worker_counters(metrics_dirs: list[Path]) -> dict[str, Counter[str]]:
    """Sum the counters of every worker process that ever ran, killed ones included (their
    multiprocess files stay on disk)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    attempts: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    reconciled: Counter[str] = Counter()
    for path in metrics_dirs:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(path))
        for family in registry.collect():
            for sample in family.samples:
                if sample.name == "idem_attempts_total":
                    outcome = sample.labels.get("outcome", "")
                    attempts[outcome] += int(sample.value)
                    if outcome == "retry":
                        retries[sample.labels.get("error_code", "")] += int(sample.value)
                elif sample.name == "idem_reconciled_total":
                    found = "found" if sample.labels.get("found") == "true" else "not_found"
                    reconciled[found] += int(sample.value)
    return {"attempts": attempts, "retries": retries, "reconciled": reconciled}


def sweeper_totals(log_files: list[Path]) -> Counter[str]:
    """What the sweepers re-drove, from their `sweeper.redrove` log lines."""
    totals: Counter[str] = Counter()
    for path in log_files:
        for line in path.read_text(errors="replace").splitlines():
            if '"sweeper.redrove"' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            totals["leases_reclaimed"] += int(record.get("leases_reclaimed", 0))
            totals["redriven"] += int(record.get("redriven", 0))
    return totals


def route_events(log_files: list[Path]) -> Counter[tuple[str, str]]:
    """(event, route) counts of the workers' `route.*` log lines: circuit opened and closed,
    trials."""
    totals: Counter[tuple[str, str]] = Counter()
    for path in log_files:
        for line in path.read_text(errors="replace").splitlines():
            if '"route.' not in line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            totals[(str(record.get("event")), str(record.get("route")))] += 1
    return totals


@dataclass
class Violations:
    """Every broken expectation, counted by check, with a few examples of each."""

    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def add(self, check: str, detail: str) -> None:
        self.counts[check] += 1
        if len(self.examples[check]) < 10:
            self.examples[check].append(detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "by_check": dict(self.counts),
            "examples": {k: v for k, v in self.examples.items() if v},
        }


def _slow_or_failed(v: Violations, what: str, request: Answer | Call) -> None:
    """No request may fail without an HTTP answer or take longer than MAX_REQUEST_SECONDS."""
    if request.status is None or request.elapsed > MAX_REQUEST_SECONDS:
        v.add(
            "request_too_slow_or_failed",
            f"{what} at {request.started:.1f} s: {request.status or request.error}"
            f" after {request.elapsed:.1f} s",
        )


def check_key(
    v: Violations, key: str, kind: str, label: str, crm: dict[str, Any], db: DbState
) -> None:
    """One key the gateway's worker acts on (an event's, or a delivery's of a fan-out event)
    ends as its behaviour `kind` makes certain: `succeeded` with exactly one effect at the CRM
    (found again, not written twice, when its answer was lost), or, refused with 422,
    `failed_final` with one permanent dead letter and no effect."""
    effects: dict[str, int] = crm["effects"]
    refs: dict[str, str] = crm["refs"]
    row = db.keys.get(key)
    if row is None:
        v.add("key_missing", f"{label}: no key {key} in the database")
        return
    status = row["status"]
    dead = db.dead_letters.get(key, [])
    if effects.get(key, 0) > 1:
        # Whatever else happened: a duplicated side effect is the failure this product exists
        # to prevent.
        v.add(
            "duplicate_effect",
            f"{key} ({kind}): {effects[key]} effects, {crm['posts'].get(key, 0)} writes,"
            f" status {status}, attempts {row['attempts']}",
        )
    if status not in FINAL_STATUSES:
        v.add("key_unfinished", f"{key} ({kind}) is {status} after {row['attempts']} attempts")
        return
    if kind == plan.INVALID:
        if status != "failed_final" or dead != [("permanent", "http_422")]:
            v.add("expected_permanent_dead_letter", f"{key}: {status}, dead letters {dead}")
        if effects.get(key, 0) != 0:
            v.add("effect_for_refused_key", f"{key}: {effects[key]} effects after 422")
        return
    if status != "succeeded":
        v.add(
            "expected_succeeded",
            f"{key} ({kind}): {status} error={row['error_code']} dead letters {dead}",
        )
        return
    if dead:
        v.add("unexpected_dead_letter", f"{key} ({kind}): {dead}")
    if effects.get(key, 0) == 0:
        v.add("succeeded_without_effect", f"{key} ({kind}): no effect at the CRM")
    if row["external_ref"] != refs.get(key):
        v.add(
            "external_ref_mismatch",
            f"{key}: stored {row['external_ref']!r}, CRM {refs.get(key)!r}",
        )
    result = row["result"] or {}
    if kind in plan.ANSWER_LOST and not result.get("reconciled"):
        v.add("lost_answer_not_reconciled", f"{key} ({kind}): result {result}")


def verify(
    events: list[PlannedEvent],
    deliveries: list[Delivery],
    answers: list[Answer],
    final: dict[int, Answer],
    crm: dict[str, Any],
    db: DbState,
    outage: tuple[float, float] | None,
    *,
    outage_planned: bool = True,
) -> tuple[Violations, dict[str, Any]]:
    """Check every event; returns the violations and the facts the report prints.
    `outage`: when PostgreSQL was down, if it was; `outage_planned`: whether the soak meant
    to take it down (a planned outage that never happened is a violation)."""
    v = Violations()
    by_key = {e.key: e for e in events}
    effects: dict[str, int] = crm["effects"]

    # 1. Each key ends in the state its behaviour makes certain, with one effect or none.
    for event in events:
        if event.via != plan.VIA_EVENTS or event.ordered or event.fanned_out:
            continue  # verify_claims, verify_ordered, fan_out_check.verify_fan_out
        label = f"event {event.index} ({event.behaviour.kind})"
        check_key(v, event.key, event.behaviour.kind, label, crm, db)
    # The keys the soak made: its events' and their deliveries'.
    made = by_key.keys() | {
        key
        for event in events
        if event.fanned_out
        for key in fan_out.delivery_keys(event.key).values()
    }
    for key in db.keys.keys() - made:
        v.add("unexpected_key", f"{key} ({db.keys[key]['status']}) was never sent")
    for key in effects.keys() - made:
        v.add("unexpected_effect", f"the CRM wrote {effects[key]} for unknown key {key}")

    # 2. Nothing left in flight or waiting to be sent.
    if db.outbox_due:
        v.add("unpublished_due_outbox_rows", f"{db.outbox_due} due outbox rows never published")

    # 3. Every planned delivery got a final answer, and the right one (`deliveries` are the
    # events' deliveries, numbered as the Sender numbers them).
    for i, delivery in enumerate(deliveries):
        event = delivery.event
        answer = final.get(i)
        if answer is None:
            v.add("delivery_unanswered", f"event {event.index} {delivery.kind}: no final answer")
            continue
        if delivery.kind == plan.CONFLICT:
            if answer.status != 422 or answer.error_code != "idempotency_key_reused":
                v.add(
                    "conflict_not_refused",
                    f"{event.key}: conflicting payload got {answer.status} {answer.error_code}",
                )
        elif answer.status not in (200, 202):
            v.add(
                "unexpected_answer",
                f"event {event.index} {delivery.kind}: {answer.status} {answer.error_code}",
            )
    for event in events:
        stored = db.payloads.get(event.key)
        if stored is not None and stored != event.payload:
            v.add("stored_payload_changed", f"{event.key}: stored {stored}, first {event.payload}")

    # 4. Every 2xx names a committed key (key, event and outbox row: a fan-out event's are its
    # deliveries', each a key), the one we expect; a finished key's repeat carries the first
    # answer (a fan-out event's status is its deliveries', and its answer lists them).
    answers_by_status: Counter[str] = Counter()
    for answer in answers:
        label = str(answer.status) if answer.status is not None else f"error:{answer.error}"
        answers_by_status[label] += 1
        event = events[answer.event]
        if answer.status is not None and 200 <= answer.status < 300:
            if answer.key != event.key:
                v.add("wrong_key", f"event {event.index}: answered key {answer.key}")
            planned = list(fan_out.delivery_keys(event.key).values()) if event.fanned_out else []
            queued = planned or [str(answer.key)]
            committed = (
                answer.key in db.keys
                and answer.key in db.payloads
                and all(key in db.keys and key in db.outbox_keys for key in queued)
            )
            if not committed:
                v.add("2xx_not_committed", f"{answer.key}: 2xx at {answer.started:.1f} s")
            if event.fanned_out and answer.deliveries != planned:
                v.add("fan_out_answer_deliveries", f"{event.key}: listed {answer.deliveries}")
            row = db.keys.get(event.key)
            status = row and (
                fan_out.aggregate(db.keys, event.key) if event.fanned_out else row["status"]
            )
            # A 200 repeat is only given for a finished key, whose state never changes again
            # (a superseded one's names the version that won).
            differs = row is not None and (
                answer.state != status
                or answer.external_ref != row["external_ref"]
                or answer.superseded_by != row["superseded_by"]
            )
            if answer.status == 200 and differs:
                assert row is not None
                v.add(
                    "repeat_not_first_answer",
                    f"{event.key}: repeat said {answer.state}/{answer.external_ref}"
                    f"/{answer.superseded_by}, final {status}/{row['external_ref']}"
                    f"/{row['superseded_by']}",
                )
        if answer.status == 503 and not answer.retry_after:
            v.add("503_without_retry_after", f"event {event.index} at {answer.started:.1f} s")
        _slow_or_failed(v, f"event {event.index}", answer)

    # 5. While PostgreSQL was down the receiver said so: 503 + Retry-After, quickly.
    during: list[Answer] = []
    if outage is not None:
        down, up = outage
        during = [a for a in answers if a.started < up and a.started + a.elapsed > down]
        told = [a for a in during if a.status == 503 and a.retry_after]
        if not told:
            v.add("no_503_while_database_down", f"{len(during)} answers during {down:.1f}-{up:.1f}")
    elif outage_planned:
        v.add("no_database_outage", "the PostgreSQL restart did not happen")

    latencies = sorted(a.elapsed for a in answers)
    facts = {
        "answers_by_status": dict(sorted(answers_by_status.items())),
        "receiver_duplicates": sum(1 for a in answers if a.duplicate),
        "repeats_answered_superseded": sum(
            1 for a in answers if a.status == 200 and a.state == "superseded"
        ),
        "conflicts_refused": sum(
            1 for a in final.values() if a.kind == plan.CONFLICT and a.status == 422
        ),
        "answers_during_outage": dict(Counter(str(a.status or a.error) for a in during)),
        "max_latency_seconds": round(latencies[-1], 3) if latencies else 0.0,
        "p99_latency_seconds": round(latencies[int(0.99 * (len(latencies) - 1))], 3)
        if latencies
        else 0.0,
        "max_latency_during_outage_seconds": round(max((a.elapsed for a in during), default=0), 3),
    }
    return v, facts


def verify_ordered(
    events: list[PlannedEvent],
    crm: dict[str, Any],
    db: DbState,
    v: Violations,
    lanes: str = "source",
) -> dict[str, Any]:
    """Check the ordered route's contacts (adds to `v`): per contact the versions applied at
    the CRM strictly increase and end at the highest sent; every update ends `succeeded`
    (applied once) or `superseded` (by a newer version, applied at most once: its write may
    have landed before its answer was lost), none applied twice, none dead-lettered. How the
    receivers store a contact's lane (`lanes`): "source" (`<source>:<contact>`), "shared"
    (the contact alone: the route names its sources), or "either" (receivers of two
    releases). Returns the facts the report prints."""
    effects: dict[str, int] = crm["effects"]
    applied: dict[str, list[list[Any]]] = {
        contact: [list(write) for write in writes] for contact, writes in crm["applied"].items()
    }
    ordered = [e for e in events if e.ordered]
    sent: dict[str, list[PlannedEvent]] = defaultdict(list)
    for event in ordered:
        assert event.contact is not None
        sent[event.contact].append(event)
    route = f"crm-{plan.ORDERED_COLLECTION}"
    superseded_with_effect = 0
    for contact, updates in sent.items():
        versions = [version for version, _ in applied.get(contact, [])]
        highest = max(e.version or 0 for e in updates)
        if any(a >= b for a, b in pairwise(versions)):
            v.add("ordered_out_of_order", f"{contact}: applied versions {versions}")
        if not versions or versions[-1] != highest:
            v.add(
                "ordered_last_not_highest",
                f"{contact}: applied {versions}, highest sent {highest}",
            )
        remembered = [db.lanes.get((route, lane)) for lane in _lanes(contact, lanes)]
        if str(highest) not in remembered:
            v.add(
                "ordered_lane_not_at_highest",
                f"{contact}: the lane remembers {remembered!r}, highest sent {highest}",
            )
    for event in ordered:
        key = event.key
        row = db.keys.get(key)
        label = f"{event.contact} v{event.version} ({event.behaviour.kind})"
        if row is None:
            v.add("key_missing", f"{label}: no key {key}")
            continue
        status, n = row["status"], effects.get(key, 0)
        if n > 1:
            v.add("duplicate_effect", f"{label}: {n} effects, status {status}")
        if db.dead_letters.get(key):
            v.add("unexpected_dead_letter", f"{label}: {db.dead_letters[key]}")
        if row["lane"] not in _lanes(str(event.contact), lanes):
            v.add("ordered_wrong_lane", f"{label}: lane {row['lane']!r}")
        if status == "succeeded":
            if n != 1:
                v.add("succeeded_without_effect", f"{label}: {n} effects at the CRM")
            if row["external_ref"] != crm["refs"].get(key):
                v.add(
                    "external_ref_mismatch",
                    f"{label}: stored {row['external_ref']!r}, CRM {crm['refs'].get(key)!r}",
                )
        elif status == "superseded":
            superseded_with_effect += 1 if n else 0
            newer = row["superseded_by"]
            if not (str(newer).isdigit() and int(newer) > (event.version or 0)):
                v.add("superseded_by_not_newer", f"{label}: superseded by {newer!r}")
        elif status in ("pending", "processing", "failed_retryable"):
            v.add("key_unfinished", f"{label} is {status} ({row['error_code']})")
        else:
            v.add("ordered_unexpected_status", f"{label}: {status} ({row['error_code']})")
    statuses = Counter(db.keys[e.key]["status"] for e in ordered if e.key in db.keys)
    return {
        "route": route,
        "contacts": len(sent),
        "events": len(ordered),
        "statuses": dict(statuses),
        "superseded_with_effect": superseded_with_effect,
        "applied_writes": sum(len(w) for w in applied.values()),
        "applied": {contact: [version for version, _ in w] for contact, w in applied.items()},
    }


def _lanes(contact: str, lanes: str) -> tuple[str, ...]:
    """The names a contact's lane may be stored under (see `verify_ordered`)."""
    own, shared = f"{SOURCE}:{contact}", contact
    return {"source": (own,), "shared": (shared,), "either": (shared, own)}[lanes]


def verify_claims(
    events: list[PlannedEvent],
    deliveries: list[Delivery],
    ledger: Ledger,
    crm: dict[str, Any],
    db: DbState,
    v: Violations,
) -> dict[str, Any]:
    """Check the claims share (adds to `v`): each key final with one effect when it
    succeeded and none when the workflow declared none, lost answers and abandoned claims
    reconciled, each key acted on by its own kind of actor only, every delivery answered.
    Returns the facts the report prints."""
    effects: dict[str, int] = crm["effects"]
    refs: dict[str, str] = crm["refs"]
    actors: dict[str, dict[str, int]] = crm["actors"]
    claims = [e for e in events if e.via == plan.VIA_CLAIMS]

    # 1. One actor kind per key: the gateway never touches a claims key, and the other way.
    for event in events:
        seen = actors.get(event.key, {})
        if event.via == plan.VIA_CLAIMS and seen.get(GATEWAY):
            row = db.keys.get(event.key) or {}
            v.add(
                "gateway_acted_on_claim_key",
                f"{event.key}: {seen[GATEWAY]} CRM request(s) from the gateway's worker,"
                f" status {row.get('status')}, attempts {row.get('attempts')}",
            )
        if event.via == plan.VIA_EVENTS and seen.get(WORKFLOW):
            v.add("workflow_acted_on_event_key", f"{event.key}: {seen[WORKFLOW]} request(s)")

    # 2. Each claims key ends as its behaviour makes certain.
    for event in claims:
        key, kind = event.key, event.behaviour.kind
        row = db.keys.get(key)
        if row is None:
            v.add("key_missing", f"claims event {event.index} ({kind}): no key {key}")
            continue
        status, n = row["status"], effects.get(key, 0)
        dead = db.dead_letters.get(key, [])
        declared = ledger.declared.get(key, [])
        via = ledger.completed_via.get(key, [])
        label = f"{key} ({kind}{', abandoned' if key in ledger.abandoned else ''})"
        if n > 1:
            v.add(
                "duplicate_effect",
                f"{label}: {n} effects, {crm['posts'].get(key, 0)} writes, status {status},"
                f" attempts {row['attempts']}, completed via {via}, declared {declared}",
            )
        if key in db.outbox_keys:
            v.add("claims_key_in_outbox", f"{label}: has an outbox row (status {status})")
        if status not in FINAL_STATUSES:
            holder = "a live lease" if row["lease_live"] else "no live lease"
            v.add(
                "key_unfinished", f"{label} is {status} with {holder}, attempts {row['attempts']}"
            )
            continue
        if status == "failed_final":
            last = declared[-1] if declared else None
            if last is None or last[1]:
                v.add("failed_final_undeclared", f"{label}: failed_final, declared {declared}")
            elif n > (0 if last[2] == "none" else 1):
                v.add("effect_for_refused_key", f"{label}: {n} effects, declared {last}")
            if [code for _, code in dead] != [last[0] if last else None]:
                v.add("expected_permanent_dead_letter", f"{label}: dead letters {dead}")
            if kind != plan.INVALID:
                v.add("expected_succeeded", f"{label}: failed_final, declared {declared}")
            continue
        if kind == plan.INVALID or status != "succeeded":
            v.add("unexpected_final_state", f"{label}: {status}, dead letters {dead}")
            continue
        if dead:
            v.add("unexpected_dead_letter", f"{label}: {dead}")
        if n != 1:
            v.add("succeeded_without_effect", f"{label}: {n} effects at the CRM")
        if row["external_ref"] != refs.get(key):
            v.add(
                "external_ref_mismatch",
                f"{label}: stored {row['external_ref']!r}, CRM {refs.get(key)!r}",
            )
        if len(via) != 1:
            v.add("completed_not_once", f"{label}: completed via {via}")
        must_look = kind in plan.ANSWER_LOST or key in ledger.abandoned
        if must_look and via != ["lookup"]:
            v.add("lost_answer_not_reconciled", f"{label}: completed via {via}")
        if key in ledger.abandoned and not row["reclaimed_count"]:
            v.add("abandoned_not_reclaimed", f"{label}: reclaimed_count 0")

    # 3. Every claims delivery got a final answer, the right one, in time.
    for i, delivery in enumerate(deliveries):
        how = ledger.final.get(i)
        expected = {"conflict_refused"} if delivery.kind == plan.CONFLICT else CLAIMS_FINAL_ANSWERS
        if how not in expected:
            v.add(
                "claims_delivery_unfinished",
                f"{delivery.event.key} {delivery.kind}: ended {how!r}",
            )
    for check_name, detail in ledger.problems:
        v.add(check_name, detail)
    calls_by: Counter[str] = Counter()
    for call in ledger.calls:
        label = str(call.status) if call.status is not None else f"error:{call.error}"
        calls_by[f"{call.endpoint} {label} {call.answer or ''}".strip()] += 1
        if call.status is not None and call.status >= 500 and call.status != 503:
            v.add("claims_5xx", f"event {call.event} {call.endpoint}: {call.status}")
        _slow_or_failed(v, f"claims event {call.event} {call.endpoint}", call)

    claimed = [c for c in ledger.calls if c.endpoint == "claim" and c.status == 201]
    return {
        "events": len(claims),
        "deliveries": len(deliveries),
        "behaviours": dict(Counter(e.behaviour.kind for e in claims)),
        "runs": dict(ledger.outcomes),
        "calls": dict(sorted(calls_by.items())),
        "claimed": len(claimed),
        "claimed_uncertain": sum(1 for c in claimed if c.uncertain),
        "claimed_reclaimed": sum(1 for c in claimed if c.reclaimed),
        "abandoned": len(ledger.abandoned),
        "completed_via": dict(Counter(w for ws in ledger.completed_via.values() for w in ws)),
        "declared_failures": dict(
            Counter(
                f"{'retryable' if retryable else 'final'}/{effect}"
                for ds in ledger.declared.values()
                for _, retryable, effect in ds
            )
        ),
        "statuses": dict(Counter(db.keys[e.key]["status"] for e in claims if e.key in db.keys)),
        "effects_total": sum(effects.get(e.key, 0) for e in claims),
        "keys_with_more_than_one": sum(1 for e in claims if effects.get(e.key, 0) > 1),
        "gateway_requests_for_claims_keys": sum(
            actors.get(e.key, {}).get(GATEWAY, 0) for e in claims
        ),
    }


def verify_route_outage(
    outage: plan.RouteOutage,
    crm: dict[str, Any],
    events: Counter[tuple[str, str]],
    db: DbState,
    in_flight: int,
    kills: int,
    violations: Violations,
) -> dict[str, Any]:
    """While one route's downstream was down its circuit opened, only a bounded number of
    writes reached it, and the circuit closed again. The bound: the failures that open the
    circuit (the window's minimum of calls, or as many as the successes it still weighed from
    before the outage), the attempts already in flight, the trials of each half-open spell,
    and a trial again for each worker killed meanwhile. That its keys lost nothing is checked
    with every other key in `verify`."""
    route = f"crm-{outage.collection}"
    refused = int(crm.get("refused_while_down", 0))
    trials = plan.max_trials(
        outage.seconds,
        plan.CIRCUIT_COOLDOWN_SECONDS,
        plan.CIRCUIT_COOLDOWN_CAP_SECONDS,
        plan.CIRCUIT_HALF_OPEN_CALLS,
    )
    opening = max(plan.CIRCUIT_MINIMUM_CALLS, int(crm.get("written_before_down", 0)))
    bound = opening + in_flight + trials + kills
    opened = events[("route.circuit_opened", route)]
    closed = events[("route.circuit_closed", route)]
    if refused == 0:
        violations.add(
            "route_outage_unseen",
            f"no write reached {route} while it was down ({outage.start:.1f}-{outage.end:.1f} s)",
        )
    if refused > bound:
        violations.add(
            "route_outage_unbounded", f"{refused} writes reached {route} while down (bound {bound})"
        )
    if opened == 0 and refused > 0:
        violations.add("circuit_never_opened", f"{route}: {refused} writes refused, never opened")
    if closed == 0 and opened > 0:
        violations.add("circuit_never_closed", f"{route} opened {opened} times, never closed")
    if db.circuits.get(route, "closed") != "closed":
        violations.add("circuit_left_open", f"{route} ends {db.circuits[route]}")
    return {
        "route": route,
        "start": round(outage.start, 1),
        "end": round(outage.end, 1),
        "seconds": round(outage.seconds, 1),
        "writes_refused": refused,
        "bound": bound,
        "circuit_opened": opened,
        "circuit_closed": closed,
        "trials": events[("route.trial", route)],
        "final_circuit": db.circuits.get(route, "closed"),
    }


def verify_partial_failure(
    partial: plan.PartialFailure,
    crm: dict[str, Any],
    events: Counter[tuple[str, str]],
    db: DbState,
    violations: Violations,
) -> dict[str, Any]:
    """A route whose downstream refused a share of its writes for a while (`partial`: the
    spell as it really was): the spell was real (writes met it, and some were refused), and
    the circuit, if it opened, ends closed. A spell that met no write at all is reported
    apart: it says nothing of the gateway, only that the soak gave it nothing to refuse. That
    every key of the route succeeded once, neither stalled nor looping, is checked with every
    key in `verify`."""
    route = f"crm-{partial.collection}"
    writes = int(crm.get("writes_while_flaky", 0))
    refused = int(crm.get("refused_while_flaky", 0))
    opened = events[("route.circuit_opened", route)]
    closed = events[("route.circuit_closed", route)]
    window = f"{partial.start:.1f}-{partial.end:.1f} s"
    if writes == 0:
        violations.add(
            "partial_failure_unexercised", f"no write reached {route} during its spell ({window})"
        )
    elif refused == 0:
        violations.add(
            "partial_failure_unseen",
            f"none of the {writes} writes to {route} during its spell ({window}) was refused"
            f" (share {partial.share:.0%})",
        )
    if db.circuits.get(route, "closed") != "closed":
        violations.add("circuit_left_open", f"{route} ends {db.circuits[route]}")
    return {
        "route": route,
        "start": round(partial.start, 1),
        "end": round(partial.end, 1),
        "seconds": round(partial.seconds, 1),
        "share": partial.share,
        "writes": writes,
        "writes_refused": refused,
        "circuit_opened": opened,
        "circuit_closed": closed,
        "final_circuit": db.circuits.get(route, "closed"),
    }
