"""Replays against workers that take the same keys: the interleavings are forced by hooks on
the replay's own statements, never by sleeps."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, event

from outbox.core.routes import RouteTable, load_routes
from outbox.core.settings import Settings
from outbox.operate import replay
from outbox.store.engines import create_sync_engine
from tests.support import Downstream, query, seed_pending_key, write_routes
from worker.attempt import run_attempt
from worker.store import Claim, Failed, KeyStore


@pytest.fixture
def db(own_database: str) -> str:
    """A database of this test's own: the shared stack's relay and workers never see its rows."""
    return own_database


SECRET = b"test-replay-secret"


@pytest.fixture
def engines(db: str) -> Iterator[tuple[Engine, Engine]]:
    """The operator's engine and a worker's (autocommit, like the worker's own)."""
    settings = Settings(database_url=db, redis_url="redis://unused")
    operator = create_sync_engine(settings)
    worker = create_sync_engine(settings, autocommit=True)
    yield operator, worker
    operator.dispose()
    worker.dispose()


@pytest.fixture
def routes(tmp_path: Path, downstream: Downstream) -> RouteTable:
    """The test routes against a downstream that has seen nothing yet."""
    downstream.reset()
    return load_routes(write_routes(tmp_path / "routes.toml", downstream.url))


def _hooks(engine: Engine, hooks: dict[str, Callable[[], None]]) -> None:
    """Run each hook once: `after:<n>:<text>` once the n-th statement containing <text> has
    run on `engine`, `before:<n>:<text>` just before it runs."""
    seen: Counter[tuple[str, str]] = Counter()

    wanted = {tuple(name.split(":", 2)): hook for name, hook in hooks.items()}

    def run(moment: str, statement: str) -> None:
        for text in {text for when, _, text in wanted if when == moment and text in statement}:
            seen[(moment, text)] += 1
            hook = wanted.get((moment, str(seen[(moment, text)]), text))
            if hook is not None:
                hook()

    event.listen(engine, "before_cursor_execute", lambda *a, **_: run("before", a[2]))
    event.listen(engine, "after_cursor_execute", lambda *a, **_: run("after", a[2]))


def _failed_retryable_key(db: str, external_id: str) -> str:
    """A worker key whose transient failure is due for its retry."""
    key = seed_pending_key(db, external_id)
    query(
        db,
        "UPDATE idempotency_keys SET status = 'failed_retryable', attempts = 1, "
        "error_code = 'http_503', next_attempt_at = now() - interval '1 second', "
        "updated_at = now() - interval '1 minute' WHERE idempotency_key = %s",
        (key,),
    )
    return key


def _dry_run_of_one_key(
    db: str, operator: Engine, routes: RouteTable, external_id: str
) -> tuple[str, replay.ReplayRequest]:
    """A due failed_retryable key and the replay request its dry run confirms."""
    key = _failed_retryable_key(db, external_id)
    request = replay.ReplayRequest(statuses=["failed_retryable"])
    report = replay.dry_run(operator, request, routes, secret=SECRET)
    assert report.to_replay == [key]
    return key, request.model_copy(update={"dry_run": False, "confirm": report.confirm})


def _deliver_queued(db: str, store: KeyStore, routes: RouteTable) -> None:
    """Whatever is queued is delivered now, as a worker would."""
    for (queued,) in query(db, "SELECT idempotency_key FROM outbox WHERE published_at IS NULL"):
        run_attempt(store, routes, queued, lease_seconds=30)


def test_a_key_a_worker_took_again_after_the_dry_run_is_not_reset_under_it(
    db: str, engines: tuple[Engine, Engine], routes: RouteTable, downstream: Downstream
) -> None:
    """A key that a worker claimed, failed and claimed again (and finished) between the
    replay's dry run and its reset is left alone: the downstream sees one effect, not two."""
    operator, worker = engines
    store = KeyStore(worker)
    key, confirmed = _dry_run_of_one_key(db, operator, routes, "race-1")

    # After the dry run a worker takes the key (its retry was due) and holds it.
    first = store.claim(key, "worker-1", 30)
    assert isinstance(first, Claim)

    def first_worker_fails_again() -> None:
        assert store.schedule_retry(first, 0, Failed("http_503", "refused", False, False))

    def second_worker_acts() -> None:
        assert run_attempt(store, routes, key, lease_seconds=30) == "succeeded"

    _hooks(
        operator,
        {
            # The replay has read the set: the first holder fails again, so the key looks as
            # the dry run showed it; once the replay has read the set again, another worker
            # takes the key and its effect happens.
            "after:1:lease_live": first_worker_fails_again,
            "after:2:lease_live": second_worker_acts,
        },
    )
    replay.execute(operator, confirmed, routes, "ops", secret=SECRET)
    assert downstream.effects == {key: 1}

    _deliver_queued(db, store, routes)
    assert downstream.effects == {key: 1}
    assert query(db, "SELECT status FROM idempotency_keys") == [("succeeded",)]


def test_a_key_claimed_between_the_read_and_the_reset_is_not_reset(
    db: str, engines: tuple[Engine, Engine], routes: RouteTable, downstream: Downstream
) -> None:
    """A key a worker claims and finishes just before the replay's reset statement is left
    alone (the reset checks it under the row lock), nothing is replayed, the fresh report
    shows it succeeded, and the downstream sees one effect."""
    operator, worker = engines
    store = KeyStore(worker)
    key, confirmed = _dry_run_of_one_key(db, operator, routes, "race-2")

    def worker_acts() -> None:
        assert run_attempt(store, routes, key, lease_seconds=30) == "succeeded"

    _hooks(operator, {"before:1:SET status = 'pending'": worker_acts})
    outcome = replay.execute(operator, confirmed, routes, "ops", secret=SECRET)
    assert isinstance(outcome, replay.Stale)
    assert outcome.report.to_replay == []
    assert query(db, "SELECT count(*) FROM replays") == [(0,)]
    _deliver_queued(db, store, routes)
    assert downstream.effects == {key: 1}
    assert query(db, "SELECT status FROM idempotency_keys") == [("succeeded",)]
