"""Which schemas a receiver reports ready on: its own release's, or a later release's migrated
first in a rolling upgrade, never an older one."""

from __future__ import annotations

from sqlalchemy import create_engine

from outbox.core.settings import sqlalchemy_url
from outbox.store.migrate import schema_serves, upgrade
from outbox.store.ports import free_port
from outbox.store.readiness import Readiness
from tests.support import query


def _serves(url: str) -> bool:
    engine = create_engine(sqlalchemy_url(url))
    try:
        with engine.connect() as conn:
            return schema_serves(conn)
    finally:
        engine.dispose()


def test_a_schema_behind_is_not_served_at_or_past_head_it_is(fresh_database: str) -> None:
    """Behind this code's head (a migration not applied yet): not served; at its head:
    served; at a revision this code does not know (a later release's, migrated first):
    served; with no revision at all: not served."""
    url = fresh_database
    upgrade(url, "0018")
    assert _serves(url) is False
    upgrade(url)
    assert _serves(url) is True
    query(url, "UPDATE alembic_version SET version_num = '9999'")
    assert _serves(url) is True
    query(url, "DELETE FROM alembic_version")
    assert _serves(url) is False


def test_readiness_checks_the_schema_as_served(fresh_database: str) -> None:
    """The receiver's readiness check counts a later release's schema as ready and an older
    one as not (its broker check is beside the point here: nothing listens on its port)."""
    url = fresh_database
    upgrade(url)
    engine = create_engine(sqlalchemy_url(url))
    readiness = Readiness(engine, f"redis://127.0.0.1:{free_port()}/0")
    try:
        query(url, "UPDATE alembic_version SET version_num = '9999'")
        assert readiness.checks()["migrations"] is True
        query(url, "UPDATE alembic_version SET version_num = '0015'")
        assert readiness.checks()["migrations"] is False
    finally:
        readiness.close()
        engine.dispose()
