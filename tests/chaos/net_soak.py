"""`python -m tests.chaos.net_soak`: the chaos soak across hosts (`make chaos-net`).

The gateway runs on a network of its own: network namespaces joined by veth pairs to a bridge
(tests/chaos/netns.py), one host each for PostgreSQL ("db"), Redis ("broker"), two receivers,
the relay (with the sweeper), three workers, and a "client" host where this process sends the
events and the workflows' claims and serves the fake CRM the workers write to. Links are cut
(a silent black hole), degraded (latency, jitter, loss) and healed, a worker host is isolated,
and a worker and the relay are killed, on a schedule drawn from the seed
(tests/chaos/net_plan.py). Then the faults stop, the soak waits for every key to finish, and
checks every event as `make chaos` does, plus that no holder wrote after its lease was taken
over (tests/chaos/net_check.py). It prints a table with each fault and what the gateway did,
writes a JSON report, and exits 1 on any violation (2 if it could not run). Everything it made,
namespaces included, is removed at the end, on SIGTERM, SIGHUP and Ctrl-C too.

    python -m tests.chaos.net_soak [--seconds 600] [--events N] [--seed N] [--report PATH]
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from outbox.store.embedded import terminate
from outbox.store.migrate import upgrade
from tests.chaos import netns, plan
from tests.chaos.client import Sender
from tests.chaos.crm import FakeCrm
from tests.chaos.net_chaos import PREPARE_AHEAD_SECONDS, NetChaos, say
from tests.chaos.net_fleet import NetFleet, start_postgres, start_redis
from tests.chaos.net_plan import plan_net_faults
from tests.chaos.net_report import Run, finish
from tests.chaos.settle import Timeline
from tests.chaos.soak import write_routes
from tests.chaos.workflow import Workflows
from tests.support import ROOT

DEFAULT_REPORT = ROOT / ".idem" / "chaos-net-report.json"
# The lease of the soak's workers: short, so a cut outlives it within seconds; long enough
# that the routes' 1 s timeouts, two of them per attempt, and a loaded machine fit with room.
LEASE_SECONDS = 8
# Events per second of the send phase by default. `make chaos` sends 17 on one host; here the
# faults take a worker or the relay away for 20-25 s at a time, and at 10 a second on a shared
# 2-core machine (load average 12-18) the workers fell behind by 3 600 keys and drained them
# 286 s after the last request, past the 180 s bound.
EVENTS_PER_SECOND = 5


def gateway_env(
    net: netns.Network, database_url: str, redis_url: str, routes: Path, args: argparse.Namespace
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(
        CLAIMS_TOKEN=secrets.token_urlsafe(32),
        # The workers' metrics listen on their hosts' addresses, which asks for a token.
        METRICS_TOKEN=secrets.token_urlsafe(32),
        DATABASE_URL=database_url,
        REDIS_URL=redis_url,
        ROUTES_FILE=str(routes),
        LOG_FORMAT="json",
        LOG_LEVEL="INFO",
        LEASE_SECONDS=str(args.lease_seconds),
        # A workflow's CRM call gives up after 1 s; a write the CRM applies late lands within
        # 2 s, a slowed link adds its delay: no claim before then.
        CLAIMS_IN_FLIGHT_SECONDS="5",
        SWEEP_INTERVAL_SECONDS="0.5",
        SWEEP_GRACE_SECONDS=str(args.sweep_grace),
        RELAY_POLL_SECONDS="0.5",
        # Two receivers share PostgreSQL's 100 connections with everything else.
        DB_POOL_SIZE="10",
        PYTHONPATH=str(ROOT),
    )
    return env


def start_gateway(fleet: NetFleet) -> None:
    """Every process on its host, started together, waited for together."""
    procs = [fleet.receiver_on("receiver-1"), fleet.receiver_on("receiver-2")]
    procs += [fleet.relay_on("relay"), fleet.sweeper_on("relay")]
    procs += [fleet.worker_on(host) for host in ("worker-1", "worker-2", "worker-3")]
    fleet.wait_ready(procs)
    fleet.wait_serving(procs)


def warm_up(receivers: list[str], token: str, rounds: int = 3, at_once: int = 16) -> None:
    """Open each receiver's connection pool (`receivers`: their base URLs) before it takes
    traffic: a receiver's first requests each open a database connection (a password
    exchange, a backend started), and a burst of them on a loaded machine took 10 s. A lookup
    of a key nobody has is the cheapest request that uses the pool and changes nothing."""
    headers = {"Authorization": f"Bearer {token}"}
    urls = [
        f"{receiver}/v1/events/warm-up-{secrets.token_hex(4)}"
        for receiver in receivers
        for _ in range(rounds * at_once)
    ]
    with ThreadPoolExecutor(at_once) as pool:
        list(pool.map(lambda url: httpx.get(url, headers=headers, timeout=30), urls))


def soak(args: argparse.Namespace, seed: int, base: Path, net: netns.Network) -> int:
    """Everything after the network is built: the servers, the gateway, the traffic, the
    faults, the checks (this thread in the client host's namespace, and every thread it
    starts)."""
    run = Run(args=args, seed=seed, net=net, log_dir=base / "logs")
    run.log_dir.mkdir()
    metrics_root = base / "metrics"
    metrics_root.mkdir()
    net.log_dir = run.log_dir
    postgres = redis_process = crm = None
    began = time.monotonic()
    try:
        postgres, database_url = start_postgres(net, base / "pg")
        redis_process, redis_url = start_redis(net, base / "redis")
        say(f"chaos-net: PostgreSQL and Redis up after {time.monotonic() - began:.1f} s")
        with net.entered("client"):
            run.database_url = database_url
            crm = run.crm = FakeCrm(seed, host=net.ip("client")).start()
            upgrade(database_url)
            routes = write_routes(base / "routes.toml", crm.url, args.max_attempts)
            env = gateway_env(net, database_url, redis_url, routes, args)
            fleet = NetFleet(env, run.log_dir, metrics_root, net=net, concurrency=args.concurrency)
            run.fleet = fleet
            start_gateway(fleet)
            say(f"chaos-net: the gateway is serving after {time.monotonic() - began:.1f} s")
            run.events, deliveries = plan.plan_events(
                seed, args.events, args.seconds, args.claims_share
            )
            faults = plan_net_faults(seed, args.seconds, args.lease_seconds)
            receivers = [fleet.url("receiver-1"), fleet.url("receiver-2")]
            run.posted = [d for d in deliveries if d.event.via == plan.VIA_EVENTS]
            run.claimed = [d for d in deliveries if d.event.via == plan.VIA_CLAIMS]
            sender = run.sender = Sender(receivers, run.posted)
            workflows = run.workflows = Workflows(
                receivers, crm, run.claimed, env["CLAIMS_TOKEN"], seed
            )
            run.claims_token = env["CLAIMS_TOKEN"]
            chaos = run.chaos = NetChaos(faults, net, fleet, crm, sender.now, seed)
            chaos.prepare(until=PREPARE_AHEAD_SECONDS)
            warm_up(receivers, run.claims_token)
            say(f"chaos-net: {len(run.posted)} event and {len(run.claimed)} claims deliveries")
            say(f"chaos-net: {len(faults)} faults: {[(f.at, f.what) for f in faults]}")
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
            return finish(run)
    except BaseException:
        run.keep_logs = True
        raise
    finally:
        run.stop()
        if postgres is not None:
            postgres.cleanup()
        if redis_process is not None:
            terminate([redis_process])
        if crm is not None:
            crm.stop()
        if run.keep_logs and run.log_dir.exists():
            kept = Path(args.report).resolve().parent / f"chaos-net-logs-{seed}"
            shutil.copytree(run.log_dir, kept, dirs_exist_ok=True)
            say(f"chaos-net: logs kept in {kept}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.net_soak", description=__doc__)
    parser.add_argument("--seconds", type=float, default=600, help="seconds of traffic and faults")
    parser.add_argument("--events", type=int, default=None, help=f"default {EVENTS_PER_SECOND}/s")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--report", default=str(DEFAULT_REPORT), help="where the JSON report goes")
    parser.add_argument("--lease-seconds", type=int, default=LEASE_SECONDS)
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    parser.add_argument("--max-attempts", type=int, default=30, help="the routes' attempt budget")
    parser.add_argument("--claims-share", type=float, default=plan.CLAIMS_SHARE)
    parser.add_argument("--sweep-grace", type=float, default=3.0)
    parser.add_argument(
        "--quiesce-timeout",
        type=float,
        default=180.0,
        help="seconds after the last request by which every key must be finished (a healed"
        " connection can wait for TCP's next retransmission, up to two minutes, first)",
    )
    parser.add_argument("--observe-after", type=float, default=300.0)
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args(argv)
    args.events = args.events or round(EVENTS_PER_SECOND * args.seconds)

    reason = netns.unavailable()
    if reason is not None:
        say(f"chaos-net: cannot run here: {reason}")
        return 2
    for name in netns.stale_namespaces():
        say(f"chaos-net: {name} was left by a soak that was killed; `ip netns del {name}`")

    def interrupted(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupted)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    started_at = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    base = Path(tempfile.mkdtemp(prefix="idem-chaos-net-"))
    net = netns.Network()
    say(f"chaos-net: seed {seed}, {args.seconds:g} s, {args.events} events, in {net.prefix}-*")
    args.started_at = started_at
    try:
        net.build()
        return soak(args, seed, base, net)
    except BaseException as error:  # the soak itself failed: report it, clean up, exit 2
        import traceback

        traceback.print_exc()
        say(f"chaos-net: the soak could not run: {type(error).__name__}: {error}")
        return 2
    finally:
        for problem in net.close():
            say(f"chaos-net: {problem}")
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
