"""The end of the multi-host soak: drain, wait for quiescence, check, report.

The checks are `make chaos`'s (tests/chaos/check.py: one effect per key, nothing lost, the
claims, the ordered route, fan-out) plus the soak's own (tests/chaos/net_check.py: no write
after a takeover, no overlapping attempts). The report lists each fault (what, when, how
long) with what the gateway did around it.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.chaos import check, fan_out, fan_out_check, net_check, plan
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.net_chaos import NetChaos, say
from tests.chaos.net_fleet import NetFleet
from tests.chaos.netns import Network
from tests.chaos.plan import Delivery, PlannedEvent
from tests.chaos.settle import Timeline, wait_quiescent
from tests.chaos.soak import (
    _fmt,
    attempt_rows,
    closing_rows,
    crm_facts,
    machine_and_sent,
    render,
)
from tests.chaos.workflow import Workflows

# How long past a fault's end its effects are still counted as its own (a lease taken over
# after a cut ends a lease and a sweep later; a healed connection waits for a retransmission).
AFTERMATH_SECONDS = 15.0


@dataclass
class Run:
    """What the soak started, for the checks and for stopping it all."""

    args: argparse.Namespace
    seed: int
    net: Network
    log_dir: Path
    database_url: str = ""
    crm: FakeCrm | None = None
    fleet: NetFleet | None = None
    sender: Sender | None = None
    workflows: Workflows | None = None
    chaos: NetChaos | None = None
    timeline: Timeline | None = None
    events: list[PlannedEvent] = field(default_factory=list)
    posted: list[Delivery] = field(default_factory=list)
    claimed: list[Delivery] = field(default_factory=list)
    claims_token: str = ""
    t0_wall: float = 0.0
    keep_logs: bool = False
    # When the database was down for the receivers (seconds into the send phase), if a fault
    # other than a receiver's cut from it made it so (the HA soak's failover).
    outage: tuple[float, float] | None = None
    # Whether the plan has such a fault (the HA soak's plan of the operator's choosing may not).
    outage_planned: bool = True

    def stop(self) -> None:
        """Stop the faults and the clients, heal every fault, stop every process (safe to
        call twice). The fault thread stops first: a soak cut short starts no fault while
        its clients finish their requests."""
        if self.chaos is not None:
            self.chaos.stop.set()
        for scheduler in (self.sender, self.workflows):
            if scheduler is not None:
                scheduler.stop()
        if self.chaos is not None:
            self.chaos.thread.join(timeout=30)
            self.chaos.heal_all()
        if self.fleet is not None:
            self.fleet.stop_all()


def _wait(run: Run) -> tuple[bool, bool, dict[str, int], float, float]:
    """Drain the clients, then wait for quiescence (and watch on past the bound); returns
    (drained, quiet within the bound, counts, seconds to quiet, last request)."""
    args, sender, workflows = run.args, run.sender, run.workflows
    assert sender is not None and workflows is not None and run.timeline is not None
    assert run.crm is not None
    deadline = time.monotonic() + 90
    while (sender.outstanding() or workflows.outstanding()) and time.monotonic() < deadline:
        time.sleep(0.5)
        run.timeline.tick()
    drained = sender.outstanding() == 0 and workflows.outstanding() == 0
    last_request = sender.now()
    quiet, counts, after = wait_quiescent(
        run.database_url, run.crm, args.quiesce_timeout, run.timeline
    )
    within = quiet
    say(f"chaos-net: quiescent={quiet} after {after:.1f} s: {counts}")
    if not quiet and args.observe_after > 0:
        quiet, counts, extra = wait_quiescent(
            run.database_url, run.crm, args.observe_after, run.timeline
        )
        after += extra
        say(f"chaos-net: then quiescent={quiet} after {after:.1f} s: {counts}")
    return drained, within, counts, (after if quiet else -1.0), last_request


def _worker_keys(events: list[PlannedEvent]) -> set[str]:
    """The keys the gateway's worker acts on: each posted event's, or its deliveries'."""
    keys: set[str] = set()
    for event in events:
        if event.via != plan.VIA_EVENTS:
            continue
        if event.fanned_out:
            keys.update(fan_out.delivery_keys(event.key).values())
        else:
            keys.add(event.key)
    return keys


def finish(run: Run) -> int:
    args, net = run.args, run.net
    sender, workflows, chaos, fleet, crm = run.sender, run.workflows, run.chaos, run.fleet, run.crm
    assert sender and workflows and chaos and fleet and crm and run.timeline
    started = time.monotonic()
    drained, within, counts, quiet_after, last_request = _wait(run)
    sender.stop()
    workflows.stop()
    crm_state = crm.snapshot()
    db = check.read_db(run.database_url)
    attempts = net_check.read_attempts(run.database_url)
    views = fan_out_check.read_views(
        fleet.url("receiver-2"), run.claims_token, [e.key for e in run.events if e.fanned_out]
    )
    run.stop()
    counters = check.worker_counters(fleet.metrics_dirs())
    sweeps = check.sweeper_totals(sorted(run.log_dir.glob("sweeper-*.log")))
    logs = {name: net_check.read_log(run.log_dir / f"{name}.log") for name in fleet.procs}

    receiver_cuts = [f for f in chaos.log if f["kind"] == "cut" and f["peer"] == "db"]
    receiver_cuts = [f for f in receiver_cuts if f["host"].startswith("receiver")]
    outage = run.outage or (
        (receiver_cuts[0]["at"], receiver_cuts[0]["at"] + receiver_cuts[0]["seconds"])
        if receiver_cuts
        else None
    )
    events, posted = run.events, run.posted
    violations, facts = check.verify(
        events,
        posted,
        sender.answers,
        sender.final,
        crm_state,
        db,
        outage,
        outage_planned=run.outage_planned,
    )
    claims = check.verify_claims(events, run.claimed, workflows.ledger, crm_state, db, violations)
    ordered = check.verify_ordered(events, crm_state, db, violations)
    fanned = fan_out_check.verify_fan_out(events, crm_state, db, views, violations)
    host_of_address = {net.ip(host): host for host in net.hosts}
    takeovers = net_check.verify_takeovers(
        attempts,
        crm_state["requests"],
        host_of_address,
        _worker_keys(events),
        net_check.give_ups(logs, fleet.host_of),
        violations,
    )
    if not drained:
        violations.add(
            "clients_not_done",
            f"{sender.outstanding()} event and {workflows.outstanding()} claims deliveries"
            " unanswered",
        )
    if not within:
        violations.add("not_quiescent", f"after {args.quiesce_timeout:.0f} s: {counts}")
    for error in chaos.errors:
        violations.add("fault_failed", error)
    if len(chaos.log) < chaos.planned:
        violations.add("fault_missing", f"{len(chaos.log)} of {chaos.planned} faults happened")

    answers_by_receiver: dict[str, list[tuple[float, str]]] = {}
    for answer in sender.answers:
        host = host_of_address.get(answer.receiver.split("//")[-1].split(":")[0], "")
        answers_by_receiver.setdefault(host, []).append(
            (run.t0_wall + answer.started, str(answer.status or answer.error))
        )
    backlog = [
        (run.t0_wall + s["t"], int(s.get("outbox_unpublished", 0))) for s in run.timeline.samples
    ]
    for fault in chaos.log:
        fault["did"] = net_check.around(
            fault,
            logs,
            fleet.host_of,
            takeovers["takeovers"],
            answers_by_receiver,
            backlog,
            AFTERMATH_SECONDS,
        )
    report: dict[str, Any] = {
        "ok": violations.total == 0,
        "seed": run.seed,
        "seconds": args.seconds,
        "events": args.events,
        "lease_seconds": args.lease_seconds,
        "started_at": args.started_at,
        "hosts": {host: net.ip(host) for host in net.hosts},
        "elapsed_after_traffic_seconds": round(time.monotonic() - started, 1),
        "quiescence_seconds": round(quiet_after, 1) if quiet_after >= 0 else None,
        "quiescent_within_bound": within,
        "quiesce_timeout": args.quiesce_timeout,
        "last_request_at": round(last_request, 1),
        **machine_and_sent(run.timeline, len(events) - claims["events"], posted, sender),
        "answers": facts,
        "claims": claims,
        "ordered": ordered,
        "fan_out": fanned,
        "crm": crm_facts(crm_state),
        "gateway": {
            "statuses": dict(Counter(r["status"] for r in db.keys.values())),
            "leases_reclaimed": sum(r["reclaimed_count"] for r in db.keys.values()),
            "attempts_by_outcome": dict(counters["attempts"]),
            "retries_by_code": dict(counters["retries"]),
            "reconciled": dict(counters["reconciled"]),
            "sweeper": dict(sweeps),
            "outbox_rows": db.outbox_rows,
        },
        "takeovers": {k: v for k, v in takeovers.items() if k != "takeovers"},
        "takeover_list": takeovers["takeovers"],
        "faults": chaos.log,
        "incidents": chaos.incidents,
        "timeline": run.timeline.samples,
        "violations": violations.as_dict(),
    }
    run.keep_logs = args.keep_logs or violations.total > 0 or bool(chaos.incidents)
    report_path = Path(args.report)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(table(report))
    for name, examples in report["violations"]["examples"].items():
        print(f"  violation {name}:")
        for example in examples:
            print(f"    - {example}")
    print(f"  report: {report_path}")
    return 0 if report["ok"] else 1


def _fault_line(fault: dict[str, Any]) -> str:
    did = fault.get("did", {})
    when = f"{fault['at']:.0f} s"
    if fault.get("planned_seconds"):
        when += f", {fault['seconds']:.1f} s"
    if "waited_for_write" in fault:
        caught = "a write in flight" if fault["write_in_flight"] else "no write in flight"
        when += f" (after {fault['waited_for_write']:.1f} s, {caught})"
    parts = []
    if "killed" in fault:
        parts.append(f"killed {fault['killed']}, started {fault['started']}")
    if did.get("leases_taken_over"):
        parts.append(
            f"{did['leases_taken_over']} leases taken over (by {_fmt(did['taken_over_by'])};"
            f" {did['gave_up_first']} given up first)"
        )
    for name, answers in did.items():
        if name.startswith("answers_"):
            parts.append(f"{name.removeprefix('answers_')} answered {_fmt(answers)}")
    if fault["host"] == "relay" or fault.get("peer") == "relay":
        parts.append(f"outbox backlog up to {did.get('outbox_backlog_max', 0)}")
    parts.append(f"logged: {_fmt(did.get('errors_logged', {}))}")
    return f"{when}: {fault['what']}: " + "; ".join(parts)


def table(report: dict[str, Any]) -> str:
    s, a, g, c, t = (report[k] for k in ("sent", "answers", "gateway", "crm", "takeovers"))
    k, q, fo = report["claims"], report["ordered"], report["fan_out"]
    statuses = a["answers_by_status"]
    two_xx = sum(n for code, n in statuses.items() if code.startswith("2"))
    margin = t["give_up_margin_min_seconds"]
    rows = [
        ("sent", f"{s['events']} events, {s['deliveries']} deliveries, {s['requests']} requests"),
        ("delivered", f"{two_xx} answered 2xx; answers: {_fmt(statuses)}"),
        (
            "side effects",
            f"{c['effects_total']} at the CRM for {c['keys_with_effect']} keys"
            f" ({c['keys_with_more_than_one']} keys with more than one); {c['writes']} writes,"
            f" {c['lookups']} lookups",
        ),
        ("final states", _fmt(g["statuses"])),
        *attempt_rows(g),
        (
            "takeovers",
            f"{t['takeovers_total']} from {_fmt(t['takeovers_by_host'])}"
            f" ({t['takeovers_same_host']} by the same host); {t['takeovers_reconciled_found']}"
            f" found the effect when reconciling; {t['writes_after_takeover']} writes and"
            f" {t['lookups_after_takeover']} lookups from the old holder after the takeover",
        ),
        (
            "lease margin",
            f"{t['gave_up_before_takeover']} holders logged giving up before the takeover"
            + (f" (at least {margin} s before it)" if margin is not None else ""),
        ),
        (
            "late writes",
            f"{t['writes_outside_own_attempt']} arrived outside every attempt of their host"
            + "".join(f"; {e}" for e in t["writes_outside_own_attempt_examples"][:3]),
        ),
        (
            "claims",
            f"{k['events']} events by workflows; {k['claimed']} claims"
            f" ({k['claimed_reclaimed']} reclaimed); completed via {_fmt(k['completed_via'])};"
            f" {k['keys_with_more_than_one']} keys with more than one effect",
        ),
        (
            "ordered",
            f"{q['events']} updates of {q['contacts']} contacts, ended {_fmt(q['statuses'])}",
        ),
        (
            "fan-out",
            f"{fo['events']} events, ended {_fmt(fo['events_by_status'])};"
            f" {fo['keys_with_more_than_one']} delivery keys with more than one effect",
        ),
        *((f"fault {i + 1}", _fault_line(fault)) for i, fault in enumerate(report["faults"])),
        *closing_rows(report),
    ]
    head = (
        f"idem chaos-net soak: seed {report['seed']}, {report['seconds']:g} s,"
        f" {report['events']} events, 9 hosts, lease {report['lease_seconds']} s,"
        f" {report['started_at']}"
    )
    return render(head, rows)
