"""5. Growth: ingest and claim rates with many existing keys against few.

Two databases filled with generate_series (finished keys shaped like real ones: a readable
prefix and a SHA-256, with their events, and one published outbox row each, spread over the
last ten days' partitions as on a gateway that has run for weeks), then VACUUM ANALYZE; a
receiver on each; timed runs alternate between them. Then the purge: the outbox's days past
the retention dropped whole, a tenth of the keys expired and purged in batches, and, for
comparison, published outbox rows deleted row by row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, timedelta
from functools import partial
from typing import Any

from sqlalchemy import create_engine

from bench.context import Bench, interleaved, paired_ratio
from bench.infra import sql
from bench.ingest import errors_note
from bench.load import Result, Spec
from bench.report import Check, median
from outbox.core.settings import Settings
from outbox.maintenance.pace import SHRINK_ABOVE, BatchPace
from outbox.maintenance.partitions import upkeep
from outbox.maintenance.purge import OUTBOX_RETENTION_SECONDS, PURGE_BATCH, purge
from outbox.store import partitions

GROWTH_TARGET = 0.90
# The statement timeout every process runs with by default (DB_TIMEOUT_SECONDS), in ms.
STATEMENT_TIMEOUT_MS = Settings.model_fields["db_timeout_seconds"].default * 1000
# The outbox's rows are spread over this many past days, a partition each.
OUTBOX_DAYS = 10


def past_days(url: str) -> None:
    """The outbox's layout once the gateway has run for weeks: the partition migration 0017
    made of the table before it (empty in a new database) gone, one for each past day and
    today (the next days' the migration made)."""
    names = sql(
        url,
        "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " WHERE i.inhparent = 'outbox'::regclass AND c.relname LIKE 'outbox_before_%'",
    )
    for (name,) in names:
        sql(url, f"DROP TABLE {name}")
    today = sql(url, "SELECT date_trunc('day', now() AT TIME ZONE 'UTC')")[0][0]
    for back in range(OUTBOX_DAYS, -1, -1):  # today's too: the run's own rows go there
        day = today.replace(tzinfo=UTC) - timedelta(days=back)
        sql(url, str(partitions.create_day(day)))


def fill_keys(url: str, rows: int) -> None:
    """`rows` finished keys with their events and a published outbox row each (created one to
    `OUTBOX_DAYS` days ago, round robin), in batches of 100 000."""
    past_days(url)
    step = 100_000
    for first in range(1, rows + 1, step):
        last = min(rows, first + step - 1)
        params = {"first": first, "last": last}
        sql(
            url,
            """
            INSERT INTO idempotency_keys (
                idempotency_key, status, payload_hash, correlation_id, source, event_type,
                route, attempts, fence, result, created_at, updated_at, expires_at)
            SELECT 'webform:crm.lead.created:' || encode(sha256(('old-' || g)::bytea), 'hex'),
                   'succeeded', encode(sha256(('payload-' || g)::bytea), 'hex'),
                   md5(g::text), 'webform', 'crm.lead.created', 'default', 1, 1,
                   '{"status": 201}', now() - interval '1 day', now() - interval '1 day',
                   now() + interval '29 days'
              FROM generate_series(%(first)s::int, %(last)s::int) g
            """,
            params,
        )
        sql(
            url,
            """
            INSERT INTO events (idempotency_key, source, event_type, external_id, payload,
                                received_at)
            SELECT 'webform:crm.lead.created:' || encode(sha256(('old-' || g)::bytea), 'hex'),
                   'webform', 'crm.lead.created', 'old-' || g,
                   jsonb_build_object('email', 'old-' || g || '@example.com', 'name', 'Ada'),
                   now() - interval '1 day'
              FROM generate_series(%(first)s::int, %(last)s::int) g
            """,
            params,
        )
        sql(
            url,
            """
            INSERT INTO outbox (idempotency_key, task_name, correlation_id, created_at,
                                available_at, published_at, publish_attempts)
            SELECT 'webform:crm.lead.created:' || encode(sha256(('old-' || g)::bytea), 'hex'),
                   'idem.process', md5(g::text), t.created, t.created,
                   t.created + interval '1 second', 1
              FROM generate_series(%(first)s::int, %(last)s::int) g
             CROSS JOIN LATERAL (
                 SELECT date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                        - make_interval(days => 1 + g %% %(days)s, hours => -12) AS created) t
            """,
            {**params, "days": OUTBOX_DAYS},
        )
    sql(url, "VACUUM ANALYZE idempotency_keys")
    sql(url, "VACUUM ANALYZE events")
    sql(url, "VACUUM ANALYZE outbox")


def outbox_figures(url: str, row_prune: int) -> dict[str, Any]:
    """The outbox's days past the retention dropped (`idem purge`'s first step): how many,
    their rows, the time; then, for comparison, `row_prune` published rows of the oldest day
    left deleted row by row in batches of `PURGE_BATCH` (the purge before partitions)."""
    rows_before = int(sql(url, "SELECT count(*) FROM outbox")[0][0])
    past_retention = int(
        sql(
            url,
            "SELECT count(*) FROM outbox WHERE published_at < now() - make_interval(secs => %s)",
            (OUTBOX_RETENTION_SECONDS,),
        )[0][0]
    )
    engine = create_engine(url)
    try:
        began = time.monotonic()
        days = upkeep(engine, retention_seconds=OUTBOX_RETENTION_SECONDS)
        drop_ms = (time.monotonic() - began) * 1000
    finally:
        engine.dispose()
    rows_after = int(sql(url, "SELECT count(*) FROM outbox")[0][0])
    oldest = sorted(days.waiting)[0]
    deleted, began = 0, time.monotonic()
    while deleted < row_prune:
        done = sql(
            url,
            f"DELETE FROM {oldest} WHERE id IN (SELECT id FROM {oldest}"
            " WHERE published_at IS NOT NULL LIMIT %(n)s) RETURNING id",
            {"n": min(PURGE_BATCH, row_prune - deleted)},
        )
        if not done:
            break
        deleted += len(done)
    seconds = time.monotonic() - began
    return {
        "days_dropped": len(days.dropped),
        "rows_dropped": rows_before - rows_after,
        "rows_past_retention": past_retention,
        "drop_ms": drop_ms,
        "row_prune_rows": deleted,
        "row_prune_rows_per_s": deleted / seconds if seconds > 0 else 0.0,
    }


def purge_figures(url: str, expire: int) -> dict[str, Any]:
    """Expire `expire` of the database's keys, then purge them as `idem purge --yes` does
    (batches of up to `PURGE_BATCH` keys, one transaction each, under the statement timeout
    every process runs with, each batch sized by the last one's time; the outbox's days kept
    already): keys per second, each batch's time and size, and the batches the server
    cancelled."""
    sql(
        url,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
        " WHERE idempotency_key IN (SELECT idempotency_key FROM idempotency_keys"
        " WHERE status = 'succeeded' ORDER BY random() LIMIT %(n)s)",
        {"n": expire},
    )
    engine = create_engine(
        url, connect_args={"options": f"-c statement_timeout={STATEMENT_TIMEOUT_MS:.0f}"}
    )
    pace = BatchPace(PURGE_BATCH)
    batches: list[float] = []
    sizes: list[int] = []
    purged = 0
    began = time.monotonic()
    try:
        while True:
            started = time.monotonic()
            report = purge(engine, dry_run=False, max_batches=1, days=False, pace=pace)
            batches.append((time.monotonic() - started) * 1000)
            sizes.append(report.batch)
            purged += report.expired_keys
            if not report.full:
                break
    finally:
        engine.dispose()
    seconds = time.monotonic() - began
    return {
        "expired": expire,
        "purged": purged,
        "keys_per_s": purged / seconds if seconds > 0 else 0.0,
        "batch_ms_p50": median(batches),
        "batch_ms_max": max(batches),
        "batches": len(batches),
        "batch_keys_p50": median([float(n) for n in sizes]),
        "batch_keys_min": min(sizes),
        "cancelled": pace.cancellations,
    }


def wal_position(url: str) -> dict[str, float]:
    """The cluster's WAL position and full-page-image count (pg_stat_wal)."""
    rows = sql(
        url,
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::float8, wal_fpi::float8"
        " FROM pg_stat_wal",
    )
    return {"wal_bytes": float(rows[0][0]), "full_page_images": float(rows[0][1])}


def run(bench: Bench) -> tuple[dict[str, Any], list[Check]]:
    profile = bench.profile
    sizes = {"small": profile.growth_small, "large": profile.growth_large}
    urls = {name: bench.dbs.create(f"growth_{name}") for name in sizes}
    procs = {name: bench.processes(urls[name], f"growth-{name}") for name in sizes}
    summary: dict[str, Any] = {"existing_keys": sizes}
    checks: list[Check] = []
    try:
        for name, rows in sizes.items():
            bench.say(f"growth: filling {rows:,} existing keys")
            fill_keys(urls[name], rows)
            summary[f"{name}_database_mb"] = (
                int(sql(urls[name], "SELECT pg_database_size(current_database())")[0][0]) / 1e6
            )
        receivers = {name: procs[name].start_receiver() for name in sizes}
        for process in procs.values():
            process.ready()
        pids = {name: procs[name].pid("receiver") for name in sizes}
        for url in receivers.values():
            bench.warm(url)
        bench.dbs.analyze(*urls.values())
        for mode in ("events", "claims"):
            bench.say(f"growth: {mode}, {sizes['large']:,} vs {sizes['small']:,} keys")

            def spec(name: str, mode: str = mode) -> Spec:
                return bench.spec(
                    receivers[name], mode=mode, concurrency=64, watch_pids=[pids[name]]
                )

            wal: dict[str, list[dict[str, float]]] = {name: [] for name in sizes}

            def around(
                name: str, wal: dict[str, list[dict[str, float]]] = wal
            ) -> Callable[[Result], None]:
                before = wal_position(urls[name])

                def after(timed: Result) -> None:
                    requests = max(1, timed.requests + timed.warmup_requests)
                    now = wal_position(urls[name])
                    wal[name].append({k: (now[k] - before[k]) / requests for k in now})

                return after

            series = interleaved(
                {name: partial(spec, name) for name in sizes}, profile.runs, around
            )
            result: dict[str, Any] = {name: s.summary() for name, s in series.items()}
            for name in sizes:
                # Cluster-wide counters: other databases' writes during the run count too.
                result[name]["wal_per_request"] = {
                    k: median([w[k] for w in wal[name]]) for k in wal[name][0]
                }
            share = paired_ratio(series["large"], series["small"])
            result["large_share_of_small"] = share
            summary[mode] = result
            label = "ingest" if mode == "events" else "claims"
            checks.append(
                Check(
                    "5 growth",
                    f"{label}/s with {sizes['large']:,} keys (p99 "
                    f"{result['large']['p99_ms']:.0f} ms; WAL "
                    f"{result['large']['wal_per_request']['wal_bytes'] / 1024:.1f} vs "
                    f"{result['small']['wal_per_request']['wal_bytes'] / 1024:.1f} KiB/request)",
                    result["large"]["rate"],
                    "/s",
                    f"{sizes['small']:,} keys",
                    result["small"]["rate"],
                    f">= {GROWTH_TARGET:.0%} (got {share:.0%})"
                    + errors_note(result["large"], result["small"]),
                    share >= GROWTH_TARGET and not result["large"]["errors"],
                )
            )
        for process in procs.values():
            process.check_alive()
        # The outbox's old days dropped, then a tenth of each database's keys expired and
        # purged, the receivers idle.
        bench.say("growth: purge")
        outboxes = {
            name: outbox_figures(urls[name], max(1, rows // 100)) for name, rows in sizes.items()
        }
        summary["outbox_purge"] = outboxes
        dropped = outboxes["large"]
        checks.append(
            Check(
                "5 growth",
                f"outbox days past the retention dropped with {sizes['large']:,} keys "
                f"({dropped['days_dropped']} days, {dropped['rows_dropped']:,} rows, "
                f"{dropped['drop_ms']:.0f} ms); row by row: "
                f"{dropped['row_prune_rows_per_s']:,.0f} rows/s",
                dropped["rows_dropped"] / max(dropped["drop_ms"] / 1000, 1e-9),
                "rows/s",
                "row by row",
                dropped["row_prune_rows_per_s"],
                "every row past the retention, by days",
                dropped["rows_dropped"] == dropped["rows_past_retention"]
                and dropped["days_dropped"] >= 3,
            )
        )
        purges = {
            name: purge_figures(urls[name], max(1, rows // 10)) for name, rows in sizes.items()
        }
        summary["purge"] = purges
        for name in sizes:
            if purges[name]["purged"] != purges[name]["expired"]:
                raise RuntimeError(f"growth: purge removed {purges[name]} in the {name} database")
        large, small = purges["large"], purges["small"]
        checks.append(
            Check(
                "5 growth",
                f"purge keys/s with {sizes['large']:,} keys ({large['purged']:,} expired; batches"
                f" of up to {PURGE_BATCH:,} keys, p50 {large['batch_keys_p50']:.0f} keys in"
                f" {large['batch_ms_p50']:.0f} ms, max {large['batch_ms_max']:.0f} ms; the"
                f" server cancelled {large['cancelled']})",
                large["keys_per_s"],
                "/s",
                f"{sizes['small']:,} keys",
                small["keys_per_s"],
                f"batch p50 < a third of the statement timeout {STATEMENT_TIMEOUT_MS:.0f} ms",
                large["batch_ms_p50"] < STATEMENT_TIMEOUT_MS * SHRINK_ABOVE,
            )
        )
    finally:
        for process in procs.values():
            process.stop_all()
        for url in urls.values():
            bench.dbs.drop(url)
    return summary, checks
