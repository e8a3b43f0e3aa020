"""Settings compared with the defaults, in one run: what a deployment choice costs or buys.

`python -m bench.experiments ingest`: the receiver with default settings beside variants, new
events and repeats of 1 000 known keys, interleaved runs at 16 and 64 connections:
  pool64      DB_POOL_SIZE=64 (every connection a request may wait for, opened and kept)
  warnings    LOG_LEVEL=WARNING (no log line per accepted event)
`python -m bench.experiments e2e`: end-to-end bursts (64 connections, 5 s), the pipeline with
default settings beside variants (E2E_VARIANTS):
  events      WORKER_TASK_EVENTS=true (what watching the workers with Flower costs them)
  warnings    LOG_LEVEL=WARNING everywhere (no log line per event and attempt)

Each variant is the product's own processes started with other environment variables; the
product's code is the same for all. Receivers keep their pools open while idle: mind
PostgreSQL's max_connections when adding variants.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

from bench.config import FULL
from bench.context import Bench, interleaved
from bench.infra import DEFAULT_ADMIN_URL, NOOP_ROUTES, Databases, Processes, RedisServer
from bench.infra import scratch_dir as scratch
from bench.ingest import create_known_keys
from bench.load import Spec, generate
from bench.pipeline import idem_times, throughput, wait_idem_drained
from bench.report import median

INGEST_VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {},
    "pool64": {"DB_POOL_SIZE": "64"},
    "warnings": {"LOG_LEVEL": "WARNING"},
}

E2E_VARIANTS: dict[str, dict[str, str]] = {
    "defaults": {},
    "events": {"WORKER_TASK_EVENTS": "true"},
    "warnings": {"LOG_LEVEL": "WARNING"},
}


def ingest(bench: Bench, names: list[str]) -> None:
    variants = {name: INGEST_VARIANTS[name] for name in ["defaults", *names] if name}
    known = 1000
    url = bench.dbs.create("exp_ingest")
    stacks = {name: bench.processes(url, f"exp-{name}", env) for name, env in variants.items()}
    try:
        urls = {name: procs.start_receiver(name) for name, procs in stacks.items()}
        for procs in stacks.values():
            procs.ready()
        create_known_keys(bench, urls["defaults"], url, known)
        for target in urls.values():
            bench.warm(target)

        pids = {name: procs.pid(name) for name, procs in stacks.items()}

        def spec(name: str, mode: str, concurrency: int) -> Spec:
            if mode == "duplicates":
                return bench.spec(
                    urls[name],
                    mode=mode,
                    concurrency=concurrency,
                    source="dup",
                    known=known,
                    watch_pids=[pids[name]],
                )
            return bench.spec(urls[name], concurrency=concurrency, watch_pids=[pids[name]])

        for concurrency in (16, 64):
            targets = {
                (name, mode): partial(spec, name, mode, concurrency)
                for name in urls
                for mode in ("events", "duplicates")
            }
            series = interleaved(
                {f"{name}/{mode}": factory for (name, mode), factory in targets.items()},
                bench.profile.runs,
            )
            for mode in ("events", "duplicates"):
                default = series[f"defaults/{mode}"].summary()["rate"]
                for name in urls:
                    summary = series[f"{name}/{mode}"].summary()
                    bench.console.print(
                        f"{concurrency:3d} connections  {mode:10s} {name:10s} "
                        f"{summary['rate']:7.0f}/s ({summary['rate'] / default:4.0%})  "
                        f"p50 {summary['p50_ms']:5.0f} ms  p99 {summary['p99_ms']:5.0f} ms  "
                        f"CPU {summary['server_cpu_ms_per_request']:.2f} ms/req  "
                        f"errors {summary['errors']}  runs "
                        + " ".join(f"{r['rate']:.0f}" for r in summary["runs"])
                    )
    finally:
        for procs in stacks.values():
            procs.stop_all()
        bench.dbs.drop(url)


def e2e(bench: Bench, variants: list[str]) -> None:
    urls = {name: bench.dbs.create(f"exp_e2e_{name}") for name in variants}
    stacks: dict[str, Processes] = {}
    receivers: dict[str, str] = {}
    try:
        for number, name in enumerate(urls, start=2):
            procs = bench.processes(urls[name], f"exp-e2e-{name}", E2E_VARIANTS[name])
            # A Redis database of each pipeline's own: the two workers never share a queue.
            procs.redis_url = bench.redis.url.rsplit("/", 1)[0] + f"/{number}"
            stacks[name] = procs
            receivers[name] = procs.start_receiver()
            procs.start_relay()
            procs.start_worker()
        for procs in stacks.values():
            procs.ready()
        for name, target in receivers.items():
            bench.warm(target)
            wait_idem_drained(urls[name], 300)
        rates: dict[str, list[float]] = {name: [] for name in urls}
        names = list(urls)
        for number in range(bench.profile.runs):
            shift = number % len(names)
            for name in names[shift:] + names[:shift]:
                source = f"exp-{number}"
                generate(Spec(url=receivers[name], concurrency=64, duration=5.0, source=source))
                wait_idem_drained(urls[name], 600)
                rates[name].append(throughput(idem_times(urls[name], source)))
        for name, values in rates.items():
            bench.console.print(
                f"end to end  {name:8s} {median(values):6.0f} events/s  runs "
                + " ".join(f"{v:.0f}" for v in values)
            )
    finally:
        for procs in stacks.values():
            procs.stop_all()
        for url in urls.values():
            bench.dbs.drop(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments")
    parser.add_argument("what", choices=["ingest", "e2e"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="",
        help="which variants to compare with the defaults (default: all; see above)",
    )
    args = parser.parse_args(argv)
    from rich.console import Console

    dbs = Databases(DEFAULT_ADMIN_URL)
    try:
        with scratch() as work:
            redis_server = RedisServer.start(work / "redis")
            try:
                routes = work / "routes.toml"
                routes.write_text(NOOP_ROUTES, encoding="utf-8")
                profile = FULL.__class__(**{**FULL.__dict__, "runs": args.runs})
                bench = Bench(profile, dbs, redis_server, work, routes, Console(width=160))
                started = time.monotonic()
                if args.what == "ingest":
                    ingest(
                        bench, args.variants.split(",") if args.variants else list(INGEST_VARIANTS)
                    )
                else:
                    chosen = args.variants.split(",") if args.variants else list(E2E_VARIANTS)
                    e2e(bench, list(dict.fromkeys(["defaults", *chosen])))
                bench.console.print(f"{time.monotonic() - started:.0f} s")
            finally:
                redis_server.stop()
    finally:
        dbs.drop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
