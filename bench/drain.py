"""4. Relay: one relay process draining a pre-filled outbox into Redis (no worker), and the
receiver's ingest rate while a relay drains beside it, against its rate with no relay running.

The drain rate counts from the first key in the queue to the last (the queue polled every
20 ms, its new messages' keys counted: a message carries up to RELAY_KEYS_PER_MESSAGE), so
process start-up is left out; every row must arrive (each row's key exactly once, none
unpublished).
It is what the relay can do: measured with pacing off (RELAY_BACKLOG_RATE=0).

The backlog beside ingest is an outage's (rows due for ten minutes), drained by a relay with
the default pacing (RELAY_BACKLOG_RATE rows/s once rows have waited RELAY_BACKLOG_AGE_SECONDS)
and, for the trade-off, by one with pacing off; the three kinds of run (no relay, paced,
unpaced) alternate, and each ratio is paired with the no-relay run of its round. The rows each
relay published during the timed run say what the receivers' share cost the drain.
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from typing import Any

from bench.context import Bench, Series, paired_ratio
from bench.infra import Processes, scalar, sql, wait_until
from bench.load import generate
from bench.procfs import cpu_seconds
from bench.report import Check, median
from outbox.core.wire import PROCESS_KEYS_TASK, TASK_QUEUE

DRAIN_TARGET = 5_000.0
INGEST_DROP_LIMIT = 0.20

UNPUBLISHED = "SELECT count(*) FROM outbox WHERE published_at IS NULL"
# An outage's backlog: every row already older than RELAY_BACKLOG_AGE_SECONDS.
OUTAGE_AGE = "10 minutes"
KINDS = ["alone", "paced", "unpaced"]
RELAY_ENV: dict[str, dict[str, str]] = {"paced": {}, "unpaced": {"RELAY_BACKLOG_RATE": "0"}}
RELAY_LABEL = {
    "paced": "default pacing",
    "unpaced": "pacing off",
}


def fill_backlog(url: str, rows: int, tag: str, waited: str = "0 seconds") -> None:
    """`rows` outbox rows (with their keys) due since `waited` ago, like
    tests/integration/test_faults.py."""
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
        INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)
        SELECT 'relay:' || %(tag)s || ':' || g, 'idem.process', 'c-' || g,
               now() - CAST(%(waited)s AS interval)
          FROM generate_series(1, %(n)s::int) g
        """,
        {"n": rows, "tag": tag, "waited": waited},
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

        bench.say("relay: receiver's ingest with no relay, a paced relay, an unpaced relay")
        receiver = procs.start_receiver()
        procs.ready()
        pid = procs.pid("receiver")
        bench.warm(receiver)
        bench.dbs.analyze(url)
        series = {kind: Series() for kind in KINDS}
        left: dict[str, list[int]] = {kind: [] for kind in KINDS[1:]}
        published: dict[str, list[float]] = {kind: [] for kind in KINDS[1:]}
        for round_number in range(profile.runs):
            shift = round_number % len(KINDS)
            for kind in KINDS[shift:] + KINDS[:shift]:
                spec = bench.spec(receiver, concurrency=64, watch_pids=[pid])
                if kind == "alone":
                    series[kind].results.append(generate(spec))
                    continue
                fill_backlog(
                    url,
                    profile.relay_concurrent_backlog,
                    f"{kind}-{round_number}",
                    waited=OUTAGE_AGE,
                )
                procs.start_relay(**RELAY_ENV[kind])
                procs.ready()
                wait_until(lambda: int(broker.llen(TASK_QUEUE)) > 0, 60, interval=0.02)
                before, began = int(scalar(url, UNPUBLISHED)), time.monotonic()
                series[kind].results.append(generate(spec))
                after, took = int(scalar(url, UNPUBLISHED)), time.monotonic() - began
                # Rows still unpublished when the run ended: the relay drained throughout.
                left[kind].append(after)
                published[kind].append((before - after) / took)
                # What a paced relay has left would take it minutes: drop it, it was load.
                procs.stop("relay")
                sql(url, "DELETE FROM outbox WHERE published_at IS NULL")
                broker.unlink(TASK_QUEUE)
        procs.check_alive()
    finally:
        procs.stop_all()
        broker.unlink(TASK_QUEUE)
        broker.close()
        bench.dbs.drop(url)

    without = series["alone"].summary()
    summary: dict[str, Any] = {
        "drain": drain,
        "ingest_without_relay": without,
        "backlog_per_run": profile.relay_concurrent_backlog,
        "backlog_waited": OUTAGE_AGE,
    }
    changes: dict[str, float] = {}
    for kind in KINDS[1:]:
        changes[kind] = 1 - paired_ratio(series[kind], series["alone"])
        summary[f"ingest_while_draining_{kind}"] = series[kind].summary()
        summary[f"ingest_drop_{kind}"] = changes[kind]
        summary[f"backlog_left_after_each_run_{kind}"] = left[kind]
        summary[f"relay_rows_per_s_during_ingest_{kind}"] = median(published[kind])
    # The default relay's figure keeps its old name.
    summary["ingest_drop"] = changes["paced"]
    checks = [
        Check(
            "4 relay",
            f"rows published/s ({rows:,} rows, pacing off, all arrived: {drain['all_arrived']})",
            drain["rows_per_s"],
            "/s",
            "",
            None,
            f">= {DRAIN_TARGET:,.0f}/s",
            drain["rows_per_s"] >= DRAIN_TARGET and bool(drain["all_arrived"]),
        ),
    ]
    for kind in KINDS[1:]:
        beside = summary[f"ingest_while_draining_{kind}"]
        checks.append(
            Check(
                "4 relay",
                f"ingest/s while a relay drains, {RELAY_LABEL[kind]} (falls {changes[kind]:.0%};"
                f" relay {summary[f'relay_rows_per_s_during_ingest_{kind}']:,.0f} rows/s)",
                beside["rate"],
                "/s",
                "no relay",
                without["rate"],
                f"falls <= {INGEST_DROP_LIMIT:.0%}",
                changes[kind] <= INGEST_DROP_LIMIT,
            )
        )
    return summary, checks


def _drain(procs: Processes, broker: Any, url: str, rows: int) -> dict[str, Any]:
    procs.start_relay(RELAY_BACKLOG_RATE="0")
    pid = procs.pid("relay")
    first: tuple[float, int] | None = None
    deadline = time.monotonic() + max(120.0, rows / 500)
    arrived = Arrivals(broker)
    while time.monotonic() < deadline:
        keys = arrived.count()
        now = time.monotonic()
        if first is None and keys > 0:
            first = (now, keys)
            cpu_at_first = cpu_seconds(pid)
        if keys >= rows:
            break
        time.sleep(0.02)
    done = time.monotonic()
    cpu = cpu_seconds(pid) - cpu_at_first if first is not None else 0.0
    # The last batch is marked (and committed) just after its LPUSH.
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: scalar(url, UNPUBLISHED) == 0, 10, interval=0.05)
    unpublished = int(scalar(url, UNPUBLISHED))
    # Exactly `rows` keys: none lost, none published twice.
    keys = arrived.count()
    procs.stop("relay")
    if first is None:
        raise RuntimeError("relay: nothing arrived in the queue")
    seconds = done - first[0]
    return {
        "rows": rows,
        "arrived": keys,
        "messages": arrived.messages,
        "unpublished_left": unpublished,
        "all_arrived": keys == rows and len(arrived.keys) == rows and unpublished == 0,
        "seconds": seconds,
        "rows_per_s": (rows - first[1]) / seconds if seconds > 0 else 0.0,
        "relay_cores": cpu / seconds if seconds > 0 else 0.0,
    }


class Arrivals:
    """The keys in the task queue, counted as messages arrive (a message may carry several,
    RELAY_KEYS_PER_MESSAGE). The relay pushes at the list's head, and nothing takes from it
    here, so the messages already counted keep their places counted from the tail: each poll
    reads only the ones pushed since."""

    def __init__(self, broker: Any) -> None:
        self._broker = broker
        self.messages = 0
        self.total = 0
        self.keys: set[str] = set()

    def count(self) -> int:
        length = int(self._broker.llen(TASK_QUEUE))
        if length > self.messages:
            fresh = self._broker.lrange(TASK_QUEUE, -length, -(self.messages + 1))
            for message in fresh:
                carried = _keys(message)
                self.total += len(carried)
                self.keys.update(carried)
            self.messages = length
        return self.total


def _keys(message: bytes) -> list[str]:
    frame = json.loads(message)
    args = json.loads(base64.b64decode(frame["body"]))[0]
    if frame["headers"]["task"] == PROCESS_KEYS_TASK:
        return list(args[0])
    return [args[0]]
