"""Purge forgets notices once they were sent longer ago than the outbox's retention."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.store.engines import create_sync_engine
from tests.support import query


@pytest.fixture
def engine(own_database: str) -> Iterator[Engine]:
    settings = Settings(database_url=own_database, redis_url="redis://unused")
    engine = create_sync_engine(settings)
    yield engine
    engine.dispose()


def test_purge_forgets_notices_sent_longer_ago_than_the_retention(
    own_database: str, engine: Engine
) -> None:
    """A notice sent 8 days ago goes; one sent an hour ago and one not sent yet stay."""
    db = own_database
    query(
        db,
        "INSERT INTO notices (target, kind, dedupe_key, payload, sent_at) VALUES"
        " ('ops', 'circuit', 'a', '{}', now() - interval '8 days'),"
        " ('ops', 'circuit', 'b', '{}', now() - interval '1 hour'),"
        " ('ops', 'circuit', 'c', '{}', NULL)",
    )
    purge(engine, dry_run=False)
    assert query(db, "SELECT dedupe_key FROM notices ORDER BY 1") == [("b",), ("c",)]
