"""6. Memory: resident set size of the receiver, the relay and the worker (main process plus its
pool processes) after each of three equal batches of events through the whole pipeline (noop).

Each batch is offered at about the pipeline's measured maximum (open loop) and waited for
until every key has succeeded; VmRSS is then read from /proc/<pid>/status. What matters is the
growth between the second and the third checkpoint, when caches and pools have filled.
"""

from __future__ import annotations

import time
from typing import Any

from bench.context import Bench
from bench.load import Spec, generate
from bench.pipeline import wait_idem_drained
from bench.procfs import tree_rss_kib, vm_rss_kib
from bench.report import Check

# Growth between checkpoints 2 and 3 counted as significant: more than this share of the
# process's size at checkpoint 2, and more than FLOOR_MIB (allocator noise).
GROWTH_SHARE = 0.05
FLOOR_MIB = 4.0


def run(bench: Bench, step: int, rate: float) -> tuple[dict[str, Any], list[Check]]:
    url = bench.dbs.create("memory")
    procs = bench.processes(url, "memory")
    checkpoints: list[dict[str, Any]] = []
    try:
        receiver = procs.start_receiver()
        procs.start_relay()
        procs.start_worker(concurrency=2)
        procs.ready()
        pids = {name: procs.pid(name) for name in ("receiver", "relay", "worker")}

        def sample(events: int, seconds: float) -> dict[str, Any]:
            return {
                "events": events,
                "seconds": seconds,
                "receiver_mib": vm_rss_kib(pids["receiver"]) / 1024,
                "relay_mib": vm_rss_kib(pids["relay"]) / 1024,
                "worker_mib": tree_rss_kib(pids["worker"]) / 1024,
            }

        checkpoints.append(sample(0, 0.0))
        for number in range(1, 4):
            bench.say(f"memory: batch {number}/3, {step:,} events at about {rate:.0f}/s")
            started = time.monotonic()
            # Open loop at about the pipeline's pace; closed loop when that pace is unknown.
            spec = Spec(
                url=receiver,
                concurrency=64 if rate > 0 else 16,
                rate=rate,
                duration=step / rate if rate > 0 else 24 * 3600,
                limit=step,
                source=f"mem-{number}",
            )
            result = generate(spec, timeout=step / max(rate, 20) * 4 + 120)
            if result.ok != step or result.errors:
                raise RuntimeError(f"memory: {result.ok} of {step} accepted, {result.statuses}")
            wait_idem_drained(url, step / 20 + 300)
            procs.check_alive()
            checkpoints.append(sample(number * step, time.monotonic() - started))
    finally:
        procs.stop_all()
        bench.dbs.drop(url)

    checks: list[Check] = []
    growth: dict[str, Any] = {}
    second, third = checkpoints[2], checkpoints[3]
    for name in ("receiver", "relay", "worker"):
        before, after = second[f"{name}_mib"], third[f"{name}_mib"]
        grew = after - before
        limit = max(FLOOR_MIB, GROWTH_SHARE * before)
        growth[name] = {
            "mib": grew,
            "bytes_per_event": grew * 1024 * 1024 / step,
            "limit_mib": limit,
        }
        checks.append(
            Check(
                "6 memory",
                f"{name} RSS growth, events {2 * step:,} -> {3 * step:,} (RSS {after:.0f} MiB)",
                grew,
                "MiB",
                f"RSS at {2 * step:,}:",
                before,
                f"<= {limit:.1f} MiB (max {FLOOR_MIB:.0f} MiB, {GROWTH_SHARE:.0%})",
                grew <= limit,
            )
        )
    return {"step": step, "rate": rate, "checkpoints": checkpoints, "growth": growth}, checks
