"""The purge of a large expired backlog under a statement timeout far below the default."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.store.engines import create_sync_engine
from tests.support import query, seed_expired_keys


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


KEYS = 30_000


def test_a_large_expired_backlog_is_purged_in_batches(db: str) -> None:
    """30 000 succeeded keys (with their events and published outbox rows) whose TTL ran out,
    0.5 s statement timeout: the count and the purge complete, batch by batch, and an
    interrupted purge (a bounded number of batches, each at most the configured 1 000 keys,
    fewer when one took more than a third of the timeout) simply goes on at the next run."""
    seed_expired_keys(db, KEYS)
    query(
        db,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id, published_at)"
        " SELECT idempotency_key, 'process', correlation_id, now() - interval '39 days'"
        " FROM idempotency_keys",
    )
    settings = Settings(database_url=db, redis_url="redis://unused", db_timeout_seconds=0.5)
    engine: Engine = create_sync_engine(settings)
    try:
        assert purge(engine, dry_run=True).expired_keys == KEYS
        interrupted = purge(engine, dry_run=False, max_batches=3)
        assert 3 <= interrupted.expired_keys <= 3_000
        assert interrupted.full
        rest = purge(engine, dry_run=False)
    finally:
        engine.dispose()
    assert rest.expired_keys == KEYS - interrupted.expired_keys
    assert not rest.full
    assert query(db, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(db, "SELECT count(*) FROM events") == [(0,)]
    assert query(db, "SELECT count(*) FROM outbox") == [(0,)]
