"""A replay of a large dead-letter set under a statement timeout below the default: it
runs in batches, reports progress, can be interrupted and run again, and resets each key once."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.core.routes import RouteTable, load_routes
from outbox.core.settings import Settings
from outbox.operate import replay
from outbox.store.engines import create_sync_engine
from tests.support import query, write_routes


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


SECRET = b"test-replay-secret"
KEYS = 30_000


class Interrupted(Exception):
    """The operator pressed Ctrl-C."""


@pytest.fixture
def engine(db: str) -> Iterator[Engine]:
    """The operator's engine with a 1 s statement timeout: a third of the default, and room
    for a 500-key batch on a busy machine (the batches themselves are counted below)."""
    settings = Settings(database_url=db, redis_url="redis://unused", db_timeout_seconds=1.0)
    created = create_sync_engine(settings)
    yield created
    created.dispose()


def _dead_letters(db: str, count: int) -> None:
    """`count` failed_final worker keys, each with an open dead letter, in two statements."""
    query(
        db,
        "INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,"
        " source, event_type, route, attempts, expires_at, updated_at)"
        " SELECT 'webform:crm.lead.created:' || lpad(i::text, 6, '0'), 'failed_final', 'h',"
        " 'corr-' || i, 'webform', 'crm.lead.created', 'crm', 4, now() + interval '1 day',"
        " now() - interval '1 hour' FROM generate_series(1, %s) i",
        (count,),
    )
    query(
        db,
        "INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts,"
        " first_failed_at, last_failed_at)"
        " SELECT idempotency_key, 'retries_exhausted', 'http_503', 4, now(), now()"
        " FROM idempotency_keys",
    )


def test_a_large_dead_letter_set_is_replayed_in_batches_each_key_once(
    db: str, engine: Engine, tmp_path: Path
) -> None:
    """30 000 dead letters, 1 s statement timeout: the dry run and the execution complete;
    interrupted after a few batches and run again with the same token, every key is replayed
    exactly once, and keys that changed after the dry run are skipped and counted."""
    routes: RouteTable = load_routes(write_routes(tmp_path / "routes.toml", "http://unused"))
    _dead_letters(db, KEYS)
    request = replay.ReplayRequest(statuses=["failed_final"], limit=KEYS)
    report = replay.dry_run(engine, request, routes, secret=SECRET)
    assert len(report.to_replay) == KEYS
    # After the dry run one key is taken up by a worker and another fails anew.
    query(
        db,
        "UPDATE idempotency_keys SET status = 'processing', locked_until = now() + interval"
        " '1 minute', updated_at = now() WHERE idempotency_key LIKE '%%:000007'",
    )
    query(
        db, "UPDATE idempotency_keys SET updated_at = now() WHERE idempotency_key LIKE '%%:000009'"
    )
    confirmed = request.model_copy(update={"dry_run": False, "confirm": report.confirm})

    seen: list[tuple[int, int]] = []

    def interrupt_after_three_batches(replayed: int, of: int) -> None:
        seen.append((replayed, of))
        if len(seen) == 3:
            raise Interrupted

    with pytest.raises(Interrupted):
        replay.execute(
            engine, confirmed, routes, "ops", secret=SECRET, progress=interrupt_after_three_batches
        )
    first = query(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'pending'")[0][0]
    # The first page holds the key that failed anew (not reset); the taken one no longer matches.
    assert first == 3 * replay.REPLAY_BATCH - 1
    assert [of for _, of in seen] == [KEYS] * 3

    progress: list[int] = []
    again = replay.execute(
        engine, confirmed, routes, "ops", secret=SECRET, progress=lambda n, _: progress.append(n)
    )
    assert isinstance(again, replay.Executed)
    assert progress == sorted(progress) and progress[-1] == KEYS - first - 2
    assert again.report.changed_since_dry_run == first + 2
    assert query(db, "SELECT status, count(*) FROM idempotency_keys GROUP BY 1 ORDER BY 1") == [
        ("failed_final", 1),
        ("pending", KEYS - 2),
        ("processing", 1),
    ]
    assert query(db, "SELECT count(*), count(DISTINCT idempotency_key) FROM outbox") == [
        (KEYS - 2, KEYS - 2)
    ]
    assert query(db, "SELECT resolution, count(*) FROM dead_letters GROUP BY 1 ORDER BY 1") == [
        ("open", 2),
        ("replayed", KEYS - 2),
    ]
    assert query(db, "SELECT sum(key_count), sum(cardinality(keys)) FROM replays") == [
        (KEYS - 2, KEYS - 2)
    ]
