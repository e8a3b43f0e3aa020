"""The route's bulk steps under a statement timeout well below what one statement over the whole
backlog would need: releasing the keys an open circuit held when a trial closes it, and queueing
the keys a pause held when the route resumes. Each runs a batch per statement, finishes, touches
every key once, and an interrupted resume is finished by running it again.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import Engine

from outbox.core.routes import Route
from outbox.core.settings import Settings
from outbox.operate import routestate
from outbox.store.engines import create_sync_engine
from tests.support import libpq, query, wait_until
from worker.guard import RouteGuard
from worker.store import Claim, KeyStore

# Tens of thousands of keys: one statement over all of them takes twice the timeout (1.4 s
# here), a batch 35-70 ms (once 0.24 s), room for a busy machine.
BACKLOG = 60_000
STATEMENT_TIMEOUT = 0.7


@pytest.fixture
def tight_engine(own_database: str) -> Iterator[Engine]:
    """An autocommit engine on the test's own database whose statements time out at 0.7 s."""
    settings = Settings(database_url=own_database, db_timeout_seconds=STATEMENT_TIMEOUT)
    engine = create_sync_engine(settings, autocommit=True)
    yield engine
    engine.dispose()


def _backlog(database_url: str, status: str, error_code: str, outbox: bool) -> None:
    """BACKLOG worker keys of route `crm` waiting in `status` with `error_code` (and, when
    `outbox`, a delivery due in an hour), written in one statement each, without a timeout."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO idempotency_keys (idempotency_key, status, payload_hash, correlation_id,
                source, event_type, route, error_code, next_attempt_at, created_at, expires_at)
            SELECT 'webform:crm.lead:' || n, %s, 'h', 'c-' || n, 'webform', 'crm.lead', 'crm',
                   %s, CASE WHEN %s THEN now() + interval '1 hour' END,
                   now() - make_interval(secs => %s - n), now() + interval '30 days'
              FROM generate_series(1, %s) AS n
            """,
            (status, error_code, outbox, BACKLOG, BACKLOG),
        )
        if outbox:
            conn.execute(
                "INSERT INTO outbox (idempotency_key, task_name, correlation_id, available_at)"
                " SELECT idempotency_key, 'idem.process', correlation_id, next_attempt_at"
                " FROM idempotency_keys"
            )
        # What autovacuum does after a load this size; the planner needs it to pick indexes.
        conn.execute("ANALYZE idempotency_keys, outbox")


def _trial(key: str) -> Claim:
    now = datetime.now(UTC)
    return Claim(
        key=key,
        fence=1,
        token="t",
        attempt=1,
        correlation_id="c",
        route="crm",
        source="webform",
        event_type="crm.lead",
        external_id="1",
        version=None,
        payload={},
        locked_until=now + timedelta(seconds=5),
        claimed_at=now,
        first_failed_at=None,
        previous_status="pending",
        previous_error_code=None,
        uncertain=False,
    )


def test_a_trial_that_closes_the_circuit_releases_a_large_backlog(
    own_database: str, tight_engine: Engine
) -> None:
    """60 000 keys wait on an open circuit; a trial's success closes it and every one of them,
    with its delivery, becomes due, a batch per statement under a 0.7 s statement timeout."""
    _backlog(own_database, "failed_retryable", "circuit_open", outbox=True)
    with psycopg.connect(libpq(own_database), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO route_state (route, circuit, trial_keys, probe_until)"
            " VALUES ('crm', 'half_open', ARRAY['trial-key'], now() + interval '1 minute')"
        )
    guard = RouteGuard(KeyStore(tight_engine))
    route = Route(match="crm.*", name="crm", action="noop")
    guard.tell(route, _trial("trial-key"), None, trial=True)

    assert query(own_database, "SELECT circuit FROM route_state") == [("closed",)]
    wait_until(
        lambda: (
            query(
                own_database,
                "SELECT count(*) FROM idempotency_keys WHERE error_code = 'circuit_open'",
            )
            == [(0,)]
        ),
        timeout=120,
        interval=0.5,
    )
    due = query(
        own_database,
        "SELECT count(*) FILTER (WHERE k.next_attempt_at <= now() AND o.available_at <= now()"
        " AND k.error_code = 'circuit_closed'), count(*)"
        " FROM idempotency_keys k JOIN outbox o USING (idempotency_key)",
    )
    assert due == [(BACKLOG, BACKLOG)]


def test_resuming_a_large_held_backlog_queues_each_key_once_even_when_interrupted(
    own_database: str, tight_engine: Engine
) -> None:
    """60 000 keys a pause held: a resume under a 0.7 s statement timeout that is stopped after
    its first batch, then run again, queues every key exactly once, in batches it reports."""
    _backlog(own_database, "pending", "route_paused", outbox=False)
    assert routestate.pause(tight_engine, "crm", "maintenance", "ada")

    class Stop(Exception):
        pass

    def stop_after_first(queued: int) -> None:
        raise Stop

    with pytest.raises(Stop):
        routestate.resume(tight_engine, "crm", "ada", progress=stop_after_first)
    seen: list[int] = []
    again = routestate.resume(tight_engine, "crm", "ada", progress=seen.append)

    assert again == routestate.Resumed(changed=False, queued=BACKLOG - routestate.RESUME_BATCH)
    assert seen == sorted(seen) and len(seen) == BACKLOG // routestate.RESUME_BATCH - 1
    rows = query(
        own_database,
        "SELECT count(DISTINCT idempotency_key), count(*) FROM outbox WHERE published_at IS NULL",
    )
    assert rows == [(BACKLOG, BACKLOG)]
    assert query(
        own_database, "SELECT count(*) FROM idempotency_keys WHERE error_code = 'route_paused'"
    ) == [(0,)]
    # Deliveries go out in acceptance order: outbox ids follow the keys' creation.
    order = query(
        own_database,
        "SELECT bool_and(ordered) FROM (SELECT k.created_at >= lag(k.created_at) OVER"
        " (ORDER BY o.id) AS ordered FROM outbox o JOIN idempotency_keys k USING"
        " (idempotency_key)) s",
    )
    assert order == [(True,)]
