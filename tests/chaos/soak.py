"""`python -m tests.chaos.soak`: a bounded chaos soak of the whole gateway (`make chaos`).

It starts a PostgreSQL and a broker of its own (a Redis, or with `--broker rabbitmq` a RabbitMQ
node), the receiver, two relays, several workers and the sweeper as real processes, and a fake
CRM that loses, delays and refuses answers per key. Clients deliver every event one to four
times (some copies at once, some at the very end, some with another payload under the same
key) while workers and relays are SIGKILLed and replaced, the broker is restarted (Redis
empty, RabbitMQ with its disk), PostgreSQL is stopped (fast) and started again, and one
route's downstream refuses every write for a while (its circuit must open and close). A fifth
of the events never goes to /v1/events: workflows (tests/chaos/workflow.py) make the CRM call
themselves through /v1/claims, and their claims are completed, failed, abandoned and
reclaimed. Then the faults stop, the soak waits for every key to finish, and checks every
event. It prints a table, writes a JSON report and exits 1 on any violation (2 if it could
not run).

    python -m tests.chaos.soak [--duration 300] [--events 5000] [--seed N] [--report PATH]
                               [--broker redis|rabbitmq]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from outbox.store.migrate import upgrade
from tests.chaos import check, fan_out, fan_out_check, plan
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.servers import Fleet, OwnBroker, OwnPostgres, OwnRabbit, OwnRedis, Supervisor
from tests.chaos.settle import (
    Timeline,
    add_soak_options,
    failed_report,
    gateway_env,
    gateway_facts,
    leave,
    publish,
    say,
    settled_facts,
    stop_on_signals,
    until_settled,
    verify_traffic,
)
from tests.chaos.workflow import Workflows
from tests.support import ROOT

DEFAULT_REPORT = ROOT / ".idem" / "chaos-report.json"


def write_routes(path: Path, crm_url: str, max_attempts: int, shared_lanes: bool = False) -> Path:
    """One http route per event type, each with a reconcile lookup; timeouts well inside the
    5 s lease; short backoff; a budget far above what the injected faults can use up; a
    circuit breaker with short cool-downs (see `plan.CIRCUIT_COOLDOWN_SECONDS`). The
    contacts' route also orders each contact's updates (`order_by`, `versions`), with
    `shared_lanes` naming its source (`sources`), whose lanes are then stored by the contact
    alone. The orders' route fans out to three destinations with the same settings
    (tests/chaos/fan_out.py)."""
    settings = f"""connect_timeout_seconds = 1
read_timeout_seconds = 1
backoff_base_seconds = 0.2
backoff_cap_seconds = 2
max_attempts = {max_attempts}
circuit_minimum_calls = {plan.CIRCUIT_MINIMUM_CALLS}
circuit_window_seconds = {plan.CIRCUIT_WINDOW_SECONDS}
circuit_half_open_calls = {plan.CIRCUIT_HALF_OPEN_CALLS}
circuit_cooldown_seconds = {plan.CIRCUIT_COOLDOWN_SECONDS}
circuit_cooldown_cap_seconds = {plan.CIRCUIT_COOLDOWN_CAP_SECONDS}
"""
    tables = []
    ordered = {plan.ORDERED_EVENT_TYPE: plan.ORDERED_COLLECTION}
    for event_type, collection in {**plan.COLLECTIONS, **ordered}.items():
        lanes = (
            'order_by = "/contact/id"\nversions = "supersede"\n' if event_type in ordered else ""
        )
        if lanes and shared_lanes:
            lanes += f'sources = ["{plan.SOURCE}"]\n'
        tables.append(
            f"""
[[routes]]
match = "{event_type}"
name = "crm-{collection}"
action = "http"
url = "{crm_url}/{collection}"
external_ref_pointer = "/id"
reconcile_url = "{crm_url}/{collection}/by-key/{{key}}"
{settings}{lanes}"""
        )
    tables.append(fan_out.routes_toml(crm_url, settings))
    path.write_text("".join(tables), encoding="utf-8")
    return path


class Chaos:
    """Runs the fault schedule against the fleet and the servers from its own thread, and
    supervises the fleet meanwhile: a process that ends although nobody killed it is
    recorded as an incident and replaced, as compose's restart policy would.

    Faults run in the plan's order, each when its time has come, except the end of a spell
    (route_up, route_steady): that waits until `plan.spell_over` says the spell, counted from
    when it really began, lasted its length and met enough writes; the faults after it go on
    meanwhile."""

    def __init__(
        self,
        faults: list[plan.Fault],
        fleet: Fleet,
        crm: FakeCrm,
        route_outage: plan.RouteOutage,
        partial: plan.PartialFailure,
        broker: OwnBroker,
        postgres: OwnPostgres,
        sender: Sender,
        rng: random.Random,
        concurrency: int,
        pg_down_seconds: float,
    ) -> None:
        self.faults = faults
        self.fleet = fleet
        self.crm = crm
        self.route_outage = route_outage
        self.partial = partial
        self.broker = broker
        self.postgres = postgres
        self.sender = sender
        self.rng = rng
        self.concurrency = concurrency
        self.pg_down_seconds = pg_down_seconds
        self.log: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()
        self.outage: tuple[float, float] | None = None
        self.errors: list[str] = []
        self.supervisor = Supervisor(fleet, sender.now, concurrency, self.errors)
        self.incidents = self.supervisor.incidents
        # Each spell's ending fault: the fault that begins it, its planned length, and how many
        # of the gateway's writes must meet it (see `plan.spell_over`).
        self.spell_ends = {
            "route_up": ("route_down", route_outage.seconds, plan.OUTAGE_MIN_WRITES),
            "route_steady": ("route_flaky", partial.seconds, plan.PARTIAL_MIN_WRITES),
        }
        # When each kind of fault last began, seconds into the send phase.
        self.began: dict[str, float] = {}
        self.faults_done = threading.Event()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    def _run(self) -> None:
        pending = list(self.faults)
        while not self.stop.is_set():
            due = next((fault for fault in pending if self._due(fault)), None)
            if not pending:
                self.faults_done.set()
            elif due is not None:
                pending.remove(due)
                self._do(due)
                continue
            self.supervisor.supervise()
            self.stop.wait(0.25)

    def _due(self, fault: plan.Fault) -> bool:
        now = self.sender.now()
        spell = self.spell_ends.get(fault.kind)
        if spell is None:
            return now >= fault.at
        start, seconds, min_writes = spell
        began = self.began.get(start)  # None: the spell has not begun
        writes = self.crm.spell_writes()[start]
        return began is not None and plan.spell_over(began, seconds, writes, min_writes, now)

    def window(self, start: str, end: str, planned: tuple[float, float]) -> tuple[float, float]:
        """When the spell from fault `start` to fault `end` really began and ended (the
        planned times for a fault that was never due)."""
        return self.began.get(start, planned[0]), self.began.get(end, planned[1])

    def _do(self, fault: plan.Fault) -> None:
        started = self.sender.now()
        self.began[fault.kind] = started
        try:
            detail = getattr(self, fault.kind)()
        except Exception as error:  # a fault that could not be done is reported, not hidden
            self.errors.append(f"{fault.kind} at {started:.1f} s: {error!r}")
            traceback.print_exc()
            return
        self.counts[fault.kind] += 1
        entry = {
            "at": round(started, 2),
            "kind": fault.kind,
            "took": round(self.sender.now() - started, 2),
            **detail,
        }
        self.log.append(entry)
        say(f"fault  {entry}")

    def kill_worker(self) -> dict[str, Any]:
        victim = self.rng.choice(self.fleet.alive("worker"))
        pids = self.fleet.kill(victim)
        new = self.fleet.start_worker(self.concurrency)
        return {"killed": victim.name, "pids": pids, "started": new.name}

    def kill_relay(self) -> dict[str, Any]:
        victim = self.rng.choice(self.fleet.alive("relay"))
        pids = self.fleet.kill(victim)
        new = self.fleet.start_relay()
        return {"killed": victim.name, "pids": pids, "started": new.name}

    def restart_broker(self) -> dict[str, Any]:
        self.broker.restart(pause=1.0)
        return {"port": self.broker.port}

    def restart_postgres(self) -> dict[str, Any]:
        down = self.sender.now()
        self.postgres.stop_fast()
        stopped = self.sender.now()
        time.sleep(self.pg_down_seconds)
        self.postgres.start_again()
        up = self.sender.now()
        self.outage = (down, up)
        return {"down_at": round(down, 2), "stopped_at": round(stopped, 2), "up_at": round(up, 2)}

    def route_down(self) -> dict[str, Any]:
        # Two windows back: what the breaker's sliding window can still weigh.
        self.crm.take_down(self.route_outage.collection, 2 * plan.CIRCUIT_WINDOW_SECONDS)
        return {"collection": self.route_outage.collection}

    def route_up(self) -> dict[str, Any]:
        self.crm.take_down(None)
        return {"collection": self.route_outage.collection}

    def route_flaky(self) -> dict[str, Any]:
        self.crm.make_flaky(self.partial.collection, self.partial.share)
        return {"collection": self.partial.collection, "share": self.partial.share}

    def route_steady(self) -> dict[str, Any]:
        self.crm.make_flaky(None)
        return {"collection": self.partial.collection}


def _fmt(counter: dict[str, int] | Counter[str]) -> str:
    items = sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    return ", ".join(f"{k} {v}" for k, v in items) or "none"


def _quiescence(report: dict[str, Any]) -> str:
    bound = f"the {report['quiesce_timeout']:.0f} s bound"
    if report["quiescence_seconds"] is None:
        return f"never ({bound} and the extra observation both passed)"
    verdict = "within" if report["quiescent_within_bound"] else "NOT within"
    return f"{report['quiescence_seconds']} s after the last request ({verdict} {bound})"


def _incidents(incidents: list[dict[str, Any]]) -> str:
    if not incidents:
        return "none"
    return "; ".join(
        f"{i['process']} {i['what']} (noticed at {i['noticed_at']:.0f} s,"
        f" replaced by {i['replaced_by']}): {i['last_error'] or 'no error logged'}"
        for i in incidents
    )


def table(report: dict[str, Any]) -> str:
    s, a, g, c, f, k, o, p, q, fo = (
        report["sent"],
        report["answers"],
        report["gateway"],
        report["crm"],
        report["faults"],
        report["claims"],
        report["route_outage"],
        report["partial_failure"],
        report["ordered"],
        report["fan_out"],
    )
    rows = [
        *traffic_rows(report),
        (
            "duplicates blocked",
            f"{a['receiver_duplicates']} repeats answered by the receiver,"
            f" {g['blocked_deliveries']} redundant deliveries refused by the workers' claim",
        ),
        (
            "conflicts",
            f"{a['conflicts_refused']} refused with 422"
            f" (of {s['by_kind'].get('conflict', 0)} sent)",
        ),
        (
            "database outage",
            f"{f['pg_down_seconds']} s down; answers meanwhile:"
            f" {_fmt(a['answers_during_outage'])}; max latency"
            f" {a['max_latency_during_outage_seconds']} s (overall {a['max_latency_seconds']} s)",
        ),
        (
            "deliveries",
            f"{g['outbox_rows']} outbox rows (messages) for {s['events']} events;"
            f" {g['blocked_deliveries']} deliveries refused by the claim",
        ),
        *attempt_rows(g),
        (
            "reconciled",
            f"{g['reconciled'].get('found', 0)} found,"
            f" {g['reconciled'].get('not_found', 0)} not found",
        ),
        ("dead letters", _fmt(g["dead_letters_by_kind"])),
        (
            "side effects",
            f"{c['effects_total']} at the CRM (both paths) for {c['keys_with_effect']} keys"
            f" ({c['keys_with_more_than_one']} keys with more than one); {c['writes']} writes,"
            f" {c['lookups']} lookups",
        ),
        ("final states", _fmt(g["statuses"]) + " (both paths)"),
        (
            "claims",
            f"{k['events']} events handled by workflows, {k['deliveries']} deliveries;"
            f" {k['claimed']} claims granted ({k['claimed_reclaimed']} reclaimed,"
            f" {k['claimed_uncertain']} uncertain), {k['abandoned']} runs abandoned",
        ),
        ("claims runs", _fmt(k["runs"])),
        (
            "claims ended",
            f"completed via {_fmt(k['completed_via'])}; failures declared"
            f" {_fmt(k['declared_failures'])}; final states {_fmt(k['statuses'])}",
        ),
        (
            "claims effects",
            f"{k['effects_total']} at the CRM ({k['keys_with_more_than_one']} keys with more"
            f" than one); {k['gateway_requests_for_claims_keys']} CRM requests for claims keys"
            " from the gateway's worker",
        ),
        (
            "ordered",
            f"{q['route']}: {q['events']} updates of {q['contacts']} contacts, ended"
            f" {_fmt(q['statuses'])} ({q['superseded_with_effect']} superseded after their"
            f" write landed); {q['applied_writes']} versions applied at the CRM;"
            f" {a['repeats_answered_superseded']} repeats answered 200 superseded",
        ),
        (
            "fan-out",
            f"{fo['route']}: {fo['events']} events to {len(fo['destinations'])} destinations,"
            f" ended {_fmt(fo['events_by_status'])}; {fo['deliveries']} deliveries ended"
            f" {_fmt(fo['deliveries_by_status'])}; {fo['effects_total']} effects"
            f" ({fo['keys_with_more_than_one']} delivery keys with more than one),"
            f" {fo['reconciled']} reconciled, {fo['dead_letters']} dead letters;"
            f" {fo['views_read']} events read back; {fo['orphan_deliveries']} orphan deliveries",
        ),
        (
            "faults",
            f"{f['kill_worker']} worker kills, {f['kill_relay']} relay kills,"
            f" {f['restart_broker']} {report['broker']} restarts,"
            f" {f['restart_postgres']} PostgreSQL restarts;"
            f" CRM injected: {_fmt(c['injected'])}",
        ),
        (
            "route outage",
            f"{o['route']} down {o['seconds']} s ({o['start']}-{o['end']} s):"
            f" {o['writes_refused']} writes reached it"
            f" (bound {o['bound']}); circuit opened {o['circuit_opened']}, closed"
            f" {o['circuit_closed']} times, {o['trials']} trials; ends {o['final_circuit']}",
        ),
        (
            "partial failure",
            f"{p['route']} refused {p['share']:.0%} of writes for {p['seconds']} s"
            f" ({p['start']}-{p['end']} s): {p['writes_refused']} of {p['writes']} writes"
            f" refused; circuit opened {p['circuit_opened']}, closed {p['circuit_closed']}"
            f" times; ends {p['final_circuit']}",
        ),
        *closing_rows(report),
    ]
    head = (
        f"idem chaos soak: seed {report['seed']}, {report['broker']}, {report['duration']:g} s,"
        f" {report['events']} events,"
        f" {report['workers']} workers x {report['concurrency']}, {report['started_at']}"
    )
    return render(head, rows)


def traffic_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """What was sent and how intake answered, in both single-host soaks' tables."""
    sent, statuses = report["sent"], report["answers"]["answers_by_status"]
    two_xx = sum(n for code, n in statuses.items() if code.startswith("2"))
    return [
        (
            "sent",
            f"{sent['events']} events, {sent['deliveries']} deliveries"
            f" ({_fmt(sent['by_kind'])}), {sent['requests']} requests",
        ),
        ("delivered", f"{two_xx} answered 2xx; answers: {_fmt(statuses)}"),
    ]


def machine_and_sent(
    timeline: Timeline, events: int, posted: list[plan.Delivery], sender: Sender
) -> dict[str, Any]:
    """The machine's load and what the clients sent, in both soaks' reports."""
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "max_load1": round(timeline.max_load, 2),
            "load1_at_end": round(os.getloadavg()[0], 2),
        },
        "sent": {
            "events": events,
            "deliveries": len(posted),
            "by_kind": dict(Counter(d.kind for d in posted)),
            "requests": len(sender.answers),
        },
    }


def attempt_rows(gateway: dict[str, Any]) -> list[tuple[str, str]]:
    """Retries, attempts and reclaimed leases, in both soaks' tables."""
    sweeper = gateway["sweeper"]
    return [
        ("retries by code", _fmt(gateway["retries_by_code"])),
        ("attempts", _fmt(gateway["attempts_by_outcome"])),
        (
            "leases reclaimed",
            f"{gateway['leases_reclaimed']} (sweeper re-drove"
            f" {sweeper.get('leases_reclaimed', 0)} expired leases and"
            f" {sweeper.get('redriven', 0)} lost messages)",
        ),
    ]


def crm_facts(crm_state: dict[str, Any]) -> dict[str, Any]:
    """What the CRM saw, in both soaks' reports: effects, keys with more than one, requests."""
    effects = crm_state["effects"]
    return {
        "effects_total": sum(effects.values()),
        "keys_with_effect": len(effects),
        "keys_with_more_than_one": sum(1 for n in effects.values() if n > 1),
        "writes": sum(crm_state["posts"].values()),
        "lookups": sum(crm_state["lookups"].values()),
        "injected": crm_state["injected"],
    }


def closing_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The table's last rows, in both soaks: incidents, quiescence, machine, violations."""
    total = report["violations"]["total"]
    return [
        ("incidents", _incidents(report["incidents"])),
        ("quiescence", _quiescence(report)),
        (
            "machine",
            f"{report['machine']['cpus']} CPUs, load average up to"
            f" {report['machine']['max_load1']} during the run",
        ),
        (
            "violations",
            f"{total}" + (f" ({_fmt(report['violations']['by_check'])})" if total else ""),
        ),
    ]


def render(head: str, rows: list[tuple[str, str]]) -> str:
    width = max(len(name) for name, _ in rows)
    return "\n".join([head, *(f"  {name:<{width}}  {value}" for name, value in rows)])


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    t_start = time.monotonic()
    # Outside pytest's tree and the project.
    base = Path(tempfile.mkdtemp(prefix="idem-chaos-"))
    log_dir = base / "logs"
    metrics_root = base / "metrics"
    log_dir.mkdir()
    metrics_root.mkdir()
    say(f"chaos: seed {seed}, {args.duration} s, {args.events} events, work dir {base}")

    crm = FakeCrm(seed)
    postgres = OwnPostgres(base / "pg")
    broker: OwnBroker = (
        OwnRabbit(base / "rabbitmq") if args.broker == "rabbitmq" else OwnRedis(base / "redis")
    )
    fleet: Fleet | None = None
    sender: Sender | None = None
    workflows: Workflows | None = None
    chaos: Chaos | None = None
    keep_logs = args.keep_logs
    report: dict[str, Any] = {}
    try:
        crm.start()
        database_url = postgres.start()
        broker_url = broker.start()
        upgrade(database_url)
        routes = write_routes(base / "routes.toml", crm.url, args.max_attempts)
        env = gateway_env(database_url, broker_url, args.broker, routes, args.sweep_grace)
        claims_token = env["CLAIMS_TOKEN"]
        fleet = Fleet(env, log_dir, metrics_root)
        fleet.start_receiver()
        for _ in range(2):
            fleet.start_relay()
        for _ in range(args.workers):
            fleet.start_worker(args.concurrency)
        fleet.start_sweeper()

        events, deliveries = plan.plan_events(seed, args.events, args.duration, args.claims_share)
        faults = plan.plan_faults(seed, args.duration)
        route_outage = plan.plan_route_outage(seed, args.duration)
        partial = plan.plan_partial_failure(seed, args.duration)
        receiver_url = f"http://127.0.0.1:{fleet.receiver_port}"
        posted = [d for d in deliveries if d.event.via == plan.VIA_EVENTS]
        claimed = [d for d in deliveries if d.event.via == plan.VIA_CLAIMS]
        sender = Sender(receiver_url, posted)
        workflows = Workflows(receiver_url, crm, claimed, claims_token, seed)
        chaos = Chaos(
            faults,
            fleet,
            crm,
            route_outage,
            partial,
            broker,
            postgres,
            sender,
            random.Random(f"victims:{seed}"),
            args.concurrency,
            args.pg_down_seconds,
        )
        say(
            f"chaos: {len(posted)} event deliveries, {len(claimed)} claims deliveries,"
            f" faults: {[(round(f.at), f.kind) for f in faults]}"
        )
        sender.start()
        workflows.start(t0=sender.t0)
        chaos.thread.start()

        timeline = Timeline(database_url, sender, workflows)
        # Once the faults are over the supervisor keeps watching until the checks have their
        # data.
        settled = until_settled(args, sender, workflows, crm, timeline, chaos.faults_done)
        sender.stop()
        workflows.stop()
        crm_state = crm.snapshot()
        db = check.read_db(database_url)
        views = fan_out_check.read_views(
            receiver_url, claims_token, [e.key for e in events if e.fanned_out]
        )
        chaos.stop.set()
        chaos.thread.join(timeout=120)
        fleet.stop_all()
        counters = check.worker_counters(fleet.metrics_dirs())
        sweeps = check.sweeper_totals(sorted(log_dir.glob("sweeper-*.log")))

        violations, facts = verify_traffic(
            events,
            sender,
            workflows,
            crm_state,
            db,
            views,
            settled,
            args.quiesce_timeout,
            outage=chaos.outage,
        )
        if args.strict_processes:
            for incident in chaos.incidents:
                violations.add(
                    "process_lost",
                    f"{incident['process']} {incident['what']}: {incident['last_error']}",
                )
        for error in chaos.errors:
            violations.add("fault_failed", error)
        # The spells as they really were: either may have begun late and lasted longer.
        start, end = chaos.window("route_down", "route_up", (route_outage.start, route_outage.end))
        route_outage = dataclasses.replace(route_outage, start=start, end=end)
        start, end = chaos.window("route_flaky", "route_steady", (partial.start, partial.end))
        partial = dataclasses.replace(partial, start=start, end=end)
        outage_facts = check.verify_route_outage(
            route_outage,
            crm_state,
            check.route_events(sorted(log_dir.glob("worker-*.log"))),
            db,
            in_flight=args.workers * args.concurrency,
            # A worker killed while the route was down may take a trial with it.
            kills=sum(
                1
                for entry in chaos.log
                if entry["kind"] == "kill_worker"
                and route_outage.start <= entry["at"] <= route_outage.end
            ),
            violations=violations,
        )
        partial_facts = check.verify_partial_failure(
            partial,
            crm_state,
            check.route_events(sorted(log_dir.glob("worker-*.log"))),
            db,
            violations,
        )
        kinds = (
            "kill_worker",
            "kill_relay",
            "restart_broker",
            "restart_postgres",
            "route_down",
            "route_flaky",
        )
        for kind in kinds:
            if not chaos.counts[kind]:
                violations.add("fault_missing", f"no {kind} happened")

        report = {
            "ok": violations.total == 0,
            "seed": seed,
            "broker": args.broker,
            "duration": args.duration,
            "events": args.events,
            "workers": args.workers,
            "concurrency": args.concurrency,
            "started_at": started_at,
            "elapsed_seconds": round(time.monotonic() - t_start, 1),
            **settled_facts(settled, args.quiesce_timeout),
            **machine_and_sent(timeline, len(events) - facts["claims"]["events"], posted, sender),
            **facts,
            "behaviours": dict(Counter(e.behaviour.kind for e in events)),
            "crm": crm_facts(crm_state),
            "gateway": gateway_facts(db, counters, sweeps),
            "faults": {
                "kill_worker": chaos.counts["kill_worker"],
                "kill_relay": chaos.counts["kill_relay"],
                "restart_broker": chaos.counts["restart_broker"],
                "restart_postgres": chaos.counts["restart_postgres"],
                "pg_down_seconds": round(chaos.outage[1] - chaos.outage[0], 1)
                if chaos.outage
                else 0,
                "log": chaos.log,
            },
            "route_outage": outage_facts,
            "partial_failure": partial_facts,
            "incidents": chaos.incidents,
            "timeline": timeline.samples,
            "violations": violations.as_dict(),
        }
        keep_logs = keep_logs or violations.total > 0 or bool(chaos.incidents)
    except BaseException as error:
        report = failed_report(seed, started_at, error)
        keep_logs = True
    finally:
        if sender is not None:
            sender.stop()
        if workflows is not None:
            workflows.stop()
        if chaos is not None:
            chaos.stop.set()
        if fleet is not None:
            fleet.stop_all()
        for stop in (broker.stop, postgres.cleanup, crm.stop):
            stop()
        leave(base, Path(args.report), f"chaos-logs-{seed}", report, keep_logs)
    return publish(report, Path(args.report), table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.soak", description=__doc__)
    parser.add_argument("--duration", type=float, default=300, help="seconds of traffic and faults")
    parser.add_argument("--events", type=int, default=5000, help="distinct events to send")
    parser.add_argument("--workers", type=int, default=3, help="worker processes (at least 2)")
    add_soak_options(parser, DEFAULT_REPORT)
    parser.add_argument(
        "--broker",
        choices=("redis", "rabbitmq"),
        default="redis",
        help="the broker of the soak's own: a Redis restarted empty, or a RabbitMQ node",
    )
    parser.add_argument("--pg-down-seconds", type=float, default=5.0)
    parser.add_argument(
        "--strict-processes",
        action="store_true",
        help="count a process that exits by itself as a violation (default: an incident,"
        " reported and replaced like a supervisor would)",
    )
    args = parser.parse_args(argv)
    if args.workers < 2:
        parser.error("--workers must be at least 2")

    stop_on_signals(signal.SIGTERM)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
