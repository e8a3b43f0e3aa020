"""3. End to end: receiver + relay + worker (its default pool and concurrency, noop, no
sweeper) beside the naive design (uvicorn endpoint calling send_task, a Celery worker with the
same settings, pool and concurrency).

Maximum: closed-loop bursts at 64 connections; events/s from the first accept to the last
finish (idem: the keys' created_at and updated_at, both from the database clock; naive: accept
and done times from the task's arguments and the task, both time.time() on this machine).
Latency: open-loop runs at half of each design's own maximum; p50/p99 of accept -> finished.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bench.context import Bench
from bench.infra import Processes, WorkerShape, scalar, sql, wait_until
from bench.load import Result, Spec, generate, percentile
from bench.naive import COUNTER, NAIVE_DB, TIMES
from bench.procfs import cpu_seconds, tree_cpu_seconds
from bench.report import Check, median

THROUGHPUT_TARGET = 0.70
P99_LIMIT_MS = 250.0

# Keys not yet finished, through the partial indexes (cheap to poll while the pipeline runs).
UNFINISHED = """
SELECT (SELECT count(*) FROM idempotency_keys WHERE status IN ('pending', 'failed_retryable'))
     + (SELECT count(*) FROM idempotency_keys WHERE status = 'processing')
"""


def wait_idem_drained(url: str, timeout: float) -> None:
    wait_until(lambda: scalar(url, UNFINISHED) == 0, timeout, interval=0.1)


def idem_times(
    url: str, source: str, finished: tuple[str, ...] = ("succeeded",)
) -> list[tuple[float, float]]:
    """(accepted, finished) epoch seconds of one run's keys that ended in one of `finished`,
    both from the database clock."""
    rows = sql(
        url,
        "SELECT extract(epoch FROM created_at)::float8, extract(epoch FROM updated_at)::float8"
        " FROM idempotency_keys WHERE source = %s AND status = ANY(%s)",
        (source, list(finished)),
    )
    return [(float(a), float(b)) for a, b in rows]


class Naive:
    def __init__(self, bench: Bench, procs: Processes, **worker: Any) -> None:
        """The naive endpoint and its worker (`worker`: start_naive_worker's options)."""
        self.client = bench.redis.client(NAIVE_DB)
        self.url = procs.start_naive()
        procs.start_naive_worker(**worker)

    def reset(self) -> None:
        self.client.delete(TIMES, COUNTER)

    def open_loop(
        self, rate: float, duration: float, timeout: float
    ) -> tuple[Result, list[tuple[float, float]]]:
        """Offer `rate` events/s for `duration` s on a fixed schedule; the run and the
        (accepted, done) times of what it offered."""
        self.reset()
        offered = generate(
            Spec(url=self.url, mode="naive", concurrency=64, rate=rate, duration=duration)
        )
        return offered, self.times(offered.ok, timeout)

    def times(self, expected: int, timeout: float) -> list[tuple[float, float]]:
        wait_until(lambda: int(self.client.llen(TIMES)) >= expected, timeout, interval=0.1)
        raw: list[bytes] = self.client.lrange(TIMES, 0, -1)  # type: ignore[assignment]
        return [(float(a), float(b)) for a, b in (item.split() for item in raw)]


class CpuMeter:
    """CPU seconds per component: our processes (with children), the Redis server, and the
    PostgreSQL backends serving the database (backends that ended between two readings are
    missed, so the database's share is a lower bound)."""

    def __init__(self, pids: dict[str, int], redis_pid: int, url: str | None) -> None:
        self.pids = pids
        self.redis_pid = redis_pid
        self.url = url

    def _backends(self) -> dict[int, float]:
        if self.url is None:
            return {}
        rows = sql(
            self.url,
            "SELECT pid FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        return {int(pid): cpu_seconds(int(pid)) for (pid,) in rows}

    def read(self) -> dict[str, Any]:
        reading: dict[str, Any] = {n: tree_cpu_seconds(p) for n, p in self.pids.items()}
        reading["redis"] = cpu_seconds(self.redis_pid)
        reading["backends"] = self._backends()
        return reading

    def per_event_ms(self, before: dict[str, Any], events: int) -> dict[str, float]:
        after = self.read()
        spent = {name: after[name] - before[name] for name in [*self.pids, "redis"]}
        if self.url is not None:
            spent["postgres"] = sum(
                cpu - before["backends"].get(pid, 0.0) for pid, cpu in after["backends"].items()
            )
        spent["total"] = sum(spent.values())
        return {name: 1000 * seconds / max(events, 1) for name, seconds in spent.items()}


@dataclass(frozen=True)
class Pipeline:
    """The gateway's receiver, relay and worker, running: where to send, what to watch."""

    receiver: str
    pids: list[int]
    cpu: CpuMeter
    pool: str
    concurrency: int


def start_pipeline(bench: Bench, procs: Processes, url: str) -> Pipeline:
    """Receiver + relay + worker (its default pool and concurrency, no sweeper) on `url`,
    started and ready, with a CPU meter over the three, Redis and the database's backends."""
    receiver = procs.start_receiver()
    procs.start_relay()
    pool, concurrency = WorkerShape().resolved()
    procs.start_worker(concurrency=concurrency, pool=pool)
    procs.ready()
    names = ("receiver", "relay", "worker")
    cpu = CpuMeter({n: procs.pid(n) for n in names}, bench.redis.process.pid, url)
    return Pipeline(receiver, [procs.pid(n) for n in names], cpu, pool, concurrency)


def idem_burst(
    url: str, spec: Spec, cpu: CpuMeter, finished: tuple[str, ...] = ("succeeded",)
) -> dict[str, Any]:
    """One closed-loop burst through the gateway, waited for until every key of the database
    finished: its summary (every accepted key of the burst must end in one of `finished`) with
    the CPU per event."""
    cpu_before = cpu.read()
    burst = generate(spec)
    started = time.monotonic()
    wait_idem_drained(url, 600)
    drained = time.monotonic() - started
    times = idem_times(url, spec.source, finished)
    summary = burst_summary(burst.ok, times, drained, burst.errors)
    summary["cpu_ms_per_event"] = cpu.per_event_ms(cpu_before, burst.ok)
    return summary


def throughput(times: list[tuple[float, float]]) -> float:
    if not times:
        return 0.0
    span = max(done for _, done in times) - min(accepted for accepted, _ in times)
    return len(times) / span if span > 0 else 0.0


def latencies_ms(times: list[tuple[float, float]]) -> list[float]:
    return [(done - accepted) * 1000 for accepted, done in times]


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    profile = bench.profile
    url = bench.dbs.create("e2e")
    procs = bench.processes(url, "e2e")
    try:
        receiver = procs.start_receiver()
        procs.start_relay()
        # Both designs with the worker's default pool and concurrency.
        pool, concurrency = WorkerShape().resolved()
        procs.start_worker(concurrency=concurrency, pool=pool)
        naive = Naive(bench, procs, concurrency=concurrency, pool=pool)
        procs.ready()
        idem_pids = [procs.pid(n) for n in ("receiver", "relay", "worker")]
        naive_pids = [procs.pid(n) for n in ("naive", "naive-worker")]
        redis_pid = bench.redis.process.pid
        idem_cpu = CpuMeter(
            {n: procs.pid(n) for n in ("receiver", "relay", "worker")}, redis_pid, url
        )
        naive_cpu = CpuMeter({n: procs.pid(n) for n in ("naive", "naive-worker")}, redis_pid, None)

        # Warm both pipelines end to end (not measured).
        bench.warm(receiver)
        naive.reset()
        warm = generate(Spec(url=naive.url, mode="naive", concurrency=64, duration=1.0))
        wait_idem_drained(url, 300)
        naive.times(warm.ok, 300)
        bench.dbs.analyze(url)

        maxima: dict[str, list[dict[str, Any]]] = {"idem": [], "naive": []}
        bench.say("end to end: maximum, closed-loop bursts")
        for run_number in range(profile.e2e_runs):
            spec = Spec(
                url=receiver,
                concurrency=64,
                duration=profile.e2e_burst_seconds,
                source=f"e2e-max-{run_number}",
                watch_pids=idem_pids,
            )
            maxima["idem"].append(idem_burst(url, spec, idem_cpu))

            naive.reset()
            cpu_before = naive_cpu.read()
            burst = generate(
                Spec(
                    url=naive.url,
                    mode="naive",
                    concurrency=64,
                    duration=profile.e2e_burst_seconds,
                    watch_pids=naive_pids,
                )
            )
            started = time.monotonic()
            times = naive.times(burst.ok, 600)
            drained = time.monotonic() - started
            maxima["naive"].append(burst_summary(burst.ok, times, drained, burst.errors))
            maxima["naive"][-1]["cpu_ms_per_event"] = naive_cpu.per_event_ms(cpu_before, burst.ok)
            procs.check_alive()

        best = {
            design: median([r["events_per_s"] for r in runs]) for design, runs in maxima.items()
        }
        bench.say(
            f"end to end: latency at half load (idem {best['idem'] / 2:.0f}/s, "
            f"naive {best['naive'] / 2:.0f}/s)"
        )
        latency: dict[str, list[dict[str, Any]]] = {"idem": [], "naive": []}
        for run_number in range(profile.e2e_runs):
            source = f"e2e-lat-{run_number}"
            cpu_before = idem_cpu.read()
            offered = generate(
                Spec(
                    url=receiver,
                    concurrency=64,
                    rate=best["idem"] / 2,
                    duration=profile.e2e_latency_seconds,
                    source=source,
                )
            )
            wait_idem_drained(url, 600)
            times = idem_times(url, source)
            latency["idem"].append(_latency(best["idem"] / 2, offered.rate, times, offered.errors))
            latency["idem"][-1]["cpu_ms_per_event"] = idem_cpu.per_event_ms(cpu_before, len(times))

            cpu_before = naive_cpu.read()
            offered, times = naive.open_loop(best["naive"] / 2, profile.e2e_latency_seconds, 600)
            latency["naive"].append(
                _latency(best["naive"] / 2, offered.rate, times, offered.errors)
            )
            latency["naive"][-1]["cpu_ms_per_event"] = naive_cpu.per_event_ms(
                cpu_before, len(times)
            )
            procs.check_alive()
    finally:
        procs.stop_all()
        bench.dbs.drop(url)

    summary: dict[str, Any] = {}
    for design in ("idem", "naive"):
        cpu_runs = [r["cpu_ms_per_event"] for r in maxima[design]]
        half_runs = [r["cpu_ms_per_event"] for r in latency[design]]
        summary[design] = {
            "events_per_s": best[design],
            # CPU time per event, by component, during the bursts (medians of the runs).
            "cpu_ms_per_event": {k: median([c[k] for c in cpu_runs]) for k in cpu_runs[0]},
            # The same at half load, from the run's start until its last event finished: a
            # pipeline that keeps up spends it per event, the processes' idle work included.
            "half_load_cpu_ms_per_event": {
                k: median([c[k] for c in half_runs]) for k in half_runs[0]
            },
            "offered_per_s": median([r["offered_per_s"] for r in latency[design]]),
            "p50_ms": median([r["p50_ms"] for r in latency[design]]),
            "p99_ms": median([r["p99_ms"] for r in latency[design]]),
            "maximum_runs": maxima[design],
            "latency_runs": latency[design],
        }
    # Each idem burst ran right before a naive one: the median of the pairs' ratios (see
    # bench.context.paired_ratio).
    share = median(
        [
            i["events_per_s"] / n["events_per_s"]
            for i, n in zip(maxima["idem"], maxima["naive"], strict=True)
            if n["events_per_s"] > 0
        ]
    )
    summary["idem_share_of_naive"] = share
    idem = summary["idem"]
    checks = [
        Check(
            "3 end to end",
            "events/s, accept -> succeeded (CPU "
            f"{idem['cpu_ms_per_event']['total']:.1f} vs "
            f"{summary['naive']['cpu_ms_per_event']['total']:.1f} ms/event)",
            best["idem"],
            "/s",
            "naive",
            best["naive"],
            f">= {THROUGHPUT_TARGET:.0%} of naive (got {share:.0%})",
            share >= THROUGHPUT_TARGET,
        ),
        Check(
            "3 end to end",
            f"p99 accept -> succeeded at {idem['offered_per_s']:.0f}/s "
            f"(p50 {idem['p50_ms']:.0f} ms; CPU {idem['half_load_cpu_ms_per_event']['total']:.1f}"
            f" vs {summary['naive']['half_load_cpu_ms_per_event']['total']:.1f} ms/event)",
            idem["p99_ms"],
            "ms",
            "naive",
            summary["naive"]["p99_ms"],
            f"<= {P99_LIMIT_MS:.0f} ms",
            idem["p99_ms"] <= P99_LIMIT_MS,
        ),
    ]
    return summary, checks


def burst_summary(
    accepted: int, times: list[tuple[float, float]], drained: float, errors: int
) -> dict[str, Any]:
    if len(times) != accepted:
        raise RuntimeError(f"end to end: {accepted} accepted but {len(times)} finished")
    return {
        "events": accepted,
        "errors": errors,
        "events_per_s": throughput(times),
        "seconds": max(d for _, d in times) - min(a for a, _ in times),
        "drain_after_load_s": drained,
    }


def _latency(
    offered: float, answered: float, times: list[tuple[float, float]], errors: int
) -> dict[str, Any]:
    values = latencies_ms(times)
    return {
        "events": len(times),
        "errors": errors,
        "offered_per_s": offered,
        "answered_per_s": answered,
        "p50_ms": percentile(values, 0.50),
        "p99_ms": percentile(values, 0.99),
        "max_ms": max(values, default=0.0),
    }
