"""Section 12, scale: the sizing model of docs/how-to/scaling-out.md, checked on this machine.

The model: every event costs a fixed CPU time in each kind of process (receiver, relay, worker)
and in PostgreSQL, whatever the number of processes, because nothing the processes share costs
more when there are more of them (each step is one statement on one row; one relay publishes
while the others stand by, workers split keys with the claim). Then events/s ≈ the CPU the
machine gives the pipeline / the CPU per event, and each kind of process needs
`rate x its CPU per event` cores.

Checked by running the same closed-loop bursts through one receiver, relay and worker, then
through two receivers, two relays and three workers (on one database and one Redis; the load
split over the receivers): per shape, events/s end to end, CPU per event by kind of process, the
share of the machine's CPU the pipeline used, and the database connections each kind held.
Target: the larger shape's CPU per event within `SAME_COST` of the smaller one's.
"""

from __future__ import annotations

import os
import time
from typing import Any

from bench.context import Bench
from bench.infra import WorkerShape, sql
from bench.load import Spec, generate_many
from bench.pipeline import CpuMeter, burst_summary, idem_times, wait_idem_drained
from bench.report import Check, median

# (receivers, relays, workers)
SHAPES = ((1, 1, 1), (2, 2, 3))
KINDS = ("receiver", "relay", "worker")
# How far the larger shape's CPU per event may be from the smaller one's.
SAME_COST = 0.15
CONNECTIONS = (
    "SELECT application_name, count(*) FROM pg_stat_activity"
    " WHERE datname = current_database() AND application_name LIKE 'idem%'"
    " GROUP BY application_name"
)


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    shapes = {_label(shape): _shape(bench, shape) for shape in SHAPES}
    small, large = (shapes[_label(shape)] for shape in SHAPES)
    ratio = large["cpu_ms_per_event"]["total"] / small["cpu_ms_per_event"]["total"]
    summary: dict[str, Any] = {"shapes": shapes, "cpu_per_event_ratio": ratio}
    checks = [
        Check(
            "12 scale",
            f"CPU per event, {_label(SHAPES[1])} against {_label(SHAPES[0])} "
            f"({large['events_per_s']:.0f} and {small['events_per_s']:.0f} events/s)",
            large["cpu_ms_per_event"]["total"],
            "ms",
            _label(SHAPES[0]),
            small["cpu_ms_per_event"]["total"],
            f"within {SAME_COST:.0%} (got {ratio - 1:+.0%})",
            abs(ratio - 1) <= SAME_COST,
        )
    ]
    return summary, checks


def _label(shape: tuple[int, int, int]) -> str:
    receivers, relays, workers = shape
    return f"{receivers} receivers, {relays} relays, {workers} workers"


def _shape(bench: Bench, shape: tuple[int, int, int]) -> dict[str, Any]:
    receivers, relays, workers = shape
    url = bench.dbs.create(f"scale{receivers}{relays}{workers}")
    procs = bench.processes(url, f"scale-{receivers}-{relays}-{workers}")
    try:
        urls = [procs.start_receiver(f"receiver-{n}") for n in range(receivers)]
        for n in range(relays):
            procs.start_relay(f"relay-{n}")
        pool, concurrency = WorkerShape().resolved()
        for n in range(workers):
            procs.start_worker(f"worker-{n}", concurrency=concurrency, pool=pool)
        procs.ready()
        names = [name for name in procs.processes if name.split("-")[0] in KINDS]
        cpu = CpuMeter({name: procs.pid(name) for name in names}, bench.redis.process.pid, url)
        for receiver in urls:
            bench.warm(receiver)
        wait_idem_drained(url, 300)
        bench.dbs.analyze(url)
        runs = []
        bench.say(f"scale: {_label(shape)}")
        for number in range(bench.profile.e2e_runs):
            source = f"scale-{number}"
            before = cpu.read()
            started = time.monotonic()
            results = generate_many(
                [
                    Spec(
                        url=receiver,
                        concurrency=64 // receivers,
                        duration=bench.profile.e2e_burst_seconds,
                        source=source,
                    )
                    for receiver in urls
                ]
            )
            accepted = sum(result.ok for result in results)
            wait_idem_drained(url, 600)
            elapsed = time.monotonic() - started
            times = idem_times(url, source)
            burst = burst_summary(
                accepted, times, elapsed, sum(result.errors for result in results)
            )
            spent = cpu.per_event_ms(before, accepted)
            burst["cpu_ms_per_event"] = _by_kind(spent)
            # The share of the machine's CPU (cores x the burst's span) the pipeline used.
            burst["machine_share"] = (
                spent["total"] * accepted / 1000 / (burst["seconds"] * (os.cpu_count() or 1))
            )
            runs.append(burst)
            procs.check_alive()
        connections = {str(name): int(count) for name, count in sql(url, CONNECTIONS)}
    finally:
        procs.stop_all()
        bench.dbs.drop(url)
    return {
        "events_per_s": median([r["events_per_s"] for r in runs]),
        "cpu_ms_per_event": {
            key: median([r["cpu_ms_per_event"][key] for r in runs])
            for key in runs[0]["cpu_ms_per_event"]
        },
        "machine_share": median([r["machine_share"] for r in runs]),
        "connections": connections,
        "runs": runs,
    }


def _by_kind(spent: dict[str, float]) -> dict[str, float]:
    """Per-process figures summed by kind (receiver-0 + receiver-1 → receiver)."""
    kinds: dict[str, float] = {}
    for name, value in spent.items():
        kind = name.split("-")[0] if name.split("-")[0] in KINDS else name
        kinds[kind] = kinds.get(kind, 0.0) + value
    return kinds
