"""10. Fan-out: the same events/s offered to a route that acts itself (one delivery per event)
and to a route that fans out to three `[[destinations]]` (three deliveries per event, each a key
of its own), beside each other in one pipeline.

One receiver + relay + worker (default pool and concurrency, no sweeper) on a database of its
own; the routes file holds both routes for each downstream: `noop` actions, then (the full run)
`http` actions against the fake downstream answering after 100 ms (`bench/downstream.py`).
Per downstream: first each route's maximum (closed-loop bursts at 64 connections, as section
3: the single route's for a fixed time, the fan-out route's with a third as many events, so
as many deliveries), then open-loop runs at **half** the single route's maximum, the two
routes alternating (order rotating by round). Half load is where the figure tells the two
cost models apart: if each delivery cost a full pipeline pass, three deliveries per event at
half the single route's maximum would need 1.5 times what the pipeline can do, and the
fan-out would top out at 2 x the single route's deliveries/s; a delivery that costs only its
relay, worker and database steps leaves room for all three (up to 3 x).

Per run: events/s and deliveries/s from the first accept to the last delivery finished
(database clock; a fan-out event finishes with its last delivery), p50/p99 of accept ->
delivery succeeded, CPU per delivery and per event by component; every delivery must succeed.
The ratio is the median of the rounds' paired ratios of deliveries/s (fan-out / single). The
CPU per delivery to compare is the maximum's: at half load the processes' idle work (the
relay's polls, the worker's heartbeats) is spread over the run's deliveries, three times as
many with fan-out.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from bench.context import Bench
from bench.load import Spec, generate, percentile
from bench.pipeline import (
    CpuMeter,
    Pipeline,
    idem_times,
    latencies_ms,
    start_pipeline,
    wait_idem_drained,
)
from bench.report import Check, median

DESTINATIONS = ("d1", "d2", "d3")
TARGET = 2.5
CONCURRENCY = 64
# A run's backlog drains within this (the fan-out run's, if it falls behind, included).
PATIENCE = 600
# The two routes of each downstream, `bench.<downstream>.<kind>`.
KINDS = ("single", "fanout")


def _routes(label: str, acting: Callable[[str], str]) -> str:
    """The two routes of one downstream: `bench.<label>.single` acts itself, and
    `bench.<label>.fanout` fans out to three destinations acting the same way."""
    names = ", ".join(f'"{label}-{d}"' for d in DESTINATIONS)
    single = f'match = "bench.{label}.single"\nname = "{label}-single"\n{acting("single")}'
    fanned = f'match = "bench.{label}.fanout"\nname = "{label}-fanout"\nfan_out = [{names}]\n'
    tables = [f"\n[[routes]]\n{single}", f"\n[[routes]]\n{fanned}"]
    tables += [f'\n[[destinations]]\nname = "{label}-{d}"\n{acting(d)}' for d in DESTINATIONS]
    return "".join(tables)


def routes_file(downstream_url: str | None) -> str:
    """Both routes acting with `noop`; with a downstream, both again acting with `http` on it
    (a path per route and destination; the downstream answers any)."""
    noop = _routes("noop", lambda _: 'action = "noop"\n')
    if downstream_url is None:
        return noop

    def http(name: str) -> str:
        return f'action = "http"\nurl = "{downstream_url}/{name}"\nread_timeout_seconds = 10\n'

    return noop + _routes("http", http)


def label_of(delay: float) -> str:
    return "noop" if delay == 0 else "http"


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    profile = bench.profile
    delays = profile.fanout_delays
    url = bench.dbs.create("fanout")
    routes = bench.work / "fanout-routes.toml"
    procs = bench.processes(url, "fanout", routes_file=routes)
    result: dict[str, Any] = {"destinations": len(DESTINATIONS)}
    checks: list[Check] = []
    try:
        downstream = None
        if any(delays):
            downstream = procs.start_downstream(max(delays))
        routes.write_text(routes_file(downstream), encoding="utf-8")
        pipeline = start_pipeline(bench, procs, url)
        result.update(pool=pipeline.pool, concurrency=pipeline.concurrency)
        for delay in delays:
            label = label_of(delay)
            rounds = profile.e2e_runs if delay == 0 else profile.slow_runs
            found = _one_downstream(bench, pipeline, url, label, rounds)
            found["downstream_delay_s"] = delay
            result[label] = found
            checks.append(_check(found, label, delay))
            procs.check_alive()
    finally:
        procs.stop_all()
        bench.dbs.drop(url)
    return result, checks


def _one_downstream(
    bench: Bench, pipeline: Pipeline, url: str, label: str, rounds: int
) -> dict[str, Any]:
    profile = bench.profile
    receiver, cpu = pipeline.receiver, pipeline.cpu
    types = {kind: f"bench.{label}.{kind}" for kind in KINDS}
    # Warm both routes end to end (not measured); a short one, a fan-out burst triples.
    for event_type in types.values():
        bench.warm(receiver, event_type=event_type, limit=300)
    wait_idem_drained(url, PATIENCE)
    bench.dbs.analyze(url)

    bench.say(f"fan-out ({label}): each route's maximum, closed-loop bursts")
    maxima: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for round_number in range(rounds):
        single = Spec(
            url=receiver,
            concurrency=CONCURRENCY,
            duration=profile.e2e_burst_seconds,
            source=f"fanout-{label}-max-single-{round_number}",
            event_type=types["single"],
        )
        maxima["single"].append(_measured(url, single, cpu, 1))
        # As many deliveries as the single burst made, in a third of the events.
        events = max(1, maxima["single"][-1]["events"] // len(DESTINATIONS))
        fanned = replace(
            single,
            duration=3600,
            limit=events,
            source=f"fanout-{label}-max-fanout-{round_number}",
            event_type=types["fanout"],
        )
        maxima["fanout"].append(_measured(url, fanned, cpu, len(DESTINATIONS)))
    maximum = median([m["events_per_s"] for m in maxima["single"]])
    rate = maximum / 2
    bench.say(
        f"fan-out ({label}): {rate:.0f} events/s offered to each route (half of {maximum:.0f})"
    )

    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    for round_number in range(rounds):
        shift = round_number % len(KINDS)
        for kind in KINDS[shift:] + KINDS[:shift]:
            source = f"fanout-{label}-{kind}-{round_number}"
            spec = Spec(
                url=receiver,
                concurrency=CONCURRENCY,
                rate=rate,
                duration=profile.e2e_latency_seconds,
                source=source,
                event_type=types[kind],
            )
            per_event = len(DESTINATIONS) if kind == "fanout" else 1
            runs[kind].append(_measured(url, spec, cpu, per_event))

    found: dict[str, Any] = {
        "single_maximum_events_per_s": maximum,
        "offered_events_per_s": rate,
        "deliveries_ratio": _ratio(runs),
        "maximum_deliveries_ratio": _ratio(maxima),
    }
    for kind in KINDS:
        found[kind] = {**_summary(runs[kind]), "maximum": _summary(maxima[kind])}
    return found


def _summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians of one route's runs, and the runs."""
    cpu_runs = [r["cpu_ms_per_delivery"] for r in records]
    return {
        "events_per_s": median([r["events_per_s"] for r in records]),
        "deliveries_per_s": median([r["deliveries_per_s"] for r in records]),
        "cpu_ms_per_delivery": {k: median([c[k] for c in cpu_runs]) for k in cpu_runs[0]},
        "p50_ms": median([r["p50_ms"] for r in records]),
        "p99_ms": median([r["p99_ms"] for r in records]),
        "runs": records,
    }


def _ratio(runs: dict[str, list[dict[str, Any]]]) -> float:
    """The median of the rounds' ratios of deliveries/s, fan-out over single."""
    return median(
        [
            f["deliveries_per_s"] / s["deliveries_per_s"]
            for f, s in zip(runs["fanout"], runs["single"], strict=True)
            if s["deliveries_per_s"] > 0
        ]
    )


def _measured(url: str, spec: Spec, cpu: CpuMeter, per_event: int) -> dict[str, Any]:
    """One run (open loop at `spec.rate`, else closed), waited for until every delivery
    finished: its figures."""
    before = cpu.read()
    offered = generate(spec)
    started = time.monotonic()
    wait_idem_drained(url, PATIENCE)
    drained = time.monotonic() - started
    # A delivery's key is created with its event (one statement), so its created_at is the
    # event's accept; a single route's key is its own delivery.
    times = idem_times(url, spec.source)
    if len(times) != offered.ok * per_event:
        raise RuntimeError(
            f"fan-out: {offered.ok} events accepted, {len(times)} of"
            f" {offered.ok * per_event} deliveries succeeded"
        )
    span = max(done for _, done in times) - min(accepted for accepted, _ in times)
    values = latencies_ms(times)
    per_delivery = cpu.per_event_ms(before, len(times))
    return {
        "events": offered.ok,
        "deliveries": len(times),
        "errors": offered.errors,
        "answered_per_s": offered.rate,
        "events_per_s": offered.ok / span if span > 0 else 0.0,
        "deliveries_per_s": len(times) / span if span > 0 else 0.0,
        "seconds": span,
        "drain_after_load_s": drained,
        "p50_ms": percentile(values, 0.50),
        "p99_ms": percentile(values, 0.99),
        "cpu_ms_per_delivery": per_delivery,
        "cpu_ms_per_event": {k: v * per_event for k, v in per_delivery.items()},
    }


def _check(found: dict[str, Any], label: str, delay: float) -> Check:
    single, fanned = found["single"], found["fanout"]
    top_single, top_fanned = single["maximum"], fanned["maximum"]
    ratio = found["deliveries_ratio"]
    downstream = "noop" if delay == 0 else f"{delay * 1000:.0f} ms downstream"
    return Check(
        "10 fan-out",
        f"deliveries/s, {len(DESTINATIONS)} destinations, {downstream}, at "
        f"{found['offered_events_per_s']:.0f} events/s offered (events/s "
        f"{fanned['events_per_s']:.0f} vs {single['events_per_s']:.0f}; p99 "
        f"{fanned['p99_ms']:.0f} vs {single['p99_ms']:.0f} ms). Maximum: "
        f"{top_fanned['deliveries_per_s']:.0f} vs {top_single['deliveries_per_s']:.0f} "
        f"deliveries/s, CPU {top_fanned['cpu_ms_per_delivery']['total']:.1f} vs "
        f"{top_single['cpu_ms_per_delivery']['total']:.1f} ms/delivery",
        fanned["deliveries_per_s"],
        "/s",
        "one destination",
        single["deliveries_per_s"],
        f">= {TARGET:g}x one destination (got {ratio:.2f}x)",
        ratio >= TARGET,
    )
