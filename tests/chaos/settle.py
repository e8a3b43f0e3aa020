"""The single-host soaks' common parts around their traffic: the environment their processes
run in, the timeline of the run, the wait for the gateway to settle once the clients are done,
the checks of every event, and the report's end.

`make chaos` (tests/chaos/soak.py) and the upgrade soak (tests/chaos/upgrade.py) use them;
the multi-host soaks use the timeline and the wait for quiescence.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.chaos import check, fan_out_check, plan
from tests.chaos.check import DbState, Violations
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.workflow import Workflows
from tests.support import ROOT


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def gateway_env(
    database_url: str, broker_url: str, broker: str, routes: Path, sweep_grace: float
) -> dict[str, str]:
    """The environment of every gateway process of a single-host soak (`broker`: redis or
    rabbitmq), with a claims token of its own (`CLAIMS_TOKEN`)."""
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        CLAIMS_TOKEN=secrets.token_urlsafe(32),
        DATABASE_URL=database_url,
        BROKER_URL=broker_url,
        REDIS_URL=broker_url if broker == "redis" else "",
        ROUTES_FILE=str(routes),
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
        LEASE_SECONDS="5",
        # A workflow's CRM call gives up after 1 s (connect 1 s); a write the CRM applies
        # late lands within 2 s: no claim before then.
        CLAIMS_IN_FLIGHT_SECONDS="3",
        SWEEP_INTERVAL_SECONDS="0.5",
        SWEEP_GRACE_SECONDS=str(sweep_grace),
        RELAY_POLL_SECONDS="0.5",
        PYTHONPATH=str(ROOT),
    )
    return env


class Timeline:
    """A sample of the run every few seconds (load average, keys by status, outbox backlog,
    client progress) for the report; every third one is printed."""

    def __init__(
        self, database_url: str, sender: Sender, workflows: Workflows, every: float = 5.0
    ) -> None:
        self.database_url = database_url
        self.sender = sender
        self.workflows = workflows
        self.every = every
        self.samples: list[dict[str, Any]] = []
        self.max_load = 0.0
        self._next = 0.0

    def tick(self) -> None:
        load = os.getloadavg()[0]
        self.max_load = max(self.max_load, load)
        now = self.sender.now()
        if now < self._next:
            return
        self._next = now + self.every
        sample: dict[str, Any] = {
            "t": round(now, 1),
            "load1": round(load, 2),
            "answers": len(self.sender.answers),
            "outstanding": self.sender.outstanding(),
            "claims_calls": len(self.workflows.ledger.calls),
            "claims_outstanding": self.workflows.outstanding(),
        }
        try:
            sample.update(check.progress(self.database_url))
        except Exception as error:
            sample["database"] = type(error).__name__
        self.samples.append(sample)
        if len(self.samples) % 3 == 1:
            say("progress " + " ".join(f"{k}={v}" for k, v in sample.items()))


def wait_quiescent(
    database_url: str, crm: FakeCrm, timeout: float, timeline: Timeline, steady: float = 3.0
) -> tuple[bool, dict[str, int], float]:
    """Wait until every key is final, no outbox row is due and the CRM is idle, and stays so
    for `steady` seconds (a late, stale write would show up in that time)."""
    started = time.monotonic()
    deadline = started + timeout
    counts: dict[str, int] = {}
    quiet_since: float | None = None
    while time.monotonic() < deadline:
        timeline.tick()
        try:
            counts = check.progress(database_url)
        except Exception as error:
            say(f"quiescence: database not readable yet ({type(error).__name__})")
            time.sleep(1)
            continue
        idle = (
            check.unfinished(counts) == 0
            and counts["outbox_due"] == 0
            and crm.snapshot()["inflight"] == 0
        )
        if idle:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since >= steady:
                return True, counts, time.monotonic() - started
        else:
            quiet_since = None
        time.sleep(0.5)
    return False, counts, time.monotonic() - started


@dataclass
class Settled:
    """How the gateway settled after the traffic."""

    drained: bool  # every client delivery got its final answer
    last_request: float  # seconds into the send phase
    within_bound: bool  # quiescent within the bound
    counts_at_bound: dict[str, int]
    quiet: bool  # quiescent at last (within the bound, or while watched past it)
    counts: dict[str, int]
    quiet_after: float  # seconds after the last request


def until_settled(
    args: Any,
    sender: Sender,
    workflows: Workflows,
    crm: FakeCrm,
    timeline: Timeline,
    done: threading.Event,
) -> Settled:
    """Let the send phase run `args.duration` seconds and until `done` (the faults, or the
    upgrade's steps, are over; 120 s later at most), then the clients finish their
    deliveries (90 s at most), then wait up to `args.quiesce_timeout` for quiescence, and
    past it `args.observe_after` more, so the report says whether the gateway was stuck or
    only slow."""
    while sender.now() < args.duration or not done.is_set():
        time.sleep(0.5)
        timeline.tick()
        if sender.now() > args.duration + 120:
            break
    drain_deadline = time.monotonic() + 90
    while (sender.outstanding() or workflows.outstanding()) and time.monotonic() < drain_deadline:
        time.sleep(0.5)
        timeline.tick()
    drained = sender.outstanding() == 0 and workflows.outstanding() == 0
    last_request = sender.now()
    url = timeline.database_url
    quiet, counts, quiet_after = wait_quiescent(url, crm, args.quiesce_timeout, timeline)
    within_bound, counts_at_bound = quiet, counts
    say(f"chaos: quiescent={quiet} after {quiet_after:.1f} s: {counts}")
    if not quiet and args.observe_after > 0:
        quiet, counts, extra = wait_quiescent(url, crm, args.observe_after, timeline)
        quiet_after += extra
        say(f"chaos: then quiescent={quiet} after {quiet_after:.1f} s: {counts}")
    return Settled(drained, last_request, within_bound, counts_at_bound, quiet, counts, quiet_after)


def verify_traffic(
    events: list[plan.PlannedEvent],
    sender: Sender,
    workflows: Workflows,
    crm_state: dict[str, Any],
    db: DbState,
    views: dict[str, Any],
    settled: Settled,
    quiesce_timeout: float,
    *,
    outage: tuple[float, float] | None = None,
    outage_planned: bool = True,
    lanes: str = "source",
) -> tuple[Violations, dict[str, Any]]:
    """Every check of the soak's traffic: the events (tests/chaos/check.py), the claims, the
    ordered route, fan-out, the clients all answered, quiescence within its bound. Returns
    the violations and the facts under `answers`, `claims`, `ordered` (its lanes stored as
    `lanes` says: `check.verify_ordered`) and `fan_out`."""
    posted = sender.deliveries
    violations, answers = check.verify(
        events,
        posted,
        sender.answers,
        sender.final,
        crm_state,
        db,
        outage,
        outage_planned=outage_planned,
    )
    facts = {
        "answers": answers,
        "claims": check.verify_claims(
            events, workflows.deliveries, workflows.ledger, crm_state, db, violations
        ),
        "ordered": check.verify_ordered(events, crm_state, db, violations, lanes),
        "fan_out": fan_out_check.verify_fan_out(events, crm_state, db, views, violations),
    }
    if not settled.drained:
        violations.add(
            "clients_not_done",
            f"{sender.outstanding()} event and {workflows.outstanding()} claims"
            " deliveries unanswered",
        )
    if not settled.within_bound:
        violations.add("not_quiescent", f"after {quiesce_timeout:.0f} s: {settled.counts_at_bound}")
    return violations, facts


def settled_facts(settled: Settled, quiesce_timeout: float) -> dict[str, Any]:
    """The report's lines on quiescence."""
    return {
        "quiescence_seconds": round(settled.quiet_after, 1) if settled.quiet else None,
        "quiescent_within_bound": settled.within_bound,
        "quiesce_timeout": quiesce_timeout,
        "last_request_at": round(settled.last_request, 1),
    }


def gateway_facts(
    db: DbState, counters: dict[str, Counter[str]], sweeps: Counter[str]
) -> dict[str, Any]:
    """What the gateway did, from its database, its workers' counters and its sweepers' logs."""
    keys = db.keys.values()
    return {
        "statuses": dict(Counter(r["status"] for r in keys)),
        "dead_letters_by_kind": dict(
            Counter(kind for letters in db.dead_letters.values() for kind, _ in letters)
        ),
        "leases_reclaimed": sum(r["reclaimed_count"] for r in keys),
        "blocked_deliveries": sum(r["blocked_deliveries"] for r in keys),
        "duplicate_count": sum(r["duplicate_count"] for r in keys),
        "retries_by_code": dict(counters["retries"]),
        "attempts_by_outcome": dict(counters["attempts"]),
        "reconciled": dict(counters["reconciled"]),
        "reconciled_results": sum(1 for r in keys if (r["result"] or {}).get("reconciled")),
        "sweeper": dict(sweeps),
        "outbox_rows": db.outbox_rows,
        "outbox_unpublished": db.outbox_unpublished,
    }


def failed_report(seed: int, started_at: str, error: BaseException) -> dict[str, Any]:
    """The report of a soak that could not run (its traceback goes to stderr)."""
    traceback.print_exc()
    return {
        "ok": False,
        "seed": seed,
        "started_at": started_at,
        "error": f"{type(error).__name__}: {error}",
        "violations": {"total": 1, "by_check": {"soak_failed": 1}, "examples": {}},
    }


def leave(
    base: Path, report_path: Path, name: str, report: dict[str, Any], keep_logs: bool
) -> None:
    """Remove the run's folder `base`; with `keep_logs`, first copy its processes' logs
    (`base/logs`) next to the report (so a test's logs stay in its own temporary directory),
    as `<name>-<started_at>`, and name them in the report."""
    log_dir = base / "logs"
    if keep_logs and log_dir.exists():
        started_at = str(report.get("started_at", "")).replace(":", "")
        kept = report_path.resolve().parent / f"{name}-{started_at}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(log_dir, kept, dirs_exist_ok=True)
        report["logs"] = str(kept)
    shutil.rmtree(base, ignore_errors=True)


def add_soak_options(parser: argparse.ArgumentParser, report: Path) -> None:
    """The single-host soaks' common options (the report goes to `report` by default)."""
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--report", default=str(report), help="where the JSON report goes")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    parser.add_argument("--max-attempts", type=int, default=30, help="the routes' attempt budget")
    parser.add_argument(
        "--claims-share",
        type=float,
        default=plan.CLAIMS_SHARE,
        help="share of the events handled by workflows through /v1/claims",
    )
    parser.add_argument(
        "--sweep-grace",
        type=float,
        default=3.0,
        help="SWEEP_GRACE_SECONDS of the sweeper (3: lost messages are re-sent quickly)",
    )
    parser.add_argument(
        "--quiesce-timeout",
        type=float,
        default=120.0,
        help="seconds after the last request by which every key must be finished",
    )
    parser.add_argument(
        "--observe-after",
        type=float,
        default=300.0,
        help="when that bound is missed (a violation), keep watching this long before the"
        " final checks, to tell 'slow' from 'stuck' (0: check at once)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")


def stop_on_signals(*signums: int) -> None:
    """End the run as Ctrl-C does on these signals, so it stops what it started."""

    def interrupted(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in signums:
        signal.signal(signum, interrupted)


def publish(
    report: dict[str, Any], report_path: Path, table: Callable[[dict[str, Any]], str]
) -> int:
    """Write the JSON report, print its table and the violations' examples; the exit code
    (2: the soak could not run)."""
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    if "error" in report:
        say(f"chaos: the soak could not run: {report['error']}")
        say(f"chaos: report in {report_path}")
        return 2
    print(table(report))
    for name, examples in report["violations"]["examples"].items():
        print(f"  violation {name}:")
        for example in examples:
            print(f"    - {example}")
    if report.get("logs"):
        print(f"  logs kept in {report['logs']}")
    print(f"  report: {report_path}")
    return 0 if report["ok"] else 1
