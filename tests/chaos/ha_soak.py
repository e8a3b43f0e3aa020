"""`python -m tests.chaos.ha_soak`: the chaos soak over a Patroni cluster (`make chaos-ha`).

The multi-host soak's traffic (events, claims, duplicates, lost answers: tests/chaos/net_soak.py)
with PostgreSQL replaced by three Patroni-managed nodes and a three-member etcd
(tests/chaos/ha_cluster.py, ha_etcd.py), each on a host of its own, with a synchronous
standby. Every gateway process connects with libpq's multi-host URL (`host=pg-1,pg-2,pg-3 ...
target_session_attrs=read-write`) and is never restarted by the soak: after each failover it
must find the new primary by itself. The faults (tests/chaos/ha_chaos.py): the primary killed,
partitioned away, switched over, the synchronous standby killed, etcd's leader killed or
partitioned away. The checks are the multi-host soak's (one effect per key, every
acknowledged event present and final, quiescent at the end), plus no gateway process that
exited by itself; the report adds, per fault, the time to the first accepted event and to the
first succeeded key. Exits 1 on any violation, 2 if it could not run.

    python -m tests.chaos.ha_soak [--short] [--seconds 600] [--seed N] [--async-replication]
        [--faults kill_etcd_leader,kill_primary,...] [--no-failsafe]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from outbox.store.embedded import terminate
from outbox.store.migrate import upgrade
from tests.brokers import RabbitNode
from tests.chaos import ha_cluster, ha_rabbit, netns, plan
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.ha_chaos import BROKER_KINDS, HA_KINDS, HaChaos, plan_ha_faults, recovery
from tests.chaos.net_chaos import say
from tests.chaos.net_fleet import NetFleet, start_redis
from tests.chaos.net_report import Run, finish
from tests.chaos.net_soak import LEASE_SECONDS, gateway_env, warm_up
from tests.chaos.settle import Timeline
from tests.chaos.soak import write_routes
from tests.chaos.workflow import Workflows
from tests.support import ROOT

DEFAULT_REPORT = ROOT / ".idem" / "chaos-ha-report.json"
HOSTS = {
    "client": 10,
    "etcd-1": 17,
    "etcd-2": 18,
    "etcd-3": 19,
    "pg-1": 21,
    "pg-2": 22,
    "pg-3": 23,
    "broker": 30,
    "receiver-1": 31,
    "receiver-2": 32,
    "relay": 40,
    "worker-1": 51,
    "worker-2": 52,
}
NODES = ["pg-1", "pg-2", "pg-3"]
ETCD_MEMBERS = ["etcd-1", "etcd-2", "etcd-3"]
# With --rabbitmq: the broker is a three-node RabbitMQ cluster instead of the Redis on "broker".
RABBIT_HOSTS = {"rmq-1": 61, "rmq-2": 62, "rmq-3": 63}
WORKERS = ("worker-1", "worker-2")
EVENTS_PER_SECOND = 5
SHORT_SECONDS = 100.0


def start_gateway(fleet: NetFleet) -> None:
    procs = [fleet.receiver_on("receiver-1"), fleet.receiver_on("receiver-2")]
    procs += [fleet.relay_on("relay"), fleet.sweeper_on("relay")]
    procs += [fleet.worker_on(host) for host in WORKERS]
    fleet.wait_ready(procs)
    fleet.wait_serving(procs)


def soak(args: argparse.Namespace, seed: int, base: Path, net: netns.Network) -> int:
    run = Run(args=args, seed=seed, net=net, log_dir=base / "logs")
    run.log_dir.mkdir()
    metrics_root = base / "metrics"
    metrics_root.mkdir()
    net.log_dir = run.log_dir
    cluster = ha_cluster.Cluster(
        net,
        base / "cluster",
        NODES,
        synchronous=not args.async_replication,
        log_dir=run.log_dir,
        etcd_hosts=ETCD_MEMBERS,
        failsafe=not args.no_failsafe,
    )
    rabbit = None
    if args.rabbitmq:
        rabbit = ha_rabbit.RabbitCluster(net, base / "rabbitmq", list(RABBIT_HOSTS), run.log_dir)
    redis_process = crm = None
    began = time.monotonic()
    try:
        if rabbit is None:
            redis_process, redis_url = start_redis(net, base / "redis")
        with net.entered("client"):
            cluster.start()
            say(f"chaos-ha: Patroni cluster up after {time.monotonic() - began:.1f} s")
            if args.replication_delay > 0:
                # Every link between database nodes slowed: an asynchronous replica trails the
                # primary by at least this much, as across zones.
                for a, b in itertools.combinations(NODES, 2):
                    net.degrade(net.prepare_degrade(a, b, args.replication_delay, 0.0, 0.0, seed))
            if rabbit is not None:
                rabbit.start()
                redis_url = ""
                say(f"chaos-ha: RabbitMQ cluster up after {time.monotonic() - began:.1f} s")
            database_url = run.database_url = cluster.database_url()
            crm = run.crm = FakeCrm(seed, host=net.ip("client")).start()
            upgrade(database_url)
            routes = write_routes(base / "routes.toml", crm.url, args.max_attempts)
            env = gateway_env(net, database_url, redis_url, routes, args)
            if rabbit is not None:
                env["BROKER_URL"] = rabbit.url()
            # Each host's own pools: three nodes' worth of connections is not the limit here.
            fleet = NetFleet(env, run.log_dir, metrics_root, net=net, concurrency=args.concurrency)
            run.fleet = fleet
            start_gateway(fleet)
            say(f"chaos-ha: the gateway is serving after {time.monotonic() - began:.1f} s")
            run.events, deliveries = plan.plan_events(
                seed, args.events, args.seconds, args.claims_share
            )
            faults = plan_ha_faults(
                seed, args.seconds, args.short, broker=rabbit is not None, kinds=args.faults
            )
            receivers = [fleet.url("receiver-1"), fleet.url("receiver-2")]
            run.posted = [d for d in deliveries if d.event.via == plan.VIA_EVENTS]
            run.claimed = [d for d in deliveries if d.event.via == plan.VIA_CLAIMS]
            sender = run.sender = Sender(receivers, run.posted)
            run.claims_token = env["CLAIMS_TOKEN"]
            workflows = run.workflows = Workflows(
                receivers, crm, run.claimed, run.claims_token, seed
            )
            chaos = HaChaos(faults, net, fleet, crm, sender.now, seed, cluster, rabbit)
            chaos.lag_before_kill = args.lag_before_kill
            run.chaos = chaos
            warm_up(receivers, run.claims_token)
            say(f"chaos-ha: {len(run.posted)} event and {len(run.claimed)} claims deliveries")
            say(f"chaos-ha: {len(faults)} faults: {[(f.at, f.kind) for f in faults]}")
            sender.start()
            workflows.start(t0=sender.t0)
            run.t0_wall = time.time() - (time.monotonic() - sender.t0)
            chaos.thread.start()
            run.timeline = Timeline(database_url, sender, workflows)
            while sender.now() < args.seconds or not chaos.done.is_set():
                time.sleep(0.5)
                run.timeline.tick()
                if sender.now() > args.seconds + 180:
                    break
            run.outage = chaos.outage()
            run.outage_planned = any(f.kind == "kill_primary" for f in faults)
            code = finish(run)
            return _report_recovery(run, chaos, cluster, code)
    except BaseException:
        run.keep_logs = True
        raise
    finally:
        run.stop()
        cluster.stop()
        if rabbit is not None:
            rabbit.stop()
        if redis_process is not None:
            terminate([redis_process])
        if crm is not None:
            crm.stop()
        if run.keep_logs and run.log_dir.exists():
            kept = Path(args.report).resolve().parent / f"chaos-ha-logs-{seed}"
            shutil.copytree(run.log_dir, kept, dirs_exist_ok=True)
            say(f"chaos-ha: logs kept in {kept}")


def _report_recovery(run: Run, chaos: HaChaos, cluster: ha_cluster.Cluster, code: int) -> int:
    """Add the failovers' figures to the report; a process that exited by itself (the soak
    restarts none), a fault with no recovery seen, or an etcd member that did not rejoin is a
    violation."""
    assert run.sender is not None
    figures = recovery(chaos.timed_log(), run.sender.answers, run.t0_wall, run.database_url)
    report_path = Path(run.args.report)
    report = json.loads(report_path.read_text())
    report["recovery"] = figures
    report["replication"] = "asynchronous" if run.args.async_replication else "synchronous"
    report["patroni"] = _patroni_dcs_outcomes(run.log_dir, cluster.failsafe)
    problems = [f"{i['process']}: {i['what']}" for i in chaos.incidents]
    problems += [
        f"{row['what']}: no {name.removesuffix('_after').replace('_', ' ')} after it"
        for row in figures["faults"]
        for name in ("first_accepted_after", "first_succeeded_after")
        if row[name] is None
    ]
    try:
        assert cluster.etcd is not None
        cluster.etcd.wait_healthy(30)
    except RuntimeError as error:
        problems.append(f"etcd at the end: {error}")
    report["ha_violations"] = problems
    report["ok"] = report["ok"] and not problems
    report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    for row in figures["faults"]:
        say(
            f"chaos-ha: {row['what']} ({row['node']} -> {row['new_primary']}):"
            f" promoted after {row['promoted_after']} s, first accepted event after"
            f" {row['first_accepted_after']} s, first succeeded key after"
            f" {row['first_succeeded_after']} s, first message published after"
            f" {row['first_published_after']} s; {row['acknowledged_then_lost']} events"
            f" acknowledged before it lost by it; replicas behind by"
            f" {row['replica_lag_bytes']} bytes; {row['answered_503']} answers 503, the"
            f" slowest {row['slowest_answer']} s"
        )
        if "etcd_leader" in row:
            say(
                f"chaos-ha: {row['what']}: etcd led by {row['etcd_leader']} after"
                f" {row['etcd_elected_after']} s; the primary {row['primary_before']}"
                + (
                    " stayed the primary"
                    if row["primary_lost_after"] is None
                    else f" stopped being one after {row['primary_lost_after']} s"
                    f" ({row['primary_seen']})"
                )
            )
    for name in ("first_accepted_after", "first_succeeded_after", "first_published_after"):
        say(f"chaos-ha: {name}: {figures[name]}")
    say(f"chaos-ha: Patroni when etcd did not answer: {report['patroni']}")
    for problem in problems:
        say(f"chaos-ha: violation: {problem}")
    return code if code != 0 else (1 if problems else 0)


def _patroni_dcs_outcomes(log_dir: Path, failsafe: bool) -> dict[str, Any]:
    """How often a primary's Patroni found etcd unreachable (every member failed within
    `retry_timeout`) and what it did: demoted itself (a partitioned primary must: it is
    counted too), or stayed the primary through failsafe mode (every other node answered).
    From the Patroni nodes' logs."""
    demoted = re.compile(r"INFO: demoting self because DCS is not accessible and I was a leader$")
    stayed = re.compile(r"INFO: continue to run as a leader because failsafe mode is enabled")
    counts = {"failsafe_mode": failsafe, "demoted": 0, "stayed_by_failsafe": 0}
    for path in sorted(log_dir.glob("patroni-*.log")):
        lines = path.read_text(errors="replace").splitlines()
        counts["demoted"] += sum(1 for line in lines if demoted.search(line))
        counts["stayed_by_failsafe"] += sum(1 for line in lines if stayed.search(line))
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.ha_soak", description=__doc__)
    parser.add_argument("--short", action="store_true", help="CI's run: two failovers")
    parser.add_argument("--seconds", type=float, default=None, help="default 600 (short: 100)")
    parser.add_argument("--events", type=int, default=None, help=f"default {EVENTS_PER_SECOND}/s")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--report", default=str(DEFAULT_REPORT), help="where the JSON report goes")
    parser.add_argument("--lease-seconds", type=int, default=LEASE_SECONDS)
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    parser.add_argument("--max-attempts", type=int, default=30, help="the routes' attempt budget")
    parser.add_argument("--claims-share", type=float, default=plan.CLAIMS_SHARE)
    parser.add_argument("--sweep-grace", type=float, default=3.0)
    parser.add_argument("--quiesce-timeout", type=float, default=180.0)
    parser.add_argument("--observe-after", type=float, default=120.0)
    parser.add_argument(
        "--async-replication",
        action="store_true",
        help="no synchronous standby (synchronous_mode off): measures what a failover loses",
    )
    parser.add_argument(
        "--replication-delay",
        type=float,
        default=0.0,
        help="seconds added each way on every link between database nodes (with"
        " --async-replication: how far a replica trails, so what a failover loses)",
    )
    parser.add_argument(
        "--lag-before-kill",
        type=float,
        default=0.0,
        help="with --async-replication: seconds each primary is cut from its standbys before"
        " it is killed (what they lack is lost; the checks count it)",
    )
    parser.add_argument(
        "--rabbitmq",
        action="store_true",
        help="the broker is a three-node RabbitMQ cluster (quorum queue), its nodes lost too",
    )
    parser.add_argument(
        "--faults",
        type=lambda text: [kind.strip() for kind in text.split(",") if kind.strip()],
        default=None,
        help="the faults, in this order, spread over 10-80 %% of the run (comma-separated, of: "
        + ", ".join(HA_KINDS)
        + "); default: the short or full run's plan",
    )
    parser.add_argument(
        "--no-failsafe",
        action="store_true",
        help="Patroni's failsafe_mode off: a primary whose etcd requests all time out while"
        " etcd elects a leader demotes itself (docs/explanation/reliability.md)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args(argv)
    unknown = [kind for kind in args.faults or [] if kind not in HA_KINDS]
    if unknown:
        parser.error(f"unknown fault kinds {unknown}; known: {', '.join(HA_KINDS)}")
    if any(kind in BROKER_KINDS for kind in args.faults or []) and not args.rabbitmq:
        parser.error("a broker fault needs --rabbitmq")
    args.seconds = args.seconds or (SHORT_SECONDS if args.short else 600.0)
    args.events = args.events or round(EVENTS_PER_SECOND * args.seconds)

    reason = netns.unavailable() or ha_cluster.unavailable()
    if reason is None and args.rabbitmq and RabbitNode.script() is None:
        reason = "no rabbitmq-server for --rabbitmq (Debian: apt-get install rabbitmq-server)"
    if reason is not None:
        say(f"chaos-ha: cannot run here: {reason}")
        return 2

    def interrupted(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    args.started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    base = Path(tempfile.mkdtemp(prefix="idem-chaos-ha-"))
    net = netns.Network({**HOSTS, **(RABBIT_HOSTS if args.rabbitmq else {})})
    say(f"chaos-ha: seed {seed}, {args.seconds:g} s, {args.events} events, in {net.prefix}-*")
    try:
        net.build()
        return soak(args, seed, base, net)
    except BaseException as error:
        import traceback

        traceback.print_exc()
        say(f"chaos-ha: the soak could not run: {type(error).__name__}: {error}")
        return 2
    finally:
        for problem in net.close():
            say(f"chaos-ha: {problem}")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
