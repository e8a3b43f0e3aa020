"""10. Peers: the pipelines a user would build instead of the gateway, given its job in the same
run: accept a webhook over HTTP, dedupe it by key, act once, with a noop action and with a fake
downstream answering after 100 ms.

- idem: receiver + relay + worker (the worker's default pool and concurrency, no sweeper), the
  route a noop or an `http` action to the downstream.
- naive: plain Celery (bench/naive.py): endpoint calling `send_task`, a worker of the same pool
  and concurrency; no dedupe.
- procrastinate (bench/peer_procrastinate.py): the key as `queueing_lock` and `lock`.
- pgqueuer (bench/peer_pgqueuer.py): the key as `dedupe_key`.

Each peer has a database of its own; procrastinate's and pgqueuer's workers run as many jobs at
once as the gateway's worker (one process). Per round, every design gets a closed-loop run of
a fixed number of new events at 64 connections (the order rotating by round); events/s from the
first accept to the last action (idem: the database clock; the others: the task's own
`time.time()`), and CPU per event by process, PostgreSQL backends and Redis. Then open-loop runs
at half each design's rate for p50/p99 of accept -> acted. With the downstream, one key is
posted, acted on, and posted again: the actions the downstream counted for it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import httpx

from bench.context import Bench
from bench.infra import Processes, WorkerShape, wait_until
from bench.load import EVENT, Spec, generate, percentile
from bench.naive import NAIVE_DB
from bench.peer_apps import times_key
from bench.peer_report import GUARANTEES
from bench.pipeline import CpuMeter, idem_times, latencies_ms, throughput, wait_idem_drained
from bench.report import Check, median
from bench.slow import HTTP_ROUTES

PEERS = {"procrastinate": "bench.peer_procrastinate", "pgqueuer": "bench.peer_pgqueuer"}
DESIGNS = ("idem", "naive", *PEERS)
SECTION = "11 peers"
DELAY = 0.1
REPEAT_WAIT = 6.0


class Design:
    """One pipeline under test: where to post, how to tell its events acted on, its CPU."""

    def __init__(self, name: str, url: str, cpu: CpuMeter, bench: Bench, database: str) -> None:
        self.name = name
        self.url = url
        self.cpu = cpu
        self.database = database
        self.mode = "events" if name == "idem" else "naive"
        self.path = "/v1/events" if name == "idem" else "/events"
        self.redis = bench.redis.client(NAIVE_DB)
        self.runs = 0

    def spec(self, **fields: Any) -> Spec:
        """A request pattern for this design; each run gets a `source` of its own."""
        self.runs += 1
        return Spec(
            url=self.url, mode=self.mode, concurrency=64, source=f"peers-{self.runs}", **fields
        )

    def times(self, spec: Spec, expected: int, timeout: float) -> list[tuple[float, float]]:
        """(accepted, acted) of the run's events, once all `expected` acted."""
        if self.name == "idem":
            wait_idem_drained(self.database, timeout)
            return idem_times(self.database, spec.source)
        key = times_key(self.name)
        wait_until(lambda: int(self.redis.llen(key)) >= expected, timeout, interval=0.1)
        raw: list[bytes] = self.redis.lrange(key, 0, -1)  # type: ignore[assignment]
        return [(float(a), float(b)) for a, b in (item.split() for item in raw)]

    def reset(self) -> None:
        if self.name != "idem":
            self.redis.delete(times_key(self.name))

    def burst(self, events: int, timeout: float) -> dict[str, Any]:
        self.reset()
        before = self.cpu.read()
        spec = self.spec(duration=3600, limit=events)
        load = generate(spec)
        times = self.times(spec, load.ok, timeout)
        if len(times) != load.ok:
            raise RuntimeError(f"{self.name}: {load.ok} accepted but {len(times)} acted on")
        return {
            "events": load.ok,
            "errors": load.errors,
            "events_per_s": throughput(times),
            "cpu_ms_per_event": self.cpu.per_event_ms(before, load.ok),
        }

    def latency(self, rate: float, seconds: float, timeout: float) -> list[float]:
        self.reset()
        spec = self.spec(rate=rate, duration=seconds)
        load = generate(spec)
        return latencies_ms(self.times(spec, load.ok, timeout))

    def post(self, key: str) -> int:
        body = EVENT.format(source="peers-repeat", event_type="bench.noop", external_id=key)
        return httpx.post(self.url + self.path, content=body, timeout=30).status_code


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    pool, concurrency = WorkerShape().resolved()
    profile = bench.profile
    summary: dict[str, Any] = {
        "pool": pool,
        "concurrency": concurrency,
        "not_guaranteed": GUARANTEES,
    }
    checks: list[Check] = []
    for delay, events in ((0.0, profile.peers_events), (DELAY, profile.peers_slow_events)):
        label = "noop" if delay == 0 else f"{round(delay * 1000)}ms"
        found = _one_action(bench, label, delay, events, pool, concurrency)
        summary[label] = found
        checks.append(_check(found, label))
    return summary, checks


def _one_action(
    bench: Bench, label: str, delay: float, events: int, pool: str, concurrency: int
) -> dict[str, Any]:
    profile = bench.profile
    # Waiting alone allows `concurrency / delay` events/s; give every run ample time.
    patience = 120 + (5 * events * delay / concurrency if delay else 0)
    urls = {"idem": bench.dbs.create(f"peers_{label}_idem")}
    urls.update({name: bench.dbs.create_empty(f"peers_{label}_{name}") for name in PEERS})
    routes = bench.work / f"peers-{label}-routes.toml"
    groups: dict[str, Processes] = {}
    try:
        idem = groups["idem"] = bench.processes(urls["idem"], f"peers-{label}", routes_file=routes)
        downstream = idem.start_downstream(delay) + "/tasks" if delay else ""
        routes.write_text(
            HTTP_ROUTES.format(url=downstream) if delay else bench.routes_file.read_text(),
            encoding="utf-8",
        )
        receiver = idem.start_receiver()
        idem.start_relay()
        idem.start_worker(concurrency=concurrency, pool=pool)
        naive = idem.start_naive()
        idem.start_naive_worker(concurrency=concurrency, pool=pool, downstream=downstream)
        endpoints = {"idem": receiver, "naive": naive}
        for name, module in PEERS.items():
            procs = groups[name] = bench.processes(urls[name], f"peers-{label}-{name}")
            endpoints[name] = procs.start_peer(name, module, concurrency, downstream)
        for procs in groups.values():
            procs.ready()
        designs = _designs(bench, groups, endpoints, urls)
        bench.say(
            f"peers, {'noop' if not delay else f'{label} downstream'}: {', '.join(DESIGNS)} "
            f"({pool} x {concurrency}), {events} events a run"
        )
        for design in designs.values():
            design.burst(min(events, 2 * concurrency), patience)  # warm-up, not measured
        bench.dbs.analyze(*urls.values())

        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in DESIGNS}
        for round_number in range(profile.peers_runs):
            shift = round_number % len(DESIGNS)
            for name in DESIGNS[shift:] + DESIGNS[:shift]:
                runs[name].append(designs[name].burst(events, patience))
            _alive(groups)
        found: dict[str, Any] = {"events_per_run": events}
        for name in DESIGNS:
            rate = median([r["events_per_s"] for r in runs[name]])
            values: list[float] = []
            for _ in range(profile.peers_runs):
                values += designs[name].latency(rate / 2, profile.e2e_latency_seconds, patience)
            cpu = [r["cpu_ms_per_event"] for r in runs[name]]
            found[name] = {
                "events_per_s": rate,
                "cpu_ms_per_event": {k: median([c[k] for c in cpu]) for k in cpu[0]},
                "latency_offered_per_s": rate / 2,
                "p50_ms": percentile(values, 0.50),
                "p99_ms": percentile(values, 0.99),
                "runs": runs[name],
            }
        if delay:
            found["repeat_after_action"] = {
                name: _repeat(design, idem.url("downstream"), label)
                for name, design in designs.items()
            }
        _alive(groups)
    finally:
        for procs in groups.values():
            procs.stop_all()
        for url in urls.values():
            bench.dbs.drop(url)
    return found


def _designs(
    bench: Bench, groups: dict[str, Processes], endpoints: dict[str, str], urls: dict[str, str]
) -> dict[str, Design]:
    redis_pid = bench.redis.process.pid
    idem = groups["idem"]
    meters = {
        "idem": CpuMeter(
            {n: idem.pid(n) for n in ("receiver", "relay", "worker")}, redis_pid, urls["idem"]
        ),
        "naive": CpuMeter({n: idem.pid(n) for n in ("naive", "naive-worker")}, redis_pid, None),
    }
    for name in PEERS:
        pids = {"endpoint": groups[name].pid(name), "worker": groups[name].pid(f"{name}-worker")}
        meters[name] = CpuMeter(pids, redis_pid, urls[name])
    return {
        name: Design(name, endpoints[name], meters[name], bench, urls.get(name, ""))
        for name in DESIGNS
    }


def _repeat(design: Design, downstream: str, label: str) -> dict[str, Any]:
    """One key posted, acted on (the design recorded it done), then posted again: the answers
    and the actions the downstream counted for the key. A repeat the design queued (202) gets
    up to REPEAT_WAIT seconds to act (procrastinate's idle worker polls every 5 s)."""

    def count() -> int:
        return int(httpx.get(downstream + "/count", timeout=30).text)

    key = f"repeat-{label}-{design.name}-{time.time_ns()}"
    before = count()
    design.reset()
    first = design.post(key)
    design.times(design.spec(), 1, 60)
    second = design.post(key)
    if second == 202:
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: count() >= before + 2, REPEAT_WAIT, interval=0.1)
    return {"answers": [first, second], "actions": count() - before}


def _alive(groups: dict[str, Processes]) -> None:
    for procs in groups.values():
        procs.check_alive()


def _check(found: dict[str, Any], label: str) -> Check:
    idem = found["idem"]
    fastest = max((n for n in DESIGNS if n != "idem"), key=lambda n: found[n]["events_per_s"])
    what = "noop" if label == "noop" else f"{label} downstream"
    peers = ", ".join(
        f"{n} {found[n]['events_per_s']:.0f}/s {found[n]['cpu_ms_per_event']['total']:.1f} ms"
        for n in DESIGNS
        if n != "idem"
    )
    share = idem["events_per_s"] / max(found[fastest]["events_per_s"], 1e-9)
    return Check(
        SECTION,
        f"events/s, {what} (CPU {idem['cpu_ms_per_event']['total']:.1f} ms/event, p50 "
        f"{idem['p50_ms']:.0f} / p99 {idem['p99_ms']:.0f} ms; {peers})",
        idem["events_per_s"],
        "/s",
        f"fastest peer ({fastest})",
        found[fastest]["events_per_s"],
        f">= the fastest peer (got {share:.0%})",
        idem["events_per_s"] >= found[fastest]["events_per_s"],
    )
