"""Evidence for proposed product changes, measured without changing the product's code.

`python -m bench.experiments ingest`: the receiver as shipped beside variants, new events and
repeats of 1 000 known keys, interleaved runs at 16 and 64 connections:
  autocommit  the receiver engine in AUTOCOMMIT: RESERVE_KEY (one statement, atomic by itself)
              is sent alone, without the BEGIN and COMMIT round trips around it
  upsert      autocommit, and a repeat answered by the same one statement (UPSERT_RESERVE_KEY:
              ON CONFLICT DO UPDATE counts the repeat and returns the key's state)
  pool64      DB_POOL_SIZE=64 (no pool overflow connections opened and closed under load)
  warnings    LOG_LEVEL=WARNING (no log line per accepted event)
`python -m bench.experiments e2e`: end-to-end bursts (64 connections, 5 s), the pipeline as
shipped beside variants (E2E_VARIANTS):
  db-trips    receiver in AUTOCOMMIT; worker engine in AUTOCOMMIT and without pool_pre_ping
              (CLAIM_KEY and FINISH_SUCCEEDED sent alone: 2 round trips a task instead of 8)
  no-events   worker without Celery task events (no PUBLISH per task state)
  lean        both

The variants run as `python -m bench.experiments serve|worker --variant NAME`, which patch the
engine factories (or Celery's arguments) in the process before the product's code starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from typing import Any

from bench.config import FULL
from bench.context import Bench, interleaved
from bench.infra import DEFAULT_ADMIN_URL, NOOP_ROUTES, Databases, Processes, RedisServer
from bench.infra import scratch_dir as scratch
from bench.ingest import create_known_keys
from bench.load import Spec, generate
from bench.pipeline import idem_times, throughput, wait_idem_drained
from bench.report import median


def _autocommit_receiver() -> None:
    import outbox.receiver
    from outbox.db import create_receiver_engine

    def engine(settings: Any) -> Any:
        return create_receiver_engine(settings).execution_options(isolation_level="AUTOCOMMIT")

    setattr(outbox.receiver, "create_receiver_engine", engine)  # noqa: B010


UPSERT_RESERVE_KEY = """
    -- RESERVE_KEY and RECORD_DUPLICATE in one statement: a new key inserts the key, the event
    -- and the outbox row; a known key with the same payload hash counts the repeat and returns
    -- its state; a known key with another payload returns no row.
    WITH reserved AS (
        INSERT INTO idempotency_keys (
            idempotency_key, payload_hash, correlation_id, source, event_type, route,
            workflow_name, execution_id, expires_at
        )
        VALUES (
            :key, :payload_hash, :correlation_id, :source, :event_type, :route,
            :workflow_name, :execution_id, now() + make_interval(secs => :ttl_seconds)
        )
        ON CONFLICT (idempotency_key) DO UPDATE
           SET duplicate_count = idempotency_keys.duplicate_count + 1
         WHERE idempotency_keys.payload_hash = EXCLUDED.payload_hash
        RETURNING idempotency_key, status, correlation_id, created_at, result, external_ref,
                  error_code, attempts, (xmax = 0) AS inserted
    ), stored AS (
        INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload)
        SELECT idempotency_key, :source, :event_type, :external_id, :version,
               CAST(:payload AS jsonb)
          FROM reserved WHERE inserted
    ), queued AS (
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT idempotency_key, :task_name, correlation_id FROM reserved WHERE inserted
    )
    SELECT * FROM reserved
"""


def _upsert_intake() -> None:
    """intake.accept with UPSERT_RESERVE_KEY: one statement for a new key and for a repeat."""
    import json

    from sqlalchemy import text

    from outbox import intake, queries

    statement = text(UPSERT_RESERVE_KEY)
    shipped = intake.accept

    async def accept(engine: Any, event: Any) -> Any:
        if event.contract_violations:
            return await shipped(engine, event)
        params = {
            "key": event.key,
            "payload_hash": event.payload_hash,
            "correlation_id": event.correlation_id,
            "source": event.source,
            "event_type": event.event_type,
            "external_id": event.external_id,
            "version": event.version,
            "payload": json.dumps(event.payload, ensure_ascii=False, allow_nan=False),
            "route": event.route,
            "ttl_seconds": event.ttl_seconds,
            "workflow_name": event.workflow_name,
            "execution_id": event.execution_id,
            "task_name": intake.PROCESS_TASK,
        }
        for _ in range(2):
            async with engine.begin() as conn:
                row = (await conn.execute(statement, params)).mappings().first()
                if row is not None and row["inserted"]:
                    return intake.Accepted(
                        event.key, row["correlation_id"], row["created_at"], row["status"]
                    )
                if row is not None:
                    return intake.Repeated(
                        key=event.key,
                        status=row["status"],
                        correlation_id=row["correlation_id"],
                        result=row["result"],
                        external_ref=row["external_ref"],
                        error_code=row["error_code"],
                        attempts=row["attempts"],
                    )
                exists = (await conn.execute(queries.KEY_EXISTS, {"key": event.key})).first()
                if exists is not None:
                    return intake.PayloadConflict(event.key)
        raise RuntimeError("key vanished twice while being accepted")

    setattr(intake, "accept", accept)  # noqa: B010


def _worker_engine_autocommit_no_ping() -> None:
    import sqlalchemy

    import worker.app
    from outbox.db import _connect_args

    def engine(settings: Any, *, pool_size: int = 2) -> Any:
        return sqlalchemy.create_engine(
            settings.sqlalchemy_url(),
            pool_size=pool_size,
            max_overflow=2,
            pool_timeout=30,
            pool_pre_ping=False,
            pool_recycle=3600,
            isolation_level="AUTOCOMMIT",
            connect_args=_connect_args(settings, statement_timeout=False),
        )

    setattr(worker.app, "create_sync_engine", engine)  # noqa: B010


def _worker_without_task_events() -> None:
    from celery import Celery

    original = Celery.worker_main

    def worker_main(self: Any, argv: list[str]) -> Any:
        self.conf.worker_send_task_events = False
        self.conf.task_send_sent_event = False
        return original(self, [a for a in argv if a != "--task-events"])

    Celery.worker_main = worker_main


# End-to-end variants: (receiver in autocommit, worker engine autocommit without pre-ping,
# worker without task events).
E2E_VARIANTS = {
    "shipped": (False, False, False),
    "db-trips": (True, True, False),
    "no-events": (False, False, True),
    "lean": (True, True, True),
}


def serve(variant: str, port: int) -> None:
    if variant in ("autocommit", "upsert") or E2E_VARIANTS.get(variant, (False,))[0]:
        _autocommit_receiver()
    if variant == "upsert":
        _upsert_intake()
    from outbox.cli import app

    sys.argv = ["idem", "serve", "--port", str(port)]
    app()


def run_worker(variant: str, concurrency: int) -> None:
    _, lean_engine, no_events = E2E_VARIANTS[variant]
    if lean_engine:
        _worker_engine_autocommit_no_ping()
    if no_events:
        _worker_without_task_events()
    from worker.__main__ import main

    main(["--concurrency", str(concurrency)])


def _spawn_receiver(procs: Processes, name: str, variant: str) -> str:
    from outbox.embedded import free_port

    if variant == "shipped":
        return procs.start_receiver(name)
    port = procs.ports[name] = free_port()
    args = ["-m", "bench.experiments", "serve", "--variant", variant, "--port", str(port)]
    procs.spawn(name, args)
    procs._waits[name] = lambda: procs._wait_port(name)
    return procs.url(name)


INGEST_VARIANTS: dict[str, dict[str, str]] = {
    "shipped": {},
    "autocommit": {},
    "upsert": {},
    "pool64": {"DB_POOL_SIZE": "64"},
    "warnings": {"LOG_LEVEL": "WARNING"},
}


def ingest(bench: Bench, names: list[str]) -> None:
    # Mind max_connections: every idle receiver keeps DB_POOL_SIZE connections open.
    variants = {name: INGEST_VARIANTS[name] for name in ["shipped", *names] if name}
    known = 1000
    url = bench.dbs.create("exp_ingest")
    stacks = {name: bench.processes(url, f"exp-{name}", **env) for name, env in variants.items()}
    try:
        urls = {
            name: _spawn_receiver(
                procs, name, name if name in ("autocommit", "upsert") else "shipped"
            )
            for name, procs in stacks.items()
        }
        for procs in stacks.values():
            procs.ready()
        create_known_keys(bench, urls["shipped"], url, known)
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
                shipped = series[f"shipped/{mode}"].summary()["rate"]
                for name in urls:
                    summary = series[f"{name}/{mode}"].summary()
                    bench.console.print(
                        f"{concurrency:3d} connections  {mode:10s} {name:10s} "
                        f"{summary['rate']:7.0f}/s ({summary['rate'] / shipped:4.0%})  "
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
    urls = {name: bench.dbs.create(f"exp_e2e_{name.replace('-', '_')}") for name in variants}
    stacks: dict[str, Processes] = {}
    receivers: dict[str, str] = {}
    try:
        for number, name in enumerate(urls, start=2):
            procs = bench.processes(urls[name], f"exp-e2e-{name}")
            # A Redis database of each pipeline's own: the two workers never share a queue.
            procs.redis_url = bench.redis.url.rsplit("/", 1)[0] + f"/{number}"
            stacks[name] = procs
            receivers[name] = _spawn_receiver(procs, "receiver", name)
            procs.start_relay()
            if name != "shipped":
                procs.spawn(
                    "worker",
                    ["-m", "bench.experiments", "worker", "--variant", name],
                    {**procs.env(), "WORKER_METRICS_PORT": "0"},
                )
                procs._waits["worker"] = partial(procs._wait_pool, "worker", 2)
            else:
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
    parser.add_argument("what", choices=["ingest", "e2e", "serve", "worker"])
    parser.add_argument("--variant", default="shipped")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="",
        help="which variants to compare with the shipped code (default: all; see above)",
    )
    args = parser.parse_args(argv)
    if args.what == "serve":
        serve(args.variant, args.port)
        return 0
    if args.what == "worker":
        run_worker(args.variant, args.concurrency)
        return 0
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
                    e2e(bench, list(dict.fromkeys(["shipped", *chosen])))
                bench.console.print(f"{time.monotonic() - started:.0f} s")
            finally:
                redis_server.stop()
    finally:
        dbs.drop_all()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
