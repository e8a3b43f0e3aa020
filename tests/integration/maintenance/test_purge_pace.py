"""The purge's batches follow their time against the statement timeout (outbox/maintenance/pace.py).

A slow disk is stood in for by a trigger, in the test's own database, that sleeps a few
milliseconds for each event the cascade deletes: the server's statement timeout cancels a
large batch exactly as it cancels one held up by cold pages.
"""

from __future__ import annotations

import pytest
from sqlalchemy.exc import OperationalError
from structlog.testing import capture_logs

from outbox.core.settings import Settings
from outbox.maintenance.pace import BatchPace
from outbox.maintenance.purge import purge
from outbox.maintenance.sweeper import sweep_once
from outbox.store.engines import create_sync_engine
from tests.support import query, seed_expired_keys

KEYS = 400
TIMEOUT_SECONDS = 0.4


def _expired_keys(db: str, per_event_ms: float) -> None:
    """`KEYS` succeeded keys past their TTL with their events, and a trigger that makes
    deleting each event take `per_event_ms`."""
    seed_expired_keys(db, KEYS)
    query(
        db,
        "CREATE FUNCTION slow_disk() RETURNS trigger LANGUAGE plpgsql AS $$"
        f" BEGIN PERFORM pg_sleep({per_event_ms / 1000}); RETURN OLD; END $$",
    )
    query(
        db,
        "CREATE TRIGGER slow_disk BEFORE DELETE ON events"
        " FOR EACH ROW EXECUTE FUNCTION slow_disk()",
    )


def _settings(db: str) -> Settings:
    return Settings(
        database_url=db,
        redis_url="redis://unused",
        db_timeout_seconds=TIMEOUT_SECONDS,
        sweep_batch_size=KEYS,
        sweep_grace_seconds=60,
    )


def _cancelled(logs: list[dict[str, object]]) -> list[object]:
    return [e["batch"] for e in logs if e["event"] == "purge.batch_cancelled"]


def test_a_batch_the_server_cancels_is_tried_again_smaller(own_database: str) -> None:
    """400 keys at 5 ms each under a 0.4 s timeout: the batches of 400, 200 and 100 are
    cancelled and rolled back, the purge goes on with 50 and fewer, and every key and event is
    gone at the end. Without the pace the first cancellation would end the purge, every time."""
    _expired_keys(own_database, per_event_ms=5)
    engine = create_sync_engine(_settings(own_database))
    pace = BatchPace(KEYS)
    try:
        with capture_logs() as logs:
            report = purge(engine, dry_run=False, batch=KEYS, pace=pace)
    finally:
        engine.dispose()
    assert _cancelled(logs) == [400, 200, 100]
    assert report.expired_keys == KEYS
    assert not report.full
    assert query(own_database, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(own_database, "SELECT count(*) FROM events") == [(0,)]
    # What the last batches took is what the next call starts from.
    assert pace.size <= 50


def test_the_sweeper_starts_each_pass_from_what_the_last_one_learnt(own_database: str) -> None:
    """Two passes sharing a pace (as `run_sweeper` keeps one): the first pays the
    cancellations, the second starts small enough to finish without any."""
    _expired_keys(own_database, per_event_ms=5)
    settings = _settings(own_database)
    engine = create_sync_engine(settings)
    pace = BatchPace(settings.sweep_batch_size)
    try:
        with capture_logs() as first_logs:
            first = sweep_once(engine, settings, pace=pace)
        learnt = pace.size
        with capture_logs() as second_logs:
            second = sweep_once(engine, settings, pace=pace)
    finally:
        engine.dispose()
    assert first is not None and second is not None
    assert _cancelled(first_logs) == [400, 200, 100]
    assert 0 < first.purged_keys <= 50
    assert _cancelled(second_logs) == []
    assert second.purged_keys == learnt
    left = KEYS - first.purged_keys - second.purged_keys
    assert query(own_database, "SELECT count(*) FROM idempotency_keys") == [(left,)]


def test_a_single_key_the_server_cancels_is_an_error_and_nothing_goes(own_database: str) -> None:
    """A key whose cascade alone outlasts the timeout (here 1 s an event): halving ends at one
    key, that batch's cancellation is raised to the caller (the sweeper logs it and tries at
    its next pass), and every key is still there."""
    _expired_keys(own_database, per_event_ms=1000)
    engine = create_sync_engine(_settings(own_database))
    pace = BatchPace(4)
    try:
        with capture_logs() as logs, pytest.raises(OperationalError):
            purge(engine, dry_run=False, pace=pace)
    finally:
        engine.dispose()
    assert _cancelled(logs) == [4, 2]
    assert pace.size == 1
    assert query(own_database, "SELECT count(*) FROM idempotency_keys") == [(KEYS,)]
