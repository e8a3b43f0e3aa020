"""`python -m bench.flames [--seconds 25] [--out docs/images]`: a flame graph per process of the
end-to-end pipeline under the end-to-end section's noop load, and of the naive pipeline's
worker beside it, sampled with py-spy (the `profile` extra; `make bench` installs it; py-spy
needs ptrace, which root has).

The gateway as section 3 runs it (receiver, relay, worker with its default pool and
concurrency, noop routes, no sweeper) under closed-loop load at 64 connections: the receiver,
the relay and the worker (with its pool processes, if any) are sampled at once for `--seconds`.
Then the naive pipeline (bench/naive.py, the same pool and concurrency) under the same load:
its worker and its endpoint. Writes `flame-<process>.svg` into `--out` (bench/flame_svg.py)
and the collapsed stacks beside the JSON results, and prints for each process its samples by
role (ROLES: the claim, the action, Celery's consumer loop ...) and where they are
(bench/profile.py's summary), in ms per unit of work done while sampling (requests the
receiver accepted, rows the relay published, events the worker finished), beside the CPU
time per unit /proc counted meanwhile. py-spy counts a thread that runs or waits for a core
(runnable) alike, so on a busy machine its ms per unit exceed the CPU time and waits for a
core land on the frame after a wait (a socket read's return): read the shares on a quiet
machine, and the /proc figure as the CPU.

`--fanout`: every event fans out to three noop destinations (`bench.profile.fan_out_routes`,
section 10's shape), so the relay's and the worker's units are deliveries, three an event; the
naive pipeline is left out (it has no fan-out to compare with).
"""

from __future__ import annotations

import argparse
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

from bench.flame_svg import render
from bench.infra import DEFAULT_ADMIN_URL, WorkerShape, noop_stack, scalar
from bench.load import Spec, generate
from bench.naive import NAIVE_DB, TIMES
from bench.procfs import tree_cpu_seconds
from bench.profile import RESULTS, fan_out_routes, py_spy, summarize

RATE_HZ = 100
# Where each process's samples go by the work they belong to: a sample counts for the first
# role one of whose frames (a substring) is on its stack; the rest is "other".
ROLES: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "receiver": [
        (
            "the statement (SQLAlchemy, psycopg, the round trip)",
            ("create_app.<locals>.database", "sqlalchemy/", "psycopg/"),
        ),
        ("intake around it (validation, key, hashes)", ("accept (outbox/ingest/intake.py",)),
        ("the answer", ("respond (outbox/ingest/answers.py",)),
        ("reading and parsing the body", ("read_body (outbox/", "_parse_envelope (outbox/")),
        ("the rest of the request in our code", ("Receiver.__call__ (outbox/",)),
        ("HTTP server and event loop outside a request", ("uvicorn/", "asyncio/")),
    ],
    "relay": [
        ("publishing to Redis (kombu, redis-py)", ("publish (outbox/relay/publisher.py",)),
        ("claiming due rows (SQL)", ("publish_due_batch (outbox/relay/loop.py",)),
        ("the next due time (SQL)", ("seconds_until_next_due (outbox/",)),
        ("waiting for a notification", ("Listener.wait (outbox/",)),
    ],
    "worker": [
        (
            "attempt: the claim (SQL)",
            ("KeyStore.claim (worker/", "claim_together (worker/", "claim_keys (worker/"),
        ),
        ("attempt: recording the outcome (SQL)", ("_record (worker/attempt.py",)),
        ("attempt: the action (noop) and its thread", ("_act (worker/", "_start (worker/")),
        ("attempt: the rest (logging, metrics, guard)", ("run_attempt (worker/",)),
        ("the lease keeper thread", ("worker/lease.py",)),
        ("Celery in the pool thread, around the task", ("concurrent/futures/thread.py",)),
        ("Celery's consumer loop (messages in, acks)", ("asynloop (celery/",)),
        ("the metrics endpoint's thread (idle polls)", ("serve_forever (socketserver",)),
        ("waiting for attempt slots", ("Slots.take (worker/",)),
        # Last: a kept thread's stack has Spare._serve under whatever work it runs.
        ("kept threads waiting for their next work (worker/spare.py)", ("Spare._serve (worker/",)),
    ],
    "naive-worker": [
        ("the task (INCR, RPUSH)", ("noop (bench/naive.py",)),
        ("Celery in the pool thread, around the task", ("concurrent/futures/thread.py",)),
        ("Celery's consumer loop (messages in, acks)", ("asynloop (celery/",)),
    ],
    "naive": [
        ("send_task (Celery, kombu, redis-py)", ("Celery.send_task (celery/",)),
        ("the rest of the request", ("NaiveEndpoint.__call__ (bench/",)),
        ("HTTP server and event loop outside a request", ("uvicorn/", "asyncio/")),
    ],
}
# What each sampled process did while sampled, counted in the database or Redis.
UNITS = {
    "receiver": "SELECT count(*) FROM events",
    "relay": "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
    "worker": "SELECT count(*) FROM idempotency_keys WHERE status = 'succeeded'",
}


def sample(
    pids: dict[str, int], seconds: float, raw_dir: Path, cpu: dict[str, float]
) -> dict[str, Path]:
    """py-spy on every process at once (raw collapsed stacks, idle threads left out); the CPU
    seconds each process (with its children) used meanwhile, from /proc, into `cpu`."""
    before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    running = {}
    for name, pid in pids.items():
        out = raw_dir / f"flame-{name}.txt"
        command = [py_spy(), "record", "--pid", str(pid), "--duration", str(int(seconds))]
        command += ["--rate", str(RATE_HZ), "--format", "raw", "--output", str(out)]
        command += ["--nonblocking", "--subprocesses"]
        running[name] = (subprocess.Popen(command, stdout=subprocess.DEVNULL), out)
    for name, (process, _) in running.items():
        if process.wait(timeout=seconds + 60) != 0:
            raise RuntimeError(f"py-spy failed on {name}")
    cpu.update({name: tree_cpu_seconds(pid) - before[name] for name, pid in pids.items()})
    return {name: out for name, (_, out) in running.items()}


def roles(raw: Path, name: str, units: int, cpu_seconds: float) -> str:
    """The process's samples by role (ROLES), each share also as CPU ms per unit (the share
    of the CPU time /proc counted)."""
    found: Counter[str] = Counter()
    # Newlines only, as bench.profile.summarize: a frame's text may hold another line break.
    for line in raw.read_text().split("\n"):
        if not line:
            continue
        stack, _, samples = line.rpartition(" ")
        label = next(
            (label for label, marks in ROLES.get(name, []) if any(m in stack for m in marks)),
            "other" if " (" in stack else "no Python frame (native code, GIL hand-over)",
        )
        found[label] += int(samples)
    total = max(sum(found.values()), 1)
    lines = ["-- by role (share of samples; of the /proc CPU, ms per unit) --"]
    for label, count in found.most_common():
        ms = 1000 * cpu_seconds * count / total / max(units, 1)
        lines.append(f"{100 * count / total:5.1f} %  {ms:6.3f} ms  {label}")
    return "\n".join(lines)


def under_load(url: str, mode: str, seconds: float) -> threading.Thread:
    """Closed-loop load at 64 connections for the sampling window and a little either side."""
    spec = Spec(url=url, mode=mode, concurrency=64, duration=seconds + 4)
    thread = threading.Thread(target=generate, args=(spec, seconds * 4 + 120), daemon=True)
    thread.start()
    time.sleep(2)
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flames", description=__doc__)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--admin-url", default=DEFAULT_ADMIN_URL)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fanout", action="store_true", help="events fanned out to three")
    args = parser.parse_args(argv)
    routes = fan_out_routes(3 if args.fanout else 0)
    args.out.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    pool, concurrency = WorkerShape().resolved()
    reports: list[str] = []
    with noop_stack(args.admin_url, "flames", routes) as (procs, redis_server):
        receiver = procs.start_receiver()
        procs.start_relay()
        procs.start_worker(concurrency=concurrency, pool=pool)
        if not args.fanout:
            naive = procs.start_naive()
            procs.start_naive_worker(concurrency=concurrency, pool=pool)
        procs.ready()
        generate(Spec(url=receiver, concurrency=64, duration=3))

        url = procs.database_url
        load = under_load(receiver, "events", args.seconds)
        before = {name: int(scalar(url, sql)) for name, sql in UNITS.items()}
        cpu: dict[str, float] = {}
        raws = sample({n: procs.pid(n) for n in UNITS}, args.seconds, RESULTS, cpu)
        units = {name: int(scalar(url, sql)) - before[name] for name, sql in UNITS.items()}
        load.join()
        if not args.fanout:
            generate(Spec(url=naive, mode="naive", concurrency=64, duration=3))
            redis_naive = redis_server.client(NAIVE_DB)
            load = under_load(naive, "naive", args.seconds)
            naive_before = int(redis_naive.llen(TIMES))
            names = ("naive-worker", "naive")
            raws.update(sample({n: procs.pid(n) for n in names}, args.seconds, RESULTS, cpu))
            units["naive-worker"] = units["naive"] = int(redis_naive.llen(TIMES)) - naive_before
            load.join()
    traffic = "events fanned out to 3 noop destinations" if args.fanout else "noop events"
    for name, raw in raws.items():
        title = (
            f"{name}: {traffic} at 64 connections, worker {pool} x {concurrency}, "
            f"{args.seconds:.0f} s at {RATE_HZ} Hz"
        )
        svg = args.out / f"flame-{name}{'-fanout' if args.fanout else ''}.svg"
        svg.write_text(render(raw.read_text(), title), encoding="utf-8")
        per_unit = 1000 * cpu[name] / max(units[name], 1)
        reports.append(
            f"=== {name}: {units[name]} units in {args.seconds:.0f} s, CPU (/proc) "
            f"{per_unit:.3f} ms per unit; {svg}\n"
            + roles(raw, name, units[name], cpu[name])
            + "\n"
            + summarize(raw, units=units[name], rate_hz=RATE_HZ)
        )
    print("\n\n".join(reports))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
