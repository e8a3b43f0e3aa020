"""4. Relay: one relay process draining a pre-filled outbox into Redis (no worker), and the
receiver's ingest rate while a relay drains beside it, against its rate with no relay running.

The drain rate counts from the first message in the queue to the last (LLEN polled every
20 ms), so process start-up is left out; every row must arrive (LLEN = rows, none unpublished).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from bench.context import Bench, Series, paired_ratio
from bench.infra import Processes, scalar, sql, wait_until
from bench.load import generate
from bench.procfs import cpu_seconds
from bench.report import Check, median
from outbox.publisher import TASK_QUEUE

DRAIN_TARGET = 5_000.0
INGEST_DROP_LIMIT = 0.20

UNPUBLISHED = "SELECT count(*) FROM outbox WHERE published_at IS NULL"


def fill_backlog(url: str, rows: int, tag: str) -> None:
    """`rows` due outbox rows (with their keys), like tests/integration/test_faults.py."""
    sql(
        url,
        """
        INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,
                                      event_type, route, expires_at)
        SELECT 'relay:' || %(tag)s || ':' || g, 'h', 'c-' || g, 'relay', 'bench.noop',
               'default', now() + interval '1 day'
          FROM generate_series(1, %(n)s::int) g
        """,
        {"n": rows, "tag": tag},
    )
    sql(
        url,
        """
        INSERT INTO outbox (idempotency_key, task_name, correlation_id)
        SELECT 'relay:' || %(tag)s || ':' || g, 'idem.process', 'c-' || g
          FROM generate_series(1, %(n)s::int) g
        """,
        {"n": rows, "tag": tag},
    )
    sql(url, "VACUUM ANALYZE idempotency_keys")
    sql(url, "VACUUM ANALYZE outbox")


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    profile = bench.profile
    url = bench.dbs.create("relay")
    procs = bench.processes(url, "relay")
    broker = bench.redis.client()
    broker.unlink(TASK_QUEUE)
    try:
        rows = profile.relay_backlog
        drains = []
        for drain_number in range(profile.runs):
            bench.say(f"relay: draining {rows:,} outbox rows ({drain_number + 1}/{profile.runs})")
            fill_backlog(url, rows, f"drain-{drain_number}")
            drains.append(_drain(procs, broker, url, rows))
            broker.unlink(TASK_QUEUE)
        drain: dict[str, Any] = {
            "rows": rows,
            "rows_per_s": median([d["rows_per_s"] for d in drains]),
            "all_arrived": all(d["all_arrived"] for d in drains),
            "relay_cores": median([d["relay_cores"] for d in drains]),
            "runs": drains,
        }

        bench.say("relay: receiver's ingest with and without a relay draining")
        receiver = procs.start_receiver()
        procs.ready()
        pid = procs.pid("receiver")
        bench.warm(receiver)
        alone, draining = Series(), Series()
        left: list[int] = []
        for round_number in range(profile.runs):
            order = ["alone", "draining"] if round_number % 2 == 0 else ["draining", "alone"]
            for kind in order:
                spec = bench.spec(receiver, concurrency=64, watch_pids=[pid])
                if kind == "alone":
                    alone.results.append(generate(spec))
                    continue
                fill_backlog(url, profile.relay_concurrent_backlog, f"beside-{round_number}")
                procs.start_relay()
                procs.ready()
                wait_until(lambda: int(broker.llen(TASK_QUEUE)) > 0, 60, interval=0.02)
                draining.results.append(generate(spec))
                # Rows still unpublished when the run ended: the relay drained throughout.
                left.append(int(scalar(url, UNPUBLISHED)))
                wait_until(lambda: scalar(url, UNPUBLISHED) == 0, 300, interval=0.2)
                procs.stop("relay")
                broker.unlink(TASK_QUEUE)
        procs.check_alive()
    finally:
        procs.stop_all()
        broker.unlink(TASK_QUEUE)
        broker.close()
        bench.dbs.drop(url)

    without = alone.summary()
    beside = draining.summary()
    change = 1 - paired_ratio(draining, alone)
    summary = {
        "drain": drain,
        "ingest_without_relay": without,
        "ingest_while_draining": beside,
        "ingest_drop": change,
        "backlog_left_after_each_run": left,
        "backlog_per_run": profile.relay_concurrent_backlog,
    }
    checks = [
        Check(
            "4 relay",
            f"rows published/s ({rows:,} rows, all arrived: {drain['all_arrived']})",
            drain["rows_per_s"],
            "/s",
            "",
            None,
            f">= {DRAIN_TARGET:,.0f}/s",
            drain["rows_per_s"] >= DRAIN_TARGET and bool(drain["all_arrived"]),
        ),
        Check(
            "4 relay",
            f"ingest/s while draining (falls {change:.0%})",
            beside["rate"],
            "/s",
            "no relay",
            without["rate"],
            f"falls <= {INGEST_DROP_LIMIT:.0%}",
            change <= INGEST_DROP_LIMIT,
        ),
    ]
    return summary, checks


def _drain(procs: Processes, broker: Any, url: str, rows: int) -> dict[str, Any]:
    procs.start_relay()
    pid = procs.pid("relay")
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + max(120.0, rows / 500)
    length = 0
    while time.monotonic() < deadline:
        length = int(broker.llen(TASK_QUEUE))
        now = time.monotonic()
        if first is None and length > 0:
            first = (now, length)
            cpu_at_first = cpu_seconds(pid)
        if length >= rows:
            break
        time.sleep(0.02)
    done = time.monotonic()
    cpu = cpu_seconds(pid) - cpu_at_first if first is not None else 0.0
    # The last batch is marked (and committed) just after its LPUSH.
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: scalar(url, UNPUBLISHED) == 0, 10, interval=0.05)
    unpublished = int(scalar(url, UNPUBLISHED))
    # Exactly `rows` messages: none lost, none published twice.
    length = int(broker.llen(TASK_QUEUE))
    procs.stop("relay")
    if first is None:
        raise RuntimeError("relay: nothing arrived in the queue")
    seconds = done - first[0]
    return {
        "rows": rows,
        "arrived": length,
        "unpublished_left": unpublished,
        "all_arrived": length == rows and unpublished == 0,
        "seconds": seconds,
        "rows_per_s": (rows - first[1]) / seconds if seconds > 0 else 0.0,
        "relay_cores": cpu / seconds if seconds > 0 else 0.0,
    }
