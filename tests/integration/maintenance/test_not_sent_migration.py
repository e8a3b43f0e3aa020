"""Migration 0019 on real PostgreSQL: the attempt log takes `not_sent` and still refuses an
outcome nobody writes; its downgrade turns `not_sent` rows into the waits they were, so the
older check holds again."""

from __future__ import annotations

import psycopg
import pytest
from alembic import command

from outbox.store.migrate import alembic_config, upgrade
from tests.support import libpq, query, seed_pending_key

ADD = (
    "INSERT INTO attempts (idempotency_key, attempt, started_at, outcome) VALUES (%s, 1, now(), %s)"
)


def _add(db: str, key: str, outcome: str) -> None:
    with psycopg.connect(libpq(db), autocommit=True) as conn:
        conn.execute(ADD, (key, outcome))


def test_not_sent_is_an_outcome_and_its_downgrade_rewrites_it(own_database: str) -> None:
    db = own_database
    key = seed_pending_key(db, "not-sent-1")
    for _ in range(3):
        _add(db, key, "not_sent")
    with pytest.raises(psycopg.errors.CheckViolation):
        _add(db, key, "maybe")
    command.downgrade(alembic_config(db), "0018")
    assert query(db, "SELECT outcome, count(*) FROM attempts GROUP BY outcome") == [
        ("deferred_limit", 3)
    ]
    with pytest.raises(psycopg.errors.CheckViolation):
        _add(db, key, "not_sent")
    upgrade(db)
    _add(db, key, "not_sent")
    assert query(db, "SELECT count(*) FROM attempts WHERE outcome = 'not_sent'") == [(1,)]
