"""A fan-out event's own key never runs (`fanned_out`, no outbox row): the sweeper, `idem
stuck` (and the stuck-keys notice, which reads the same statement) and the stats leave it
alone, while its deliveries are keys like any other: lost messages re-driven, expired leases
reclaimed, stuck ones listed. On real PostgreSQL, rows stored by the receiver's statement."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from outbox.core.keys import delivery_key
from outbox.core.settings import Settings
from outbox.maintenance.sweeper import sweep_once
from outbox.operate import stats
from outbox.store.engines import create_sync_engine
from tests.support import query, seed_fan_out_event


@pytest.fixture
def engine(own_database: str) -> Iterator[Engine]:
    engine = create_sync_engine(Settings(database_url=own_database, redis_url="redis://unused"))
    yield engine
    engine.dispose()


def _settings(db: str) -> Settings:
    return Settings(database_url=db, redis_url="redis://unused", sweep_grace_seconds=60)


def test_the_sweeper_redrives_lost_deliveries_and_leaves_the_fan_out_event_alone(
    own_database: str, engine: Engine
) -> None:
    """An event whose three delivery messages were published ten minutes ago and lost (two
    deliveries pending, one processing with an expired lease), and a finished event of an
    hour ago: one pass queues each lost delivery once and nothing for either event's key,
    which stay `fanned_out` as they were; `stuck` lists the three deliveries, never an event;
    the stats count the events as fanned out, the deliveries by destination."""
    db = own_database
    lost = seed_fan_out_event(
        db,
        "inv-lost",
        {"books": "pending", "finance-flow": "pending", "notify": "processing"},
        queued=True,
        age="10 minutes",
    )
    query(
        db,
        "UPDATE outbox SET created_at = now() - interval '10 minutes',"
        " available_at = now() - interval '10 minutes',"
        " published_at = now() - interval '10 minutes'",
    )
    done = seed_fan_out_event(
        db,
        "inv-done",
        {"books": "succeeded", "finance-flow": "succeeded", "notify": "succeeded"},
        age="1 hour",
    )
    events_before = query(
        db,
        "SELECT idempotency_key, status, updated_at FROM idempotency_keys"
        " WHERE event_key IS NULL ORDER BY 1",
    )
    assert [(k, s) for k, s, _ in events_before] == [(done, "fanned_out"), (lost, "fanned_out")]

    stuck = stats.stuck(engine, 60)
    assert sorted(row["key"].rsplit(" @", 1)[1] for row in stuck) == [
        "books",
        "finance-flow",
        "notify",
    ]

    report = sweep_once(engine, _settings(db))
    assert report is not None
    assert (report.redriven, report.leases_reclaimed) == (2, 1)
    queued = query(db, "SELECT idempotency_key FROM outbox WHERE published_at IS NULL ORDER BY 1")
    assert queued == [(delivery_key(lost, name),) for name in ("books", "finance-flow", "notify")]
    assert (
        query(
            db,
            "SELECT idempotency_key, status, updated_at FROM idempotency_keys"
            " WHERE event_key IS NULL ORDER BY 1",
        )
        == events_before
    )
    again = sweep_once(engine, _settings(db))
    assert again is not None and (again.redriven, again.leases_reclaimed) == (0, 0)

    numbers = stats.collect(engine, ["books", "finance-flow", "notify", "archive"])
    assert numbers["keys_by_status"]["fanned_out"] == 2
    assert numbers["keys_fanned_out_estimated"] is False
    assert (
        numbers["keys_by_status"]["pending"],
        numbers["keys_by_status"]["processing"],
        numbers["keys_by_status"]["succeeded"],
    ) == (2, 1, 3)
    assert numbers["destinations"]["notify"]["processing"] == 1
    assert numbers["destinations"]["books"]["pending"] == 1
    assert numbers["destinations"]["archive"] == dict.fromkeys(
        (*stats.DESTINATION_COUNTS, "open_dead_letters"), 0
    )
