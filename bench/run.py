"""`python -m bench.run [--smoke] [--json PATH]`: every figure in one run on this machine.

Real PostgreSQL (databases of the run's own, dropped at the end) and a redis-server of the
run's own on a free port. Prints the machine's facts and a table of figures, each beside its
ceiling or baseline and its target, and writes the same as JSON. Exits 0 when every measurement
ran, whether or not the targets held (the table says which did); 1 when a measurement failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rich.console import Console

from bench import (
    drain,
    fanout,
    growth,
    ingest,
    memory,
    ordered,
    peers,
    pipeline,
    scale,
    slow,
    webhooks,
)
from bench.config import FULL, SMOKE, Profile
from bench.context import Bench
from bench.infra import (
    DEFAULT_ADMIN_URL,
    NOOP_ROUTES,
    Databases,
    RedisServer,
    WorkerShape,
    scratch_dir,
)
from bench.machine import facts
from bench.peer_report import peers_table
from bench.report import Check, checks_json, print_report, write_json

SECTIONS = (
    "ingest",
    "duplicates",
    "e2e",
    "relay",
    "growth",
    "memory",
    "webhooks",
    "slow",
    "ordered",
    "fanout",
    "peers",
    "scale",
)
DEFAULT_JSON = Path(__file__).resolve().parent / "results" / "latest.json"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__)
    parser.add_argument(
        "--smoke", action="store_true", help="a few hundred events, 1-second runs (~1 minute)"
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write JSON")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated sections to run (ingest and duplicates run together): "
        + ", ".join(SECTIONS),
    )
    parser.add_argument(
        "--memory-step", type=int, default=0, help="events per memory checkpoint (override)"
    )
    parser.add_argument(
        "--admin-url",
        default=os.environ.get("BENCH_DATABASE_ADMIN_URL", DEFAULT_ADMIN_URL),
        help="a PostgreSQL where the run may create and drop databases "
        "(env BENCH_DATABASE_ADMIN_URL)",
    )
    parser.add_argument(
        "--growth-keys",
        type=int,
        default=0,
        help="existing keys of the growth section's large database (override; 10 000 000 for "
        "docs/how-to/scaling-out.md)",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    parser.add_argument(
        "--slow-pool",
        choices=["threads", "prefork"],
        default=None,
        help="the worker pool of the slow-downstream section (default: the worker's)",
    )
    parser.add_argument(
        "--slow-concurrency",
        type=int,
        default=None,
        help="attempts in flight per worker in the slow-downstream section (default: the worker's)",
    )
    return parser.parse_args(argv)


def memory_step(profile: Profile, e2e_rate: float) -> int:
    """Events per memory checkpoint: the profile's, or what the budget allows at the measured
    end-to-end rate (a whole thousand, at least 2 000)."""
    if profile.memory_budget_seconds <= 0 or e2e_rate <= 0:
        return profile.memory_step
    fits = int(e2e_rate * profile.memory_budget_seconds / 3 / 1000) * 1000
    return max(2_000, min(profile.memory_step, fits))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    profile: Profile = SMOKE if args.smoke else FULL
    if args.growth_keys > 0:
        profile = replace(profile, growth_large=args.growth_keys)
    wanted = set(filter(None, args.only.split(","))) or set(SECTIONS)
    unknown = wanted - set(SECTIONS)
    if unknown:
        print(f"unknown sections: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    console = Console()
    if not console.is_terminal:
        # Captured output (make, CI, a test): wide enough for the table on one line a row.
        console = Console(width=160)
    began = time.monotonic()
    document: dict[str, Any] = {"profile": profile.name}
    checks: list[Check] = []
    failed: list[str] = []
    dbs = Databases(args.admin_url)
    try:
        with scratch_dir(keep=args.keep_logs) as work:
            redis_server = RedisServer.start(work / "redis")
            try:
                routes_file = work / "routes.toml"
                routes_file.write_text(NOOP_ROUTES, encoding="utf-8")
                bench = Bench(profile, dbs, redis_server, work, routes_file, console)
                document["machine"] = facts(args.admin_url, redis_server.url)
                console.print(
                    f"[bold]idem bench[/] ({profile.name}); logs in {work}"
                    + ("" if args.keep_logs else " (removed at the end; --keep-logs keeps them)")
                )

                def section(name: str, step: Callable[[], None]) -> None:
                    try:
                        step()
                    except Exception as error:
                        failed.append(name)
                        document.setdefault("failures", {})[name] = repr(error)
                        console.print(f"[red]{name} failed:[/] {error!r}")
                        traceback.print_exc()

                if wanted & {"ingest", "duplicates"}:

                    def do_ingest() -> None:
                        result, duplicates, found = ingest.run(bench)
                        document["ingest"], document["duplicates"] = result, duplicates
                        checks.extend(found)

                    section("ingest", do_ingest)
                e2e_rate = 0.0
                if "e2e" in wanted:

                    def do_e2e() -> None:
                        nonlocal e2e_rate
                        result, found = pipeline.run(bench)
                        document["e2e"] = result
                        e2e_rate = float(result["idem"]["events_per_s"])
                        checks.extend(found)

                    section("e2e", do_e2e)
                if "relay" in wanted:

                    def do_relay() -> None:
                        document["relay"], found = drain.run(bench)
                        checks.extend(found)

                    section("relay", do_relay)
                if "growth" in wanted:

                    def do_growth() -> None:
                        document["growth"], found = growth.run(bench)
                        checks.extend(found)

                    section("growth", do_growth)
                if "memory" in wanted:

                    def do_memory() -> None:
                        step = args.memory_step or memory_step(profile, e2e_rate)
                        document["memory"], found = memory.run(bench, step, e2e_rate)
                        checks.extend(found)

                    section("memory", do_memory)
                if "webhooks" in wanted:

                    def do_webhooks() -> None:
                        document["webhooks"], found = webhooks.run(bench)
                        checks.extend(found)

                    section("webhooks", do_webhooks)
                if "slow" in wanted:

                    def do_slow() -> None:
                        shape = WorkerShape(args.slow_pool, args.slow_concurrency)
                        document["slow"], found = slow.run(bench, shape)
                        checks.extend(found)

                    section("slow", do_slow)
                if "ordered" in wanted:

                    def do_ordered() -> None:
                        document["ordered"], found = ordered.run(bench)
                        checks.extend(found)

                    section("ordered", do_ordered)
                if "fanout" in wanted:

                    def do_fanout() -> None:
                        document["fanout"], found = fanout.run(bench)
                        checks.extend(found)

                    section("fanout", do_fanout)
                if "peers" in wanted:

                    def do_peers() -> None:
                        document["peers"], found = peers.run(bench)
                        checks.extend(found)

                    section("peers", do_peers)
                if "scale" in wanted:

                    def do_scale() -> None:
                        document["scale"], found = scale.run(bench)
                        checks.extend(found)

                    section("scale", do_scale)
            finally:
                redis_server.stop()
    finally:
        dbs.drop_all()

    document["seconds"] = time.monotonic() - began
    if dbs.autovacuum:
        # What the stand-in for the server's autovacuum ran, and when (seconds into the run).
        document["autovacuum_stand_in"] = dbs.autovacuum.done
    document["checks"] = checks_json(checks)
    document["failed_sections"] = failed
    title = (
        f"idem bench ({profile.name}), {document.get('machine', {}).get('date', '')}, "
        f"{document['seconds']:.0f} s"
    )
    print_report(console, document.get("machine", {}), checks, title)
    if document.get("peers"):
        console.print(peers_table(document["peers"]))
    write_json(args.json, document)
    console.print(f"JSON: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
