"""The multi-host soak's own checks: no write from a holder whose lease was taken over, no two
attempts of a key overlapping in the database, and what the gateway did around each fault.

Both records share one clock: the fake CRM stamps each request's arrival with the wall clock,
and PostgreSQL's `now()` (the attempt log's `started_at`, `ended_at`) reads the same clock of the
same machine (network namespaces do not have clocks of their own). The CRM knows a request's
host by its source address; the attempt log knows an attempt's host by its holder
(`host:pid:thread`, the host's name being the hostname of every process on it).

A takeover is an attempt log row `lease_lost`/`lease_expired`: written by the claim that took an
expired lease over, it names the previous holder and ends at the new claim's `now()`, T. From T
on, another worker may act on the key, so any write that reaches the CRM from the old holder's
host after T is a violation (`write_after_takeover`), unless an attempt of that same host holds
the key again at that moment (a later claim by a process on the same host). Lookups after T are
counted, not judged: they change nothing.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime
from itertools import pairwise
from pathlib import Path
from typing import Any

from outbox.core.keys import mask_key
from tests.chaos.check import Violations, connect
from tests.chaos.crm import GATEWAY, Request

# A holder's log line saying it stopped trusting its lease counts for a takeover when it came
# at most this long after T (the worker's clock and the database's are one; a line is written
# just after the decision).
LOG_SLACK_SECONDS = 0.05


@dataclass(frozen=True)
class Attempt:
    key: str
    fence: int
    host: str
    start: float  # wall clock seconds
    end: float
    outcome: str
    error_code: str | None
    reconciled: bool | None

    @property
    def taken_over(self) -> bool:
        return self.outcome == "lease_lost" and self.error_code == "lease_expired"


def read_attempts(database_url: str) -> dict[str, list[Attempt]]:
    """Every key's attempts by fence. A taken-over attempt's row starts at the holder's last
    renewal; it is given the end of the attempt before it instead, the earliest its claim can
    have been, so that it covers every request the holder made."""
    query = (
        "SELECT idempotency_key, fence, worker, started_at, ended_at, outcome, error_code,"
        " reconciled FROM attempts ORDER BY idempotency_key, fence NULLS FIRST, id"
    )
    by_key: dict[str, list[Attempt]] = defaultdict(list)
    with connect(database_url) as conn:
        for key, fence, worker, started, ended, outcome, code, reconciled in conn.execute(query):
            rows = by_key[key]
            start = started.timestamp()
            if outcome == "lease_lost" and rows:
                start = min(start, rows[-1].end)
            host = str(worker or "").split(":", 1)[0]
            rows.append(
                Attempt(key, fence or 0, host, start, ended.timestamp(), outcome, code, reconciled)
            )
    return dict(by_key)


def verify_takeovers(
    attempts: dict[str, list[Attempt]],
    requests: list[Request],
    host_of_address: dict[str, str],
    worker_keys: set[str],
    give_ups: dict[tuple[str, str], list[float]],
    violations: Violations,
) -> dict[str, Any]:
    """The checks of the module's docstring over the keys the gateway's worker acts on; returns
    the facts the report prints (adds to `violations`)."""
    by_key: dict[str, list[Request]] = defaultdict(list)
    for request in requests:
        if request.actor == GATEWAY and request.key in worker_keys:
            by_key[request.key].append(request)
    takeovers: list[dict[str, Any]] = []
    stale_lookups = 0
    late_writes: list[str] = []
    unknown_hosts: Counter[str] = Counter()
    margins: list[float] = []
    for key in sorted(worker_keys):
        rows = attempts.get(key, [])
        for earlier, later in pairwise(rows):
            if not earlier.taken_over and earlier.end > later.start + LOG_SLACK_SECONDS:
                violations.add(
                    "attempts_overlap",
                    f"{key}: fence {earlier.fence} ({earlier.host}, {earlier.outcome}) ended"
                    f" {earlier.end - later.start:.2f} s after fence {later.fence}"
                    f" ({later.host}) was claimed",
                )
        for request in by_key.get(key, []):
            host = host_of_address.get(request.peer)
            if host is None:
                unknown_hosts[request.peer] += 1
                continue
            if request.method == "POST" and not any(
                a.host == host and a.start <= request.at <= a.end for a in rows
            ):
                late_writes.append(_late(key, host, request.at, rows))
        for index, old in enumerate(rows):
            if not old.taken_over:
                continue
            t = old.end
            new = next((a for a in rows[index + 1 :] if a.fence > old.fence), None)
            later_own = [a for a in rows[index + 1 :] if a.host == old.host]
            stale = [
                r
                for r in by_key.get(key, [])
                if host_of_address.get(r.peer) == old.host
                and r.at > t
                and not any(a.start <= r.at <= a.end for a in later_own)
            ]
            writes = [r for r in stale if r.method == "POST"]
            stale_lookups += len(stale) - len(writes)
            for write in writes:
                violations.add(
                    "write_after_takeover",
                    f"{key}: a write from {old.host} arrived {write.at - t:.2f} s after its lease"
                    f" (fence {old.fence}) was taken over by"
                    f" {new.host if new else 'an unlogged claim'}",
                )
            lines = give_ups.get((old.host, mask_key(key)), [])
            before = [line for line in lines if old.start <= line <= t + LOG_SLACK_SECONDS]
            if before:
                margins.append(t - max(before))
            takeovers.append(
                {
                    "key": mask_key(key),
                    "at": t,
                    "from": old.host,
                    "to": new.host if new else None,
                    "same_host": bool(new and new.host == old.host),
                    "reconciled": new.reconciled if new else None,
                    "stale_writes": len(writes),
                    "gave_up_first": bool(before),
                }
            )
    for address, n in unknown_hosts.items():
        violations.add("request_from_unknown_host", f"{n} gateway requests from {address}")
    return {
        "takeovers": takeovers,
        "takeovers_total": len(takeovers),
        "takeovers_by_host": dict(Counter(str(t["from"]) for t in takeovers)),
        "takeovers_same_host": sum(1 for t in takeovers if t["same_host"]),
        "takeovers_reconciled_found": sum(1 for t in takeovers if t["reconciled"] is True),
        "writes_after_takeover": sum(int(t["stale_writes"]) for t in takeovers),
        "lookups_after_takeover": stale_lookups,
        "writes_outside_own_attempt": len(late_writes),
        "writes_outside_own_attempt_examples": late_writes[:10],
        "gave_up_before_takeover": len(margins),
        "give_up_margin_min_seconds": round(min(margins), 2) if margins else None,
        "give_up_margin_median_seconds": round(sorted(margins)[len(margins) // 2], 2)
        if margins
        else None,
    }


def _late(key: str, host: str, at: float, rows: list[Attempt]) -> str:
    """A write that arrived outside every attempt of its host: when, against that host's
    attempts nearest before it (how long after their end), for the report."""
    before = [a for a in rows if a.host == host and a.start <= at]
    if not before:
        return f"{mask_key(key)}: a write from {host} before any attempt of it"
    last = max(before, key=lambda a: a.end)
    return (
        f"{mask_key(key)}: a write from {host} {at - last.end:.2f} s after its attempt"
        f" (fence {last.fence}) ended {last.outcome}"
    )


@dataclass(frozen=True)
class LogLine:
    at: float
    level: str
    event: str
    key: str | None
    outcome: str | None
    reason: str | None


def read_log(path: Path) -> list[LogLine]:
    """A process's JSON log lines (others, such as a traceback's continuation, are skipped)."""
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        if not text.startswith("{"):
            continue
        try:
            record = json.loads(text)
            at = datetime.fromisoformat(str(record["timestamp"]).replace("Z", "+00:00"))
        except (ValueError, KeyError):
            continue
        lines.append(
            LogLine(
                at.timestamp(),
                str(record.get("level", "")),
                str(record.get("event", ""))[:120],
                record.get("key"),
                record.get("outcome"),
                record.get("reason"),
            )
        )
    return lines


def give_ups(
    logs: dict[str, list[LogLine]], host_of: dict[str, str]
) -> dict[tuple[str, str], list[float]]:
    """(host, masked key) -> when a worker there logged giving its lease up or finding it lost
    (`attempt.finished outcome=lease_lost`)."""
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, lines in logs.items():
        for line in lines:
            if line.event == "attempt.finished" and line.outcome == "lease_lost" and line.key:
                found[(host_of.get(name, ""), line.key)].append(line.at)
    return found


def around(
    fault: dict[str, Any],
    logs: dict[str, list[LogLine]],
    host_of: dict[str, str],
    takeovers: list[dict[str, Any]],
    answers_by_receiver: dict[str, list[tuple[float, str]]],
    backlog: list[tuple[float, int]],
    after: float,
) -> dict[str, Any]:
    """What the gateway did from a fault's start to `after` seconds past its end: takeovers of
    leases held on its hosts, warnings and errors its hosts' processes logged (by event), the
    answers of a receiver involved, and the outbox backlog at its worst."""
    start, end = fault["started_wall"], fault["ended_wall"] + after
    hosts = {fault["host"], fault.get("peer") or fault["host"]}
    errors: Counter[str] = Counter()
    for name, lines in logs.items():
        if host_of.get(name) not in hosts:
            continue
        for line in lines:
            if start <= line.at <= end and line.level in ("warning", "error", "critical"):
                errors[f"{name.split('-')[0]}: {line.event}"] += 1
    reclaimed = [t for t in takeovers if t["from"] in hosts and start <= t["at"] <= end]
    facts: dict[str, Any] = {
        # Each one an attempt that ended without a recorded outcome: lost, and re-claimed.
        "leases_taken_over": len(reclaimed),
        "taken_over_by": dict(Counter(str(t["to"]) for t in reclaimed)),
        "gave_up_first": sum(1 for t in reclaimed if t["gave_up_first"]),
        "errors_logged": dict(errors.most_common(6)),
        "outbox_backlog_max": max((n for at, n in backlog if start <= at <= end), default=0),
    }
    for receiver in hosts & answers_by_receiver.keys():
        # While the fault lasted: a receiver's answers then say what it did about it.
        answers = answers_by_receiver[receiver]
        seen = [status for at, status in answers if start <= at <= fault["ended_wall"]]
        facts[f"answers_{receiver}"] = dict(Counter(seen))
    return facts
