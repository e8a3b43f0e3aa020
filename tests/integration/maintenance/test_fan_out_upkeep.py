"""Fan-out and upkeep on real PostgreSQL: the purge takes an expired event's deliveries by their
own rules and the event's key only once none is left; migration 0015 leaves existing keys as
they were, and its downgrade takes fan-out events with their deliveries."""

from __future__ import annotations

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine

from outbox.core.keys import delivery_key
from outbox.core.settings import Settings
from outbox.maintenance.purge import purge
from outbox.store.engines import create_sync_engine
from outbox.store.migrate import alembic_config, upgrade
from tests.support import query

EVENT = "billing-app:billing.invoice_paid:" + "e" * 64


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


def _seed_expired_event(db: str, deliveries: dict[str, str]) -> None:
    """A fan-out event accepted 40 days ago with a 30-day TTL, its deliveries in `deliveries`
    (destination: status), each failed one with an open dead letter."""
    old = "now() - interval '40 days'"
    columns = (
        "idempotency_key, status, payload_hash, correlation_id, source, event_type, route,"
        " created_at, updated_at, expires_at, event_key, destination"
    )
    query(
        db,
        f"INSERT INTO idempotency_keys ({columns}) VALUES (%s, 'fanned_out', 'h', 'c',"
        f" 'billing-app', 'billing.invoice_paid', 'billing', {old}, {old},"
        " now() - interval '10 days', NULL, NULL)",
        (EVENT,),
    )
    query(
        db,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " VALUES (%s, 'billing-app', 'billing.invoice_paid', 'inv-1', '{}')",
        (EVENT,),
    )
    for destination, status in deliveries.items():
        key = delivery_key(EVENT, destination)
        query(
            db,
            f"INSERT INTO idempotency_keys ({columns}) VALUES (%s, %s, 'h', 'c', 'billing-app',"
            f" 'billing.invoice_paid', %s, {old}, {old}, now() - interval '10 days', %s, %s)",
            (key, status, destination, EVENT, destination),
        )
        if status == "failed_final":
            query(
                db,
                "INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts,"
                " first_failed_at, last_failed_at) VALUES (%s, 'permanent', 'http_422', 1,"
                " now(), now())",
                (key,),
            )


def _purge(db: str) -> int:
    settings = Settings(database_url=db, redis_url="redis://unused")
    engine: Engine = create_sync_engine(settings)
    try:
        return purge(engine, dry_run=False).expired_keys
    finally:
        engine.dispose()


def _keys(db: str) -> set[str]:
    return {row[0] for row in query(db, "SELECT idempotency_key FROM idempotency_keys")}


def test_an_expired_event_goes_after_its_last_delivery(db: str) -> None:
    """Two delivered, one dead-lettered (open): the purge takes the two deliveries and keeps
    the event and the open dead letter's delivery; once that dead letter is discarded, the
    delivery goes, and then the event with its payload."""
    _seed_expired_event(
        db, {"books": "succeeded", "finance-flow": "succeeded", "notify": "failed_final"}
    )
    assert _purge(db) == 2
    assert _keys(db) == {EVENT, delivery_key(EVENT, "notify")}
    assert query(db, "SELECT count(*) FROM events") == [(1,)]
    query(db, "UPDATE dead_letters SET resolution = 'discarded', resolved_at = now()")
    # The delivery first; the event at the next pass (it still had a delivery when looked at).
    assert _purge(db) == 1
    assert _keys(db) == {EVENT}
    assert _purge(db) == 1
    assert _keys(db) == set()
    assert query(db, "SELECT count(*) FROM events") == [(0,)]


def test_an_event_with_a_delivery_on_its_way_is_kept(db: str) -> None:
    """A delivery still pending (its retry due) keeps its event past the TTL, payload and all."""
    _seed_expired_event(db, {"books": "succeeded", "notify": "pending"})
    assert _purge(db) == 1
    assert _keys(db) == {EVENT, delivery_key(EVENT, "notify")}
    assert query(db, "SELECT count(*) FROM events") == [(1,)]


def test_the_migration_keeps_existing_keys_and_its_downgrade_takes_fan_out_events(
    fresh_database: str,
) -> None:
    """Keys stored before 0015 keep every column (event_key and destination NULL); after a
    fan-out event is stored, a downgrade to 0014 removes it with its deliveries and keeps the
    rest."""
    url = fresh_database
    upgrade(url, "0014")
    query(
        url,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, expires_at) SELECT 'webform:crm:' || i, s, 'h', 'c',"
        " 'webform', 'crm.lead', 'crm', now() + interval '30 days'"
        " FROM generate_series(1, 50) i, (VALUES ('pending'), ('succeeded')) v(s)"
        " WHERE (i % 2 = 0) = (s = 'pending')",
    )
    before = query(url, "SELECT idempotency_key, status, route FROM idempotency_keys ORDER BY 1")
    upgrade(url)
    after = query(
        url,
        "SELECT idempotency_key, status, route FROM idempotency_keys"
        " WHERE event_key IS NULL AND destination IS NULL ORDER BY 1",
    )
    assert after == before and len(after) == 50
    _seed_expired_event(url, {"books": "succeeded", "notify": "pending"})
    # A delivery cannot name a destination without its event, nor the other way round.
    with pytest.raises(psycopg.errors.CheckViolation):
        query(url, "UPDATE idempotency_keys SET destination = 'x' WHERE event_key IS NULL")
    command.downgrade(alembic_config(url), "0014")
    assert (
        query(url, "SELECT idempotency_key, status, route FROM idempotency_keys ORDER BY 1")
        == before
    )
