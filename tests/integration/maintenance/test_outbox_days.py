"""The outbox's day partitions on real PostgreSQL: the purge makes the days ahead, drops a day
whole once nothing in it is needed and keeps a day that still holds a row somebody needs; a
drop that cannot have its lock at once waits for the next pass; migration 0017 keeps every row
and its downgrade puts them back in one table."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from alembic import command
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.maintenance.partitions import AHEAD_DAYS, upkeep
from outbox.maintenance.purge import purge
from outbox.store import partitions as q
from outbox.store.engines import create_sync_engine
from outbox.store.migrate import alembic_config, upgrade
from tests.support import libpq, query

WEEK = 7 * 86_400.0


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


@pytest.fixture
def engine(db: str) -> Iterator[Engine]:
    engine = create_sync_engine(Settings(database_url=db, redis_url="redis://unused"))
    yield engine
    engine.dispose()


def _today(db: str) -> datetime:
    (now,) = query(db, "SELECT now()")[0]
    return datetime(now.year, now.month, now.day, tzinfo=UTC)


def _days(db: str) -> set[str]:
    return {
        name
        for (name,) in query(
            db,
            "SELECT relname FROM pg_inherits i JOIN pg_class c"
            " ON c.oid = i.inhrelid WHERE i.inhparent = 'outbox'"
            "::regclass",
        )
    }


def _two_weeks_of_days(db: str, today: datetime, back: tuple[int, ...]) -> None:
    """The layout of a gateway that has run for weeks: the partition the migration made of
    the table before it (empty here) gone, a partition for each of the days `back` ago."""
    (before,) = [name for name in _days(db) if name.startswith("outbox_before_")]
    query(db, f"DROP TABLE {before}")
    for n in back:
        query(db, str(q.create_day(today - timedelta(days=n))))


def _key_with_rows(db: str, key: str, rows: list[tuple[str, str | None]]) -> None:
    """Key `key` with one outbox row per (created, published) pair, SQL times."""
    query(
        db,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, expires_at) VALUES (%s, 'succeeded', 'h', 'c', 'webform',"
        " 'crm.lead.created', 'crm', now() + interval '30 days')",
        (key,),
    )
    for created, published in rows:
        query(
            db,
            "INSERT INTO outbox (idempotency_key, task_name, correlation_id, created_at,"
            f" available_at, published_at) VALUES (%s, 'idem.process', 'c', {created},"
            f" {created}, {published or 'NULL'})",
            (key,),
        )


def test_a_day_nobody_needs_is_dropped_whole_and_a_day_with_a_needed_row_waits(
    db: str, engine: Engine
) -> None:
    """Days 10, 9, 8 and 2 back, each with rows: day 10's all published long ago goes whole;
    day 9 keeps an unpublished row (its published one goes by the row prune, a day after its
    day would have gone); day 8's row was published within the retention and day 2's too, so
    both wait. The dry run says the same and changes nothing; the days ahead are made; a
    second purge finds nothing more to do; a new row lands in today's partition."""
    today = _today(db)
    _two_weeks_of_days(db, today, (10, 9, 8, 2))
    day = {n: q.day_name(today - timedelta(days=n)) for n in (10, 9, 8, 2)}
    at = {
        n: f"CAST('{today - timedelta(days=n) + timedelta(hours=12)}' AS timestamptz)"
        for n in (10, 9, 8, 2)
    }
    _key_with_rows(db, "gone", [(at[10], f"{at[10]} + interval '1 s'")] * 3)
    _key_with_rows(db, "lingering", [(at[9], f"{at[9]} + interval '1 s'"), (at[9], None)])
    _key_with_rows(db, "late", [(at[8], "now() - interval '1 day'")])
    _key_with_rows(db, "recent", [(at[2], f"{at[2]} + interval '1 s'")])
    ahead = {q.day_name(today + timedelta(days=n)) for n in range(AHEAD_DAYS + 1)}

    counted = purge(engine, dry_run=True, retention_seconds=WEEK)
    assert counted.outbox_days_dropped == (day[10],)
    assert set(counted.outbox_days_waiting) == {day[9], day[8], day[2]}
    assert counted.published_outbox_rows == 1
    assert day[10] in _days(db) and query(db, "SELECT count(*) FROM outbox") == [(7,)]

    purged = purge(engine, dry_run=False, retention_seconds=WEEK)
    assert purged.outbox_days_dropped == (day[10],)
    assert purged.published_outbox_rows == 1
    assert day[10] not in _days(db) and ahead <= _days(db)
    left = query(db, "SELECT idempotency_key, published_at IS NULL FROM outbox ORDER BY 1")
    assert left == [("late", False), ("lingering", True), ("recent", False)]
    assert query(db, "SELECT count(*) FROM outbox_default") == [(0,)]

    again = purge(engine, dry_run=False, retention_seconds=WEEK)
    assert (again.outbox_days_dropped, again.published_outbox_rows) == ((), 0)
    assert set(again.outbox_days_waiting) == {day[9], day[8], day[2]}

    _key_with_rows(db, "new", [("now()", None)])
    landed = query(db, "SELECT tableoid::regclass::text FROM outbox WHERE idempotency_key = 'new'")
    assert landed == [(q.day_name(today),)]


def test_a_drop_gives_up_on_its_lock_at_once_and_goes_at_the_next_pass(
    db: str, engine: Engine
) -> None:
    """While a transaction reads the outbox, the drop waits no longer than its lock timeout,
    leaves the day as it was and reports it neither dropped nor waiting; once the reader is
    done, the next pass drops it."""
    today = _today(db)
    _two_weeks_of_days(db, today, (10,))
    _key_with_rows(
        db,
        "gone",
        [(f"CAST('{today - timedelta(days=10)}' AS timestamptz)", "now() - interval '9 days'")],
    )
    name = q.day_name(today - timedelta(days=10))
    with psycopg.connect(libpq(db)) as reader:
        reader.execute("SELECT count(*) FROM outbox").fetchall()  # holds its lock until commit
        held = upkeep(engine, retention_seconds=WEEK)
        assert (held.dropped, held.waiting) == ([], [])
        assert name in _days(db)
    assert upkeep(engine, retention_seconds=WEEK).dropped == [name]
    assert query(db, "SELECT count(*) FROM outbox") == [(0,)]


def test_a_day_whose_rows_already_sit_in_default_is_skipped_and_the_next_days_are_made(
    db: str, engine: Engine
) -> None:
    """A day with no partition sends its rows to the DEFAULT partition; its partition cannot be
    made over them, so the upkeep skips that day (the rows stay, the row prune's to remove)
    and still makes the others."""
    today = _today(db)
    upkeep(engine, retention_seconds=WEEK)
    last = today + timedelta(days=AHEAD_DAYS)
    query(db, f"DROP TABLE {q.day_name(last)}")
    _key_with_rows(db, "early", [(f"CAST('{last + timedelta(hours=1)}' AS timestamptz)", None)])
    assert query(db, "SELECT count(*) FROM outbox_default") == [(1,)]
    report = upkeep(engine, retention_seconds=WEEK)
    assert report.created == [] and q.day_name(last) not in _days(db)
    assert query(db, "SELECT count(*) FROM outbox_default") == [(1,)]


def test_the_migration_keeps_every_row_and_its_downgrade_puts_them_back(db: str) -> None:
    """Rows written before 0017 (published and not) are the first partition's after it, the
    relay's ids go on from the same sequence, and a downgrade to 0016 puts every row back in a
    single table with its primary key on `id`."""
    command.downgrade(alembic_config(db), "0016")
    _key_with_rows(
        db, "old", [("now() - interval '3 days'", "now() - interval '3 days'"), ("now()", None)]
    )
    before = query(db, "SELECT id, published_at IS NULL FROM outbox ORDER BY id")
    upgrade(db)
    assert query(db, "SELECT id, published_at IS NULL FROM outbox ORDER BY id") == before
    where = {t for (t,) in query(db, "SELECT tableoid::regclass::text FROM outbox")}
    assert len(where) == 1 and where.pop().startswith("outbox_before_")
    _key_with_rows(db, "new", [("now()", None)])
    (newest,) = query(db, "SELECT max(id) FROM outbox WHERE idempotency_key = 'new'")[0]
    assert newest > max(row[0] for row in before)
    command.downgrade(alembic_config(db), "0016")
    assert query(db, "SELECT count(*) FROM outbox") == [(3,)]
    assert query(
        db,
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = 'outbox'::regclass AND contype = 'p'",
    ) == [("PRIMARY KEY (id)",)]
    upgrade(db)
