"""`python -m tests.chaos.upgrade`: a rolling upgrade under load (`make chaos-upgrade`).

The gateway starts on the previous release's code (`upgrade_fleet.PREVIOUS_COMMIT`, checked
out from this repository's history) and schema: two receivers, two relays, several workers
and the sweeper as real processes over a PostgreSQL and a Redis of the soak's own. The chaos
soak's traffic runs (tests/chaos/soak.py: events delivered one to four times, conflicting
payloads, workflows through /v1/claims, an ordered route, fan-out, and a fake CRM that loses,
delays and refuses answers), and meanwhile the upgrade happens live, in the order asked for
(tests/chaos/rollout.py; by default the one docs/how-to/upgrading.md prescribes): this
checkout's migrations, then each kind of process replaced by this checkout's code one process
at a time. Then the traffic ends, the soak waits for every key to finish, and checks:

- every event as `make chaos` does: nothing acknowledged is lost, no key has two effects,
  every key final, quiescent within the bound (tests/chaos/check.py);
- intake answered nothing but 202, 200, a 503 with Retry-After, or the 422 a conflicting
  payload must get (a 500, or a refused connection, is a violation);
- no process exited by itself, each stopped cleanly on SIGTERM, each ran the code it was
  meant to (the folder its `outbox` and `worker` came from), and at the end every process
  runs this checkout's code on this checkout's schema.

It prints a table, writes a JSON report, and exits 1 on any violation (2 if it could not run).

    python -m tests.chaos.upgrade [--short] [--duration 300] [--events N] [--seed N]
                                  [--order migrate,workers,relays,sweeper,receivers]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from outbox.store.migrate import head_revisions
from tests.chaos import check, fan_out_check, plan, settle
from tests.chaos.check import Violations
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.net_soak import warm_up
from tests.chaos.rollout import ORDER, Rollout, errors_logged
from tests.chaos.servers import OwnPostgres, OwnRedis
from tests.chaos.soak import crm_facts, machine_and_sent, write_routes
from tests.chaos.upgrade_fleet import (
    NEW,
    OLD,
    PREVIOUS_COMMIT,
    PREVIOUS_RELEASE,
    PREVIOUS_SCHEMA,
    VersionedFleet,
    check_out,
    schema_revision,
)
from tests.chaos.upgrade_report import table
from tests.chaos.workflow import Workflows
from tests.support import ROOT

DEFAULT_REPORT = ROOT / ".idem" / "chaos-upgrade-report.json"
RECEIVERS = 2
RELAYS = 2
# Events per second by default: `make chaos` sends 17 on one host; here old and new processes
# overlap at every step (two workers starting, one stopping), on the same two cores.
EVENTS_PER_SECOND = 10
SHORT_SECONDS = 90.0


def start_gateway(fleet: VersionedFleet, workers: int, concurrency: int) -> None:
    """Every process on the previous release's code."""
    for _ in range(RECEIVERS):
        fleet.start_receiver()
    for _ in range(RELAYS):
        fleet.start_relay()
    for _ in range(workers):
        fleet.start_worker(concurrency)
    fleet.start_sweeper()


def intake_answers(sender: Sender, violations: Violations) -> None:
    """Every answer intake gave was 202, 200, a 503 with Retry-After, or a conflict's 422."""
    for answer in sender.answers:
        fine = (
            answer.status in (200, 202)
            or (answer.status == 503 and bool(answer.retry_after))
            or (answer.status == 422 and answer.kind == plan.CONFLICT)
        )
        if not fine:
            violations.add(
                "intake_answer",
                f"event {answer.event} ({answer.kind}) at {answer.started:.1f} s from"
                f" {answer.receiver}: {answer.status or answer.error} {answer.error_code or ''}",
            )


def process_checks(
    fleet: VersionedFleet, rollout: Rollout, order: list[str], violations: Violations
) -> None:
    """No process exited by itself, every step ran, each process ran the code it was meant
    to, and (with every kind of process in `order`) all of them end on this checkout's."""
    for incident in rollout.supervisor.incidents:
        violations.add(
            "process_lost", f"{incident['process']} {incident['what']}: {incident['last_error']}"
        )
    for error in rollout.errors:
        violations.add("step_failed", error)
    if len(rollout.log) < len(rollout.units):
        violations.add("step_missing", f"{len(rollout.log)} of {len(rollout.units)} steps ran")
    for problem in fleet.code_problems():
        violations.add("wrong_code", problem)
    if set(order) >= set(ORDER):
        for role in ("receiver", "relay", "worker", "sweeper"):
            for proc in fleet.alive(role):
                if fleet.version_of[proc.name] != NEW:
                    violations.add("not_upgraded", f"{proc.name} still runs {PREVIOUS_RELEASE}")


def answers_by_receiver(sender: Sender, fleet: VersionedFleet) -> dict[str, dict[str, int]]:
    """Intake's answers per receiver (`<name> (<version>)`), by status."""
    names = {fleet.url(fleet.procs[name]): name for name in fleet.ports}
    found: dict[str, Counter[str]] = {}
    for answer in sender.answers:
        name = names.get(answer.receiver, answer.receiver)
        label = f"{name} ({fleet.version_of.get(name, '?')})"
        found.setdefault(label, Counter())[str(answer.status or answer.error)] += 1
    return {label: dict(counts) for label, counts in sorted(found.items())}


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    t_start = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="idem-chaos-upgrade-"))
    log_dir, metrics_root = base / "logs", base / "metrics"
    log_dir.mkdir()
    metrics_root.mkdir()
    settle.say(
        f"chaos-upgrade: seed {seed}, {args.duration:g} s, {args.events} events, order {args.order}"
    )
    crm = FakeCrm(seed, late=args.applied_late)
    postgres = OwnPostgres(base / "pg")
    broker = OwnRedis(base / "redis")
    fleet: VersionedFleet | None = None
    sender: Sender | None = None
    workflows: Workflows | None = None
    rollout: Rollout | None = None
    keep_logs = args.keep_logs
    report: dict[str, Any] = {}
    try:
        old_tree = check_out(args.commit, base / "previous")
        crm.start()
        database_url = postgres.start()
        broker_url = broker.start()
        routes = write_routes(
            base / "routes.toml", crm.url, args.max_attempts, not args.lanes_by_source
        )
        env = settle.gateway_env(database_url, broker_url, "redis", routes, args.sweep_grace)
        token = env["CLAIMS_TOKEN"]
        fleet = VersionedFleet(env, log_dir, metrics_root, trees={OLD: old_tree, NEW: ROOT})
        _, code, output = fleet.migrate(OLD)
        if code != 0:
            raise RuntimeError(f"{PREVIOUS_RELEASE}'s idem migrate exited {code}: {output[-2000:]}")
        schema_before = schema_revision(database_url)
        start_gateway(fleet, args.workers, args.concurrency)
        events, deliveries = plan.plan_events(
            seed, args.events, args.duration, args.claims_share, late=args.applied_late
        )
        posted = [d for d in deliveries if d.event.via == plan.VIA_EVENTS]
        claimed = [d for d in deliveries if d.event.via == plan.VIA_CLAIMS]
        receivers = [fleet.url(p) for p in fleet.alive("receiver")]
        sender = Sender(receivers, posted)
        workflows = Workflows(receivers, crm, claimed, token, seed)
        rollout = Rollout(
            args.order,
            fleet,
            [sender, workflows],
            token,
            sender.now,
            args.duration,
            args.concurrency,
        )
        warm_up(receivers, token)
        settle.say(
            f"chaos-upgrade: {len(posted)} event and {len(claimed)} claims deliveries; steps at"
            f" {[(round(at), kind) for at, (kind, _) in rollout.planned()]}"
        )
        sender.start()
        workflows.start(t0=sender.t0)
        rollout.start()
        timeline = settle.Timeline(database_url, sender, workflows)
        settled = settle.until_settled(args, sender, workflows, crm, timeline, rollout.done)
        sender.stop()
        workflows.stop()
        crm_state = crm.snapshot()
        db = check.read_db(database_url)
        views = fan_out_check.read_views(
            rollout.rotation[0], token, [e.key for e in events if e.fanned_out]
        )
        schema_after = schema_revision(database_url)
        rollout.finish()
        violations, facts = settle.verify_traffic(
            events,
            sender,
            workflows,
            crm_state,
            db,
            views,
            settled,
            args.quiesce_timeout,
            outage_planned=False,
            # Receivers of both releases store lanes by the contact alone when the route
            # names its sources; without, the previous release still does, this one not.
            lanes="either" if args.lanes_by_source else "shared",
        )
        intake_answers(sender, violations)
        process_checks(fleet, rollout, args.order, violations)
        heads = ",".join(sorted(head_revisions()))
        if schema_before != PREVIOUS_SCHEMA:
            violations.add("schema", f"{PREVIOUS_RELEASE} left revision {schema_before!r}")
        if "migrate" in args.order and schema_after != heads:
            violations.add("schema", f"after the upgrade: {schema_after!r}, not {heads!r}")
        fleet.stop_all()
        counters = check.worker_counters(fleet.metrics_dirs())
        sweeps = check.sweeper_totals(sorted(log_dir.glob("sweeper-*.log")))
        report = {
            "ok": violations.total == 0,
            "seed": seed,
            "previous": {"release": PREVIOUS_RELEASE, "commit": args.commit},
            "order": args.order,
            "lanes": "by source" if args.lanes_by_source else "shared",
            "applied_late": args.applied_late,
            "duration": args.duration,
            "events": args.events,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "started_at": started_at,
            "elapsed_seconds": round(time.monotonic() - t_start, 1),
            **settle.settled_facts(settled, args.quiesce_timeout),
            **machine_and_sent(timeline, len(events) - facts["claims"]["events"], posted, sender),
            **facts,
            "answers_by_receiver": answers_by_receiver(sender, fleet),
            "crm": crm_facts(crm_state),
            "gateway": settle.gateway_facts(db, counters, sweeps),
            "schema": {"before": schema_before, "after": schema_after},
            "steps": rollout.log,
            "readiness": rollout.readiness(),
            "processes": dict(fleet.version_of),
            "errors_logged": errors_logged(fleet),
            "incidents": rollout.supervisor.incidents,
            "timeline": timeline.samples,
            "violations": violations.as_dict(),
        }
        keep_logs = keep_logs or violations.total > 0
    except BaseException as error:
        report = settle.failed_report(seed, started_at, error)
        keep_logs = True
    finally:
        for scheduler in (sender, workflows):
            if scheduler is not None:
                scheduler.stop()
        if rollout is not None:
            rollout.finish()
        if fleet is not None:
            fleet.stop_all()
        for stop in (broker.stop, postgres.cleanup, crm.stop):
            stop()
        settle.leave(base, Path(args.report), f"chaos-upgrade-logs-{seed}", report, keep_logs)
    return settle.publish(report, Path(args.report), table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.upgrade", description=__doc__)
    parser.add_argument("--short", action="store_true", help=f"CI's run: {SHORT_SECONDS:g} s")
    parser.add_argument("--duration", type=float, default=None, help="default 300 (short: 90)")
    parser.add_argument("--events", type=int, default=None, help=f"default {EVENTS_PER_SECOND}/s")
    parser.add_argument(
        "--order",
        default=",".join(ORDER),
        help="the steps, comma-separated, from " + ", ".join(ORDER) + " (default: all, in"
        " the order docs/how-to/upgrading.md prescribes; a step left out is not done)",
    )
    parser.add_argument(
        "--commit",
        default=PREVIOUS_COMMIT,
        help=f"the release to upgrade from ({PREVIOUS_RELEASE})",
    )
    parser.add_argument(
        "--lanes-by-source",
        action="store_true",
        help="the ordered route does not name its sources, so this checkout's receivers store"
        " its lanes by source and the previous release's did not",
    )
    parser.add_argument(
        "--applied-late",
        action="store_true",
        help="a share of the CRM's writes is applied after the worker gave up on them, as in"
        f" make chaos ({PREVIOUS_RELEASE}'s workers and claims could act twice on such a"
        " write; off by default)",
    )
    parser.add_argument("--workers", type=int, default=3, help="worker processes")
    settle.add_soak_options(parser, DEFAULT_REPORT)
    args = parser.parse_args(argv)
    args.duration = args.duration or (SHORT_SECONDS if args.short else 300.0)
    args.events = args.events or round(EVENTS_PER_SECOND * args.duration)
    args.order = [step for step in args.order.split(",") if step]
    unknown = [step for step in args.order if step not in ORDER]
    if unknown or len(set(args.order)) < len(args.order):
        parser.error(f"--order takes each of {', '.join(ORDER)} at most once")

    settle.stop_on_signals(signal.SIGTERM, signal.SIGHUP)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
