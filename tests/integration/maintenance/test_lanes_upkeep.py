"""Lanes' upkeep on real PostgreSQL: the sweeper hands on a lane nothing else would, leaves a
busy or blocked lane alone, and purge forgets a lane once its keys are gone; a lane with a
long history decides as fast as a new one (its finished keys leave the lane index)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text

from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.maintenance.sweeper import sweep_once
from outbox.store.engines import create_sync_engine
from tests.support import query, seed_lane_key


@pytest.fixture
def engine(own_database: str) -> Iterator[Engine]:
    settings = Settings(database_url=own_database, redis_url="redis://unused")
    engine = create_sync_engine(settings)
    yield engine
    engine.dispose()


def _settings(db: str) -> Settings:
    return Settings(database_url=db, redis_url="redis://unused", sweep_grace_seconds=60)


def _queued(db: str) -> list[str]:
    return [row[0] for row in query(db, "SELECT idempotency_key FROM outbox ORDER BY id")]


def test_the_sweeper_hands_on_an_idle_lane_only(own_database: str, engine: Engine) -> None:
    """Three lanes with parked keys older than the grace period: one idle (its oldest parked
    key is queued, once), one whose head runs, one blocked by a dead letter (both left
    alone). A second pass queues nothing more."""
    db = own_database
    idle = [
        seed_lane_key(db, f"idle-{n}", "pending", lane="L1", rank=n, error_code="lane_waiting")
        for n in (1, 2)
    ]
    seed_lane_key(db, "busy-1", "processing", lane="L2", rank=1)
    seed_lane_key(db, "busy-2", "pending", lane="L2", rank=2, error_code="lane_waiting")
    seed_lane_key(db, "dead-1", "failed_final", lane="L3", rank=1, error_code="http_422")
    seed_lane_key(db, "dead-2", "pending", lane="L3", rank=2, error_code="lane_waiting")
    report = sweep_once(engine, _settings(db))
    assert report is not None and report.lanes_woken == 1
    assert _queued(db) == [idle[0]]
    assert query(
        db, "SELECT error_code FROM idempotency_keys WHERE idempotency_key = %s", (idle[0],)
    ) == [("lane_released",)]
    again = sweep_once(engine, _settings(db))
    assert again is not None and again.lanes_woken == 0
    assert _queued(db) == [idle[0]]


def test_purge_forgets_a_lane_once_its_keys_are_gone(own_database: str, engine: Engine) -> None:
    """Expired finished keys of a lane (succeeded and superseded) are purged, then the lane
    row whose time is up; a lane with a key left, or whose time is not up, stays."""
    db = own_database
    for n, status in ((1, "succeeded"), (2, "superseded")):
        seed_lane_key(db, f"old-{n}", status, lane="gone", rank=n, age="40 days")
    seed_lane_key(db, "kept-1", "pending", lane="kept", rank=1, error_code="lane_waiting")
    seed_lane_key(db, "fresh-1", "succeeded", lane="fresh", rank=1, age="40 days")
    query(
        db,
        "UPDATE idempotency_keys SET expires_at = now() - interval '10 days',"
        " created_at = now() - interval '50 days' WHERE lane IN ('gone', 'fresh')",
    )
    query(db, "UPDATE lanes SET expires_at = now() - interval '1 day' WHERE lane <> 'fresh'")
    assert purge(engine, dry_run=False).expired_keys == 3
    assert query(db, "SELECT lane FROM lanes ORDER BY lane") == [("fresh",), ("kept",)]


def test_a_long_lane_decides_through_its_unfinished_keys_only(
    own_database: str, engine: Engine
) -> None:
    """100 000 succeeded keys in one lane, then one parked key: handing the lane on reads the
    lane index, which holds the unfinished keys alone: the look for an older unfinished key
    reads no more than a handful of rows, and the wake finds the parked key."""
    db = own_database
    query(
        db,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, expires_at, lane, lane_rank)"
        " SELECT 'k-' || i, 'succeeded', 'h', 'c', 'webform', 'crm.lead.created', 'crm',"
        " now() + interval '1 day', 'long', i FROM generate_series(1, 100000) i",
    )
    seed_lane_key(db, "tail", "pending", lane="long", rank=100_001, error_code="lane_waiting")
    query(db, "ANALYZE idempotency_keys")
    with engine.begin() as conn:
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                text(
                    "EXPLAIN ANALYZE SELECT 1 FROM idempotency_keys o WHERE o.route = 'crm'"
                    " AND o.lane = 'long' AND o.lane_rank < 100001"
                    " AND (o.status IN ('pending', 'failed_retryable')"
                    "      OR o.status IN ('failed_final', 'quarantined')) LIMIT 1"
                )
            )
        )
        woken = conn.execute(text("SELECT lane_wake('crm', 'long')")).scalar_one()
    # Whichever index the planner takes, it never walks the lane's history.
    assert "Seq Scan" not in plan, plan
    removed = [int(n) for n in re.findall(r"Rows Removed by Filter: (\d+)", plan)]
    assert max(removed, default=0) < 1000, plan
    assert woken == 1
    assert query(db, "SELECT count(*) FROM outbox") == [(1,)]


def test_a_lane_with_100000_parked_updates_is_handed_on_in_bounded_steps(
    own_database: str,
) -> None:
    """100 000 updates of one object parked behind its lane (supersede), nothing running: one
    hand-on, under a 1 s statement timeout, wakes the newest and supersedes a bounded batch of
    the older ones (1 000), never the whole backlog in one statement."""
    db = own_database
    query(
        db,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, expires_at, lane, lane_rank, error_code)"
        " SELECT 'p-' || i, 'pending', 'h', 'c', 'webform', 'crm.lead.created', 'crm',"
        " now() + interval '1 day', 'hot', i, 'lane_waiting' FROM generate_series(1, 100000) i",
    )
    query(
        db,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, version, payload)"
        " SELECT idempotency_key, source, event_type, 'hot', lane_rank::text, '{}'"
        " FROM idempotency_keys",
    )
    query(
        db,
        "INSERT INTO lanes (route, lane, ordering, on_failure, expires_at)"
        " VALUES ('crm', 'hot', 'supersede', 'block', now() + interval '1 day')",
    )
    query(db, "ANALYZE idempotency_keys")
    settings = Settings(database_url=db, redis_url="redis://unused", db_timeout_seconds=1)
    engine = create_sync_engine(settings)
    try:
        with engine.begin() as conn:
            woken = conn.execute(text("SELECT lane_wake('crm', 'hot')")).scalar_one()
    finally:
        engine.dispose()
    assert woken == 1
    assert _queued(db) == ["p-100000"]
    assert query(
        db, "SELECT status, superseded_by, count(*) FROM idempotency_keys GROUP BY 1, 2 ORDER BY 1"
    ) == [("pending", None, 99_000), ("superseded", "100000", 1_000)]


def test_two_keys_claimed_at_once_never_both_wait(own_database: str, engine: Engine) -> None:
    """The older and the newer key of a lane are claimed together; the older's lane step runs
    first, sees the newer running and parks; the newer's then sees the older waiting and parks
    too. Parking, it hands the lane to the older (the oldest parked key, nothing running), so
    the lane never stalls until the sweeper's grace period, and the newer never goes first."""
    db = own_database
    older = seed_lane_key(db, "both-1", "processing", lane="pair", rank=1)
    newer = seed_lane_key(db, "both-2", "processing", lane="pair", rank=2)
    query(
        db,
        "UPDATE idempotency_keys SET fence = 1, lease_token = 't-' || lane_rank,"
        " locked_until = now() + interval '30 seconds' WHERE lane = 'pair'",
    )
    decide = text("SELECT decision FROM lane_admit(:key, 1, :token, 'accepted', 'block', 3600)")
    with engine.begin() as conn:
        first = conn.execute(decide, {"key": older, "token": "t-1"}).scalar_one()
    with engine.begin() as conn:
        second = conn.execute(decide, {"key": newer, "token": "t-2"}).scalar_one()
    assert (first, second) == ("wait", "wait")
    assert _queued(db) == [older]
    assert query(
        db, "SELECT idempotency_key, error_code FROM idempotency_keys ORDER BY lane_rank"
    ) == [(older, "lane_released"), (newer, "lane_waiting")]
