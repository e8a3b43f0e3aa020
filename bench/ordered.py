"""9. Ordered traffic: updates of 1 000 contacts through a route with `order_by = "/contact/id"`
and `versions = "supersede"`, beside the same updates through a route without `order_by`.

One pipeline (receiver + relay + worker with its default pool and concurrency, noop, no
sweeper) on a database of its own, both routes in one routes file, so the two kinds of traffic
meet the same processes. Each event is the next version of a contact picked at random among
1 000 (the contacts are new in every run, so every run starts its lanes afresh); 64 connections
in closed-loop bursts, like section 3. The two kinds alternate, the order rotating by round;
events/s from the first accept to the last finish (database clock), where an ordered event
finishes `succeeded` or `superseded` (a newer version of its contact was applied or waited
first); every accepted event must finish. The ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

from typing import Any

from bench.context import Bench
from bench.infra import scalar
from bench.load import Spec
from bench.pipeline import idem_burst, start_pipeline, wait_idem_drained
from bench.report import Check, median

LANES = 1000
CONCURRENCY = 64
TARGET = 0.80
# Event type -> route: the same updates, ordered per contact or not.
KINDS = {"ordered": "bench.contact.ordered", "unordered": "bench.contact.unordered"}
ROUTES = """
[[routes]]
match = "bench.contact.ordered"
name = "ordered"
action = "noop"
order_by = "/contact/id"
versions = "supersede"

[[routes]]
match = "bench.contact.unordered"
name = "unordered"
action = "noop"
"""
FINISHED = ("succeeded", "superseded")


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    profile = bench.profile
    url = bench.dbs.create("ordered")
    routes = bench.work / "ordered-routes.toml"
    routes.write_text(ROUTES, encoding="utf-8")
    procs = bench.processes(url, "ordered", routes_file=routes)
    bursts: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    try:
        pipeline = start_pipeline(bench, procs, url)
        receiver, pids, cpu = pipeline.receiver, pipeline.pids, pipeline.cpu

        # Warm both routes end to end (not measured).
        for event_type in KINDS.values():
            bench.warm(receiver, mode="lanes", lanes=LANES, event_type=event_type)
        wait_idem_drained(url, 300)
        bench.dbs.analyze(url)

        bench.say(f"ordered traffic: {LANES} lanes, supersede, against the same unordered")
        kinds = list(KINDS)
        for round_number in range(profile.e2e_runs):
            shift = round_number % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                source = f"lanes-{kind}-{round_number}"
                spec = Spec(
                    url=receiver,
                    mode="lanes",
                    lanes=LANES,
                    event_type=KINDS[kind],
                    concurrency=CONCURRENCY,
                    duration=profile.e2e_burst_seconds,
                    source=source,
                    watch_pids=pids,
                )
                summary = idem_burst(url, spec, cpu, FINISHED)
                summary["superseded"] = int(
                    scalar(
                        url,
                        "SELECT count(*) FROM idempotency_keys"
                        " WHERE source = %s AND status = 'superseded'",
                        (source,),
                    )
                )
                bursts[kind].append(summary)
            procs.check_alive()
        lanes_left = int(scalar(url, "SELECT count(*) FROM lanes"))
    finally:
        procs.stop_all()
        bench.dbs.drop(url)

    result: dict[str, Any] = {"lanes": LANES, "concurrency": CONCURRENCY, "lane_rows": lanes_left}
    for kind, runs in bursts.items():
        cpu_runs = [r["cpu_ms_per_event"] for r in runs]
        result[kind] = {
            "events_per_s": median([r["events_per_s"] for r in runs]),
            "cpu_ms_per_event": {k: median([c[k] for c in cpu_runs]) for k in cpu_runs[0]},
            "superseded": sum(r["superseded"] for r in runs),
            "events": sum(r["events"] for r in runs),
            "runs": runs,
        }
    # Each ordered burst ran beside an unordered one: the median of the rounds' ratios.
    share = median(
        [
            o["events_per_s"] / u["events_per_s"]
            for o, u in zip(bursts["ordered"], bursts["unordered"], strict=True)
            if u["events_per_s"] > 0
        ]
    )
    result["ordered_share_of_unordered"] = share
    ordered, unordered = result["ordered"], result["unordered"]
    check = Check(
        "9 ordered traffic",
        f"events/s over {LANES:,} lanes, supersede, accept -> succeeded or superseded "
        f"({ordered['superseded']} of {ordered['events']} superseded; CPU "
        f"{ordered['cpu_ms_per_event']['total']:.1f} vs "
        f"{unordered['cpu_ms_per_event']['total']:.1f} ms/event)",
        ordered["events_per_s"],
        "/s",
        "unordered",
        unordered["events_per_s"],
        f">= {TARGET:.0%} of unordered (got {share:.0%})",
        share >= TARGET,
    )
    return result, [check]
