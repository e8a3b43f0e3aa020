"""The purge of a large expired backlog under a statement timeout far below the default."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.store.engines import create_sync_engine
from tests.support import query


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


KEYS = 30_000


def test_a_large_expired_backlog_is_purged_in_batches(db: str) -> None:
    """30 000 succeeded keys (with their events and published outbox rows) whose TTL ran out,
    0.5 s statement timeout: the count and the purge complete, batch by batch, and an
    interrupted purge (a bounded number of batches) simply goes on at the next run."""
    query(
        db,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, created_at, updated_at, expires_at)"
        " SELECT 'webform:crm.lead.created:' || i, 'succeeded', 'h', 'corr-' || i, 'webform',"
        " 'crm.lead.created', 'crm', now() - interval '40 days', now() - interval '40 days',"
        " now() - interval '10 days' FROM generate_series(1, %s) i",
        (KEYS,),
    )
    query(
        db,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " SELECT idempotency_key, source, event_type, idempotency_key, '{}' FROM idempotency_keys",
    )
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
        assert interrupted.expired_keys == 3_000
        rest = purge(engine, dry_run=False)
    finally:
        engine.dispose()
    assert rest.expired_keys == KEYS - 3_000
    assert query(db, "SELECT count(*) FROM idempotency_keys") == [(0,)]
    assert query(db, "SELECT count(*) FROM events") == [(0,)]
    assert query(db, "SELECT count(*) FROM outbox") == [(0,)]
