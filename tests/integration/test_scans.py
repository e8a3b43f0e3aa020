"""The periodic and per-scrape paths read by index on a database with 1 000 000 keys and
1 000 000 published outbox rows: every statement they send is EXPLAINed with its own
parameters, and no plan reads either table from end to end, neither sequentially nor by
walking an index over every row (plans, never timings). `make test` builds 300 000 of each
(the planner already prefers a sequential scan for any path without an index there);
`make test-slow` the million."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.core.routes import Destination, Route, RouteTable, load_routes
from outbox.core.settings import Settings
from outbox.maintenance import purge
from outbox.operate import stats
from outbox.operate.backfill import backfill
from outbox.operate.console import charts
from outbox.operate.deadletters import DeadLetterFilter, list_dead_letters
from outbox.operate.replay import ReplayRequest, plan
from outbox.relay import loop as relay
from outbox.store import relay as queries
from outbox.store.driven import rows_once_more
from outbox.store.engines import create_sync_engine
from tests.support import libpq, statements_sent

SIZES = [
    pytest.param(300_000, id="300k"),
    pytest.param(1_000_000, id="1M", marks=pytest.mark.slow),
]
BIG_TABLES = {"idempotency_keys", "outbox"}


def _build(db: str, keys: int) -> None:
    """`keys` keys over 30 days (nearly all succeeded, a few thousand in every other state),
    each with a published outbox row, a thousand unpublished rows and some dead letters; the
    final failures, half the pending keys (parked) and the superseded ones are in 100 lanes,
    and the final failures are deliveries (to `books`) of fan-out events."""
    import psycopg

    with psycopg.connect(libpq(db), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            """
            INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,
                                          source, event_type, route, locked_until, created_at,
                                          updated_at, expires_at)
            SELECT 'k' || lpad(g::text, 7, '0'),
                   CASE WHEN g %% 1000 = 1 THEN 'failed_final'
                        WHEN g %% 1000 = 2 THEN 'pending'
                        WHEN g %% 1000 = 3 THEN 'failed_retryable'
                        WHEN g %% 1000 = 4 THEN 'processing'
                        WHEN g %% 1000 = 5 THEN 'quarantined'
                        WHEN g %% 1000 = 6 THEN 'superseded'
                        WHEN g %% 1000 = 7 THEN 'fanned_out'
                        ELSE 'succeeded' END,
                   'h', 'c', 'src', 'crm.lead.created', 'default',
                   CASE WHEN g %% 1000 = 4 THEN now() + interval '30 seconds' END,
                   now() - make_interval(secs => (g %% 2592000)),
                   now() - make_interval(secs => (g %% 2592000)) + interval '1 second',
                   now() + interval '30 days'
              FROM generate_series(1, %(n)s) g
            """,
            {"n": keys},
        )
        conn.execute(
            """
            UPDATE idempotency_keys
               SET lane = 'l' || (substr(idempotency_key, 2)::int / 1000 % 100),
                   lane_rank = substr(idempotency_key, 2)::int,
                   error_code = CASE WHEN status = 'pending' THEN 'lane_waiting' END
             WHERE status IN ('failed_final', 'superseded')
                OR (status = 'pending' AND substr(idempotency_key, 2)::int % 2000 = 2)
            """
        )
        conn.execute(
            """
            UPDATE idempotency_keys
               SET event_key = 'k' || lpad((substr(idempotency_key, 2)::int + 6)::text, 7, '0'),
                   destination = 'books'
             WHERE status = 'failed_final'
            """
        )
        conn.execute(
            "INSERT INTO lanes (route, lane, ordering, on_failure, expires_at)"
            " SELECT DISTINCT route, lane, 'accepted', 'block', now() + interval '1 day'"
            "   FROM idempotency_keys WHERE lane IS NOT NULL"
        )
        conn.execute(
            """
            INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at,
                                published_at, publish_attempts)
            SELECT 'k' || lpad(g::text, 7, '0'), 'idem.process', 'c',
                   now() - make_interval(secs => (g %% 518400)),
                   now() - make_interval(secs => (g %% 518400)) + interval '1 second', 1
              FROM generate_series(1, %(n)s) g
            """,
            {"n": keys},
        )
        conn.execute(
            "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
            " SELECT 'k' || lpad(g::text, 7, '0'), 'idem.process', 'c'"
            "   FROM generate_series(2, %(n)s, 1000) g",
            {"n": keys},
        )
        conn.execute(
            """
            INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts,
                                      first_failed_at, last_failed_at)
            SELECT 'k' || lpad(g::text, 7, '0'), 'permanent', 'http_422', 1, now(), now()
              FROM generate_series(1, %(n)s, 1000) g
            """,
            {"n": keys},
        )
        conn.execute("VACUUM ANALYZE idempotency_keys")
        conn.execute("VACUUM ANALYZE outbox")
        conn.execute("VACUUM ANALYZE dead_letters")
        conn.execute("VACUUM ANALYZE lanes")


@pytest.fixture(scope="module", params=SIZES)
def size(request: pytest.FixtureRequest) -> int:
    return int(request.param)


@pytest.fixture(scope="module")
def big(pg_admin_url: str, template_database: str, size: int) -> Iterator[str]:
    from tests.conftest import _copy_of_template

    with _copy_of_template(pg_admin_url, template_database) as url:
        _build(url, size)
        yield url


@pytest.fixture(scope="module")
def explained(big: str) -> Iterator[tuple[Engine, list[tuple[str, Any]]]]:
    """An engine that EXPLAINs every statement it sends, with its parameters, first."""
    engine = create_sync_engine(Settings(database_url=big, redis_url="redis://unused"))
    plans: list[tuple[str, Any]] = []

    def explain(cursor: psycopg.Cursor[Any], statement: str, parameters: Any) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "WITH", "UPDATE", "DELETE", "--")):
            with psycopg.Cursor(cursor.connection) as plain:
                plain.execute("EXPLAIN (FORMAT JSON) " + statement, parameters)
                plans.append((statement, plain.fetchone()[0]))

    with statements_sent(engine, explain):
        yield engine, plans
    engine.dispose()


# Indexes over every row of the big tables: an index scan on one of them with no index
# condition walks the whole table in index order (a partial index's walk is bounded by its
# predicate and is fine).
WHOLE_TABLE_INDEXES = {
    "idempotency_keys_pkey",
    "idempotency_keys_expires_idx",
    "idempotency_keys_created_idx",
    "outbox_pkey",
    "outbox_key_idx",
}


def _seq_scans(node: dict[str, Any]) -> list[str]:
    """Every full read of a big table in the plan: a sequential scan, or a walk of an index
    over every row without an index condition."""
    found = []
    if node.get("Node Type") == "Seq Scan" and node.get("Relation Name") in BIG_TABLES:
        found.append(node["Relation Name"])
    if (
        node.get("Node Type") in ("Index Scan", "Index Only Scan")
        and node.get("Index Name") in WHOLE_TABLE_INDEXES
        and "Index Cond" not in node
    ):
        found.append(node["Index Name"])
    for child in node.get("Plans", []):
        found += _seq_scans(child)
    return found


def _plans_of(
    explained: tuple[Engine, list[tuple[str, Any]]], path: Callable[[Engine], Any]
) -> list[tuple[str, Any]]:
    engine, plans = explained
    plans.clear()
    path(engine)
    assert plans, "the path sent no statement"
    return list(plans)


def _replay_failed(engine: Engine) -> None:
    with engine.connect() as conn:
        plan(
            conn,
            ReplayRequest(statuses=["failed_final"], limit=100),
            load_routes(None),
            secret=b"s",
        )


def _replay_window(engine: Engine) -> None:
    with engine.connect() as conn:
        plan(
            conn,
            ReplayRequest(statuses=["quarantined", "failed_retryable"], since="2h", limit=100),
            load_routes(None),
            secret=b"s",
        )


def _replay_destination(engine: Engine) -> None:
    with engine.connect() as conn:
        plan(
            conn,
            ReplayRequest(destination="notify", statuses=["failed_final"], limit=100),
            load_routes(None),
            secret=b"s",
        )


def _backfill_dry_run(engine: Engine) -> None:
    table = RouteTable(
        [Route(match="billing.*", name="billing", fan_out=["archive"])],
        destinations=[Destination(name="archive", action="noop")],
    )
    backfill(engine, table, "billing", "archive", datetime.now(UTC) - timedelta(days=7))


def _dead_letters_of_a_destination(engine: Engine) -> None:
    list_dead_letters(engine, DeadLetterFilter(destination="notify"))


PATHS: dict[str, Callable[[Engine], Any]] = {
    "replay of a destination": _replay_destination,
    "backfill's dry run": _backfill_dry_run,
    "dead letters of a destination": _dead_letters_of_a_destination,
    "sweeper's purge and prune": lambda e: purge.purge(e, dry_run=False, max_batches=1),
    "/metrics and /v1/stats": stats.collect,
    "console chart": charts.per_minute,
    "replay of final failures": _replay_failed,
    "replay of a window": _replay_window,
    "stuck keys": lambda e: stats.stuck(e, 300),
    "blocked lanes": lambda e: stats.blocked_lanes(e, 300),
    "relay's idle check": relay.seconds_until_next_due,
    "relay's mark, with the idle check": lambda e: rows_once_more(
        e,
        queries.MARK_PUBLISHED,
        {"ids": [1, 2, 3], "oldest": datetime.now(UTC), "newest": datetime.now(UTC)},
    ),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("path", list(PATHS))
def test_no_full_scan_of_keys_or_outbox(
    path: str, explained: tuple[Engine, list[tuple[str, Any]]]
) -> None:
    """With many keys and as many published outbox rows, no statement of this path plans a
    full read of either table."""
    plans = _plans_of(explained, PATHS[path])
    offending = {
        statement.strip().splitlines()[0]: scans
        for statement, document in plans
        if (scans := _seq_scans(document[0]["Plan"]))
    }
    assert not offending, json.dumps(offending, indent=1)


def test_succeeded_keys_are_estimated_on_a_large_table(
    explained: tuple[Engine, list[tuple[str, Any]]], size: int
) -> None:
    """Above the exact-count size the succeeded count is an estimate within a few percent,
    marked as one, and the other statuses (fan-out events below their counting bound) and the
    counts by destination stay exact."""
    engine, _ = explained
    found = stats.collect(engine)
    assert found["keys_succeeded_estimated"] is True
    assert found["keys_fanned_out_estimated"] is False
    succeeded = size - 7 * size // 1000
    assert abs(found["keys_by_status"]["succeeded"] - succeeded) < 0.05 * succeeded
    exact = {s: found["keys_by_status"][s] for s in stats.STATUSES if s != "succeeded"}
    assert exact == dict.fromkeys(exact, size // 1000)
    books = found["destinations"]["books"]
    assert (books["failed_final"], books["open_dead_letters"]) == (size // 1000, size // 1000)


def test_fan_out_events_past_their_counting_bound_are_estimated(
    explained: tuple[Engine, list[tuple[str, Any]]], size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound the fan-out events are estimated from their index's statistics, marked
    as such, never fewer than were counted (the estimate of a status this rare comes from
    ANALYZE's sample: its precision is not asserted)."""
    engine, _ = explained
    monkeypatch.setattr(stats, "FANNED_OUT_COUNTED_UP_TO", 100)
    found = stats.collect(engine)
    assert found["keys_fanned_out_estimated"] is True
    assert 100 < found["keys_by_status"]["fanned_out"] < 3 * size // 1000
    succeeded = size - 7 * size // 1000
    assert abs(found["keys_by_status"]["succeeded"] - succeeded) < 0.05 * succeeded


def test_the_relay_claim_reads_by_index(big: str) -> None:
    """The relay's claim takes its batch through the unpublished rows' index (and, traced, the
    events' stored context through their key)."""
    import psycopg

    statement = (
        str(queries.CLAIM_DUE_OUTBOX)
        .replace(":limit", "%(limit)s")
        .replace(":lease_seconds", "%(lease)s")
        # Traced: each row's trace context is looked up too, by the events' key.
        .replace(":traced", "true")
    )
    with psycopg.connect(libpq(big)) as conn:
        document = conn.execute(
            "EXPLAIN (FORMAT JSON) " + statement, {"limit": 500, "lease": 30}
        ).fetchone()
        conn.rollback()
    assert document is not None
    assert _seq_scans(document[0][0]["Plan"]) == []
