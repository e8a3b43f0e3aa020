"""7. Provider webhooks: signed Stripe-style events straight to `POST /v1/webhooks/stripe`.

One receiver (noop routes, plus a `stripe` source) on a database of its own. Each round sends a
fixed number of distinct events, each signed with Stripe's scheme by the load generator, over
32 connections, and the same number of `POST /v1/events` envelopes; the two alternate (the order
rotates by round). After each run the events it stored are counted in the database: every event
must be stored once (as many keys as events sent) and every answer must be a 202.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from bench.context import Bench, interleaved, paired_ratio
from bench.infra import NOOP_ROUTES, Processes, scalar
from bench.load import Result, Spec
from bench.report import Check

CONCURRENCY = 32
SECRET = "whsec_bench_0123456789abcdef-stripe"
STRIPE_SOURCE = f"""
[[sources]]
name = "stripe"
scheme = "stripe"
secret = "{SECRET}"
"""


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    count = bench.profile.webhook_events
    url = bench.dbs.create("webhooks")
    routes = bench.work / "webhooks-routes.toml"
    routes.write_text(NOOP_ROUTES + STRIPE_SOURCE, encoding="utf-8")
    log_dir = bench.work / "webhooks"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = Processes(url, bench.redis.url, log_dir, routes)
    stored: dict[str, list[int]] = {"stripe": [], "events": []}
    rounds = {"stripe": 0, "events": 0}
    try:
        receiver = procs.start_receiver()
        procs.ready()
        pid = procs.pid("receiver")
        bench.warm(receiver)
        bench.warm(receiver, mode="stripe", secret=SECRET)
        bench.dbs.analyze(url)

        def spec(mode: str) -> Spec:
            rounds[mode] += 1
            return bench.spec(
                receiver,
                mode=mode,
                concurrency=CONCURRENCY,
                # The run ends after `count` requests; the duration only bounds a stalled one.
                duration=600,
                warmup=0,
                limit=count,
                source=f"r{rounds[mode]}{mode}",
                secret=SECRET,
                watch_pids=[pid],
            )

        def around(mode: str) -> Any:
            def after(_: Result) -> None:
                tag = f"r{rounds[mode]}{mode}"
                if mode == "stripe":
                    found = scalar(
                        url,
                        "SELECT count(*) FROM events WHERE external_id LIKE %s",
                        (f"evt\\_{tag}\\_%",),
                    )
                else:
                    found = scalar(
                        url, "SELECT count(*) FROM idempotency_keys WHERE source = %s", (tag,)
                    )
                stored[mode].append(int(found))

            return after

        bench.say(
            f"webhooks: {count} signed Stripe events and {count} envelopes, {CONCURRENCY} clients"
        )
        series = interleaved(
            {mode: partial(spec, mode) for mode in ("stripe", "events")},
            bench.profile.runs,
            around,
        )
        procs.check_alive()
    finally:
        procs.stop_all()
        bench.dbs.drop(url)
    summary: dict[str, Any] = {name: s.summary() for name, s in series.items()}
    summary["events_per_run"] = count
    summary["concurrency"] = CONCURRENCY
    summary["stored_per_run"] = stored
    summary["stripe_share_of_events"] = paired_ratio(series["stripe"], series["events"])
    webhooks, events = summary["stripe"], summary["events"]
    exact = all(n == count for n in stored["stripe"]) and not webhooks["errors"]
    check = Check(
        "7 webhooks",
        f"signed Stripe events/s, {count:,} at {CONCURRENCY} clients "
        f"(p50 {webhooks['p50_ms']:.0f} / p99 {webhooks['p99_ms']:.0f} ms; "
        f"keys per run {', '.join(map(str, stored['stripe']))})",
        webhooks["rate"],
        "/s",
        "POST /v1/events",
        events["rate"],
        f"{count:,} keys, 0 errors (got {webhooks['errors']} errors)",
        exact,
    )
    return summary, [check]
