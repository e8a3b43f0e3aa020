"""5. Growth: ingest and claim rates with many existing keys against few.

Two databases filled with generate_series (finished keys shaped like real ones: a readable
prefix and a SHA-256, with their events), then VACUUM ANALYZE; a receiver on each; timed runs
alternate between them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from sqlalchemy import create_engine

from bench.context import Bench, interleaved, paired_ratio
from bench.infra import sql
from bench.ingest import errors_note
from bench.load import Result, Spec
from bench.report import Check, median
from outbox.core.settings import Settings
from outbox.maintenance.purge import PURGE_BATCH, purge

GROWTH_TARGET = 0.90
# The statement timeout every process runs with by default (DB_TIMEOUT_SECONDS), in ms.
STATEMENT_TIMEOUT_MS = Settings.model_fields["db_timeout_seconds"].default * 1000


def fill_keys(url: str, rows: int) -> None:
    """`rows` finished keys and their events, in batches of 100 000."""
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
    sql(url, "VACUUM ANALYZE idempotency_keys")
    sql(url, "VACUUM ANALYZE events")


def purge_figures(url: str, expire: int) -> dict[str, Any]:
    """Expire `expire` of the database's keys, then purge them as `idem purge --yes` does (its
    batches of `PURGE_BATCH` keys, one transaction each): keys per second, and each batch's
    time (what one statement holds its locks for, against the statement timeout)."""
    sql(
        url,
        "UPDATE idempotency_keys SET expires_at = now() - interval '1 second'"
        " WHERE idempotency_key IN (SELECT idempotency_key FROM idempotency_keys"
        " WHERE status = 'succeeded' ORDER BY random() LIMIT %(n)s)",
        {"n": expire},
    )
    engine = create_engine(url)
    batches: list[float] = []
    purged = 0
    began = time.monotonic()
    try:
        while True:
            started = time.monotonic()
            report = purge(engine, dry_run=False, max_batches=1)
            batches.append((time.monotonic() - started) * 1000)
            purged += report.expired_keys
            if report.expired_keys < PURGE_BATCH:
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
        # A tenth of each database's keys expired and purged, the receivers idle.
        bench.say("growth: purge")
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
                f"purge keys/s with {sizes['large']:,} keys ({large['purged']:,} expired; batch "
                f"of {PURGE_BATCH:,} p50 {large['batch_ms_p50']:.0f} ms, max "
                f"{large['batch_ms_max']:.0f} ms)",
                large["keys_per_s"],
                "/s",
                f"{sizes['small']:,} keys",
                small["keys_per_s"],
                f"batch max < statement timeout {STATEMENT_TIMEOUT_MS:.0f} ms",
                large["batch_ms_max"] < STATEMENT_TIMEOUT_MS,
            )
        )
    finally:
        for process in procs.values():
            process.stop_all()
        for url in urls.values():
            bench.dbs.drop(url)
    return summary, checks
