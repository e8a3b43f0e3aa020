"""The relay's batch on real PostgreSQL and Redis: a committed claim lease, a publish with no
transaction open, takeover after a dead relay's lease, and waiting (not spinning) when another
relay holds the due rows."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis as redis_client
from celery import Celery
from sqlalchemy import Engine

from outbox.core.keys import delivery_key
from outbox.core.settings import Settings
from outbox.core.wire import PROCESS_KEYS_TASK, PROCESS_TASK, TASK_QUEUE
from outbox.relay.loop import IDLE_FLOOR_SECONDS, publish_due_batch, run_relay
from outbox.relay.publisher import OutboxMessage, create_publisher, publish
from outbox.store import relay as queries
from outbox.store.engines import create_relay_engine
from tests.support import (
    query,
    queued_tasks,
    seed_due_outbox,
    seed_fan_out_event,
    statements_sent,
)

CLAIM_SECONDS = 30.0


def _count(db: str, where: str) -> int:
    return int(query(db, f"SELECT count(*) FROM outbox WHERE {where}")[0][0])


@pytest.fixture
def settings(own_database: str, own_redis: str) -> Settings:
    # A lead of a minute: taken at the first pass, not due again within a test's passes.
    return Settings(
        database_url=own_database,
        redis_url=own_redis,
        relay_poll_seconds=1.0,
        relay_lead_seconds=60.0,
    )


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    engine = create_relay_engine(settings)
    yield engine
    engine.dispose()


@pytest.fixture
def app(settings: Settings) -> Celery:
    return create_publisher(settings)


@pytest.fixture
def queue(own_redis: str) -> Iterator[redis_client.Redis[Any]]:
    client: redis_client.Redis[Any] = redis_client.Redis.from_url(own_redis)
    client.unlink(TASK_QUEUE)
    yield client
    client.unlink(TASK_QUEUE)
    client.close()


def test_the_claim_is_committed_and_no_transaction_is_open_while_publishing(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """While the relay sends a batch, its rows are already held (seen from another
    connection) and none of the database's connections is idle in a transaction."""
    db = own_database
    seed_due_outbox(db, 20)
    seen: dict[str, int] = {}

    def send(app: Celery, messages: list[OutboxMessage], sent: list[int]) -> None:
        seen["held"] = _count(db, "claimed_until > now() AND published_at IS NULL")
        seen["in_transaction"] = int(
            query(
                db,
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND state LIKE 'idle in transaction%%'",
            )[0][0]
        )
        publish(app, messages, sent)

    batch = publish_due_batch(engine, app, 500, CLAIM_SECONDS, send)

    assert (batch.taken, batch.published) == (20, 20)
    assert seen == {"held": 20, "in_transaction": 0}
    assert queue.llen(TASK_QUEUE) == 20
    assert _count(db, "published_at IS NOT NULL AND claimed_until IS NULL") == 20
    assert query(db, "SELECT min(publish_attempts), max(publish_attempts) FROM outbox") == [(1, 1)]


def test_a_failed_publish_gives_the_rows_back(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """A broker error during the send leaves every row of the batch unpublished and free for
    the next pass, not held until the lease ends."""
    db = own_database
    seed_due_outbox(db, 5)

    def refuse(app: Celery, messages: list[OutboxMessage], sent: list[int]) -> None:
        raise ConnectionError("broker away")

    with pytest.raises(ConnectionError):
        publish_due_batch(engine, app, 500, CLAIM_SECONDS, refuse)

    assert _count(db, "published_at IS NULL AND claimed_until IS NULL") == 5
    again = publish_due_batch(engine, app, 500, CLAIM_SECONDS)
    assert (again.taken, again.published) == (5, 5)
    assert queue.llen(TASK_QUEUE) == 5


def test_the_mark_tells_when_the_next_row_falls_due(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """The statement that marks a batch answers the idle check too (one round trip fewer per
    pass): the rows it marks do not count, a row due in a minute does; with nothing left it
    answers None."""
    db = own_database
    seed_due_outbox(db, 3)
    query(db, "UPDATE outbox SET available_at = now() + interval '60 seconds' WHERE id = 3")
    batch = publish_due_batch(engine, app, 500, CLAIM_SECONDS)
    assert (batch.taken, batch.published, batch.knows_next_due) == (2, 2, True)
    assert batch.next_due is not None and 55 < batch.next_due <= 60
    query(db, "UPDATE outbox SET available_at = now() WHERE id = 3")
    last = publish_due_batch(engine, app, 500, CLAIM_SECONDS)
    assert (last.taken, last.knows_next_due, last.next_due) == (1, True, None)
    assert queue.llen(TASK_QUEUE) == 3
    # Nothing taken: the loop asks its own statement.
    assert publish_due_batch(engine, app, 500, CLAIM_SECONDS).knows_next_due is False


def test_a_connection_the_server_dropped_costs_a_resent_statement_not_a_pass(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """The relay pings before nothing: when the server drops its connection between passes
    (a restart, an idle cut), the next pass's statements go again on a fresh connection, and
    so does the mark after a drop during the send. Each row is published once, and marked."""
    db = own_database
    seed_due_outbox(db, 10)

    def drop() -> int:
        return len(
            query(
                db,
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND application_name = 'idem-relay'",
            )
        )

    assert publish_due_batch(engine, app, 5, CLAIM_SECONDS).published == 5
    assert drop() == 1

    def send_then_drop(app: Celery, messages: list[OutboxMessage], sent: list[int]) -> None:
        publish(app, messages, sent)
        assert drop() == 1

    second = publish_due_batch(engine, app, 5, CLAIM_SECONDS, send_then_drop)
    assert (second.taken, second.published) == (5, 5)
    assert queue.llen(TASK_QUEUE) == 10
    assert _count(db, "published_at IS NOT NULL AND claimed_until IS NULL") == 10
    assert query(db, "SELECT min(publish_attempts), max(publish_attempts) FROM outbox") == [(1, 1)]


def test_rows_of_a_relay_that_died_mid_publish_are_taken_after_its_lease(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """Rows a relay took and never marked stay with it while its lease runs, then another
    relay publishes every one of them exactly once."""
    db = own_database
    seed_due_outbox(db, 30)
    # The dead relay: it took the rows (committed) and never came back.
    query(
        db,
        str(queries.CLAIM_DUE_OUTBOX)
        .replace(":limit", "500")
        .replace(":lease_seconds", "30")
        .replace(":traced", "false"),
    )

    held = publish_due_batch(engine, app, 500, CLAIM_SECONDS)
    assert (held.taken, queue.llen(TASK_QUEUE)) == (0, 0)

    # Its lease ends (moved by the database clock rather than waited for).
    query(db, "UPDATE outbox SET claimed_until = now() - interval '1 second'")
    taken = publish_due_batch(engine, app, 500, CLAIM_SECONDS)

    assert (taken.taken, taken.published) == (30, 30)
    ids = [json.loads(m)["headers"]["id"] for m in queue.lrange(TASK_QUEUE, 0, -1)]
    assert len(ids) == len(set(ids)) == 30
    assert _count(db, "published_at IS NULL") == 0
    assert query(db, "SELECT min(publish_attempts), max(publish_attempts) FROM outbox") == [(2, 2)]


def test_an_events_deliveries_go_in_one_message_and_later_rows_alone(
    own_database: str, engine: Engine, app: Celery, queue: redis_client.Redis[Any]
) -> None:
    """The first rows of an event's three deliveries, taken in one batch, are ONE
    `idem.process_keys` message naming the three keys, every row marked published; a key
    that is no delivery goes alone. Rows added later for the deliveries (a retry, a replay)
    go as single-key messages, even two of one event in one batch."""
    db = own_database
    names = ("books", "finance-flow", "notify")
    event = seed_fan_out_event(db, "inv-1", dict.fromkeys(names, "pending"), queued=True)
    seed_due_outbox(db, 1)
    keys = [delivery_key(event, name) for name in names]

    batch = publish_due_batch(engine, app, 500, CLAIM_SECONDS)

    assert (batch.taken, batch.published) == (4, 4)
    assert sorted(queued_tasks(queue)) == [(PROCESS_TASK, ["k-1"]), (PROCESS_KEYS_TASK, [keys])]
    assert _count(db, "published_at IS NULL") == 0

    queue.unlink(TASK_QUEUE)
    query(
        db,
        "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
        " SELECT idempotency_key, 'idem.process', correlation_id FROM idempotency_keys"
        " WHERE idempotency_key = ANY(%(keys)s)",
        {"keys": keys[:2]},
    )
    again = publish_due_batch(engine, app, 500, CLAIM_SECONDS)
    assert (again.taken, again.published) == (2, 2)
    assert sorted(queued_tasks(queue)) == [(PROCESS_TASK, [key]) for key in sorted(keys[:2])]


class CountingWaiter:
    """Stands in for the LISTEN connection: records each wait and the statements the relay
    sent since the previous one, and stops the relay after `waits` waits (or at a rest)."""

    def __init__(self, stop: threading.Event, waits: int) -> None:
        self.stop = stop
        self.waits = waits
        self.statements = 0
        self.log: list[tuple[float, int]] = []
        self.rests = 0

    def wait(self, timeout: float) -> None:
        self.log.append((timeout, self.statements))
        self.statements = 0
        if len(self.log) >= self.waits:
            self.stop.set()

    def rest(self, timeout: float) -> None:
        # A relay alone holds the lead and never stands by. Raising here would be caught by
        # the loop's outage handling and loop on; stop instead, and the test asserts none.
        self.rests += 1
        self.stop.set()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("held_by", ["lease", "row lock"])
def test_a_relay_waits_while_another_holds_the_due_rows(
    held_by: str,
    own_database: str,
    settings: Settings,
    engine: Engine,
    app: Celery,
    queue: redis_client.Redis[Any],
) -> None:
    """When every due row is held by another relay (its lease, or a lock of a statement in
    progress), each pass of the loop sends two statements and then waits, never zero seconds:
    no busy loop, and nothing published."""
    db = own_database
    seed_due_outbox(db, 50)
    blocker = None
    if held_by == "lease":
        query(db, "UPDATE outbox SET claimed_until = now() + interval '1 hour'")
    else:
        import psycopg

        from tests.support import libpq

        blocker = psycopg.connect(libpq(db))
        blocker.execute("SELECT id FROM outbox FOR UPDATE")
    stop = threading.Event()
    waiter = CountingWaiter(stop, waits=20)

    lead_checks = 0

    def count(_cursor: Any, statement: str, _params: Any) -> None:
        nonlocal lead_checks
        if "relay_lead" in statement:
            lead_checks += 1  # the relays' lead (tests/integration/relay/test_lead.py)
            return
        waiter.statements += 1
        if waiter.statements > 100:
            stop.set()  # a spin: end the loop so the assertions below say so

    try:
        with statements_sent(engine, count):
            run_relay(settings, engine, app, stop, listener=waiter)
    finally:
        if blocker is not None:
            blocker.close()

    assert waiter.rests == 0
    assert len(waiter.log) == 20
    # Claim, then "when is the next row due", then a wait: per pass, never more.
    assert all(statements == 2 for _, statements in waiter.log)
    # The lead: taken at the first pass, given up at the stop, not asked for in between.
    assert lead_checks == 2
    floor = settings.relay_poll_seconds if held_by == "lease" else IDLE_FLOOR_SECONDS
    assert all(timeout >= floor for timeout, _ in waiter.log)
    assert queue.llen(TASK_QUEUE) == 0


def test_sigterm_ends_the_relay_in_the_middle_of_a_long_wait(private_stack: Any) -> None:
    """A relay idling in a 60 s poll stops when SIGTERM comes, not when the poll ends: the
    signal wakes its LISTEN wait (a supervisor's stop and every test teardown wait on this)."""
    import signal
    import time

    stack = private_stack
    stack.extra_env["RELAY_POLL_SECONDS"] = "60"
    stack.start_relay()
    process = stack.processes["relay"]
    deadline = time.monotonic() + 30
    while '"relay.started"' not in stack.logs("relay") and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1.0)  # into its idle wait
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    assert '"relay.stopped"' in stack.logs("relay")
    # It left its wait because of the signal: its only idle wait was to last a minute.
    lines = [json.loads(line) for line in stack.logs("relay").splitlines() if "relay." in line]
    assert [line["event"] for line in lines][-1] == "relay.stopped"


def test_the_loop_sends_a_batch_in_messages_of_keys_per_message(
    own_database: str, settings: Settings, engine: Engine, app: Celery, queue: Any
) -> None:
    """Three full batches are due: the relay loop (its own send, from the settings) sends
    each batch's rows in messages of RELAY_KEYS_PER_MESSAGE keys, every key once."""
    seed_due_outbox(own_database, 30)
    packing = settings.model_copy(update={"relay_batch_size": 10, "relay_keys_per_message": 4})
    stop = threading.Event()

    run_relay(packing, engine, app, stop, listener=CountingWaiter(stop, waits=1))

    tasks = queued_tasks(queue)
    assert [(name, len(args[0])) for name, args in tasks] == [
        (PROCESS_KEYS_TASK, 4),
        (PROCESS_KEYS_TASK, 4),
        (PROCESS_KEYS_TASK, 2),
    ] * 3
    assert sorted(key for _, args in tasks for key in args[0]) == sorted(
        f"k-{n}" for n in range(1, 31)
    )
    assert _count(own_database, "published_at IS NULL") == 0


def test_after_a_pass_that_published_the_next_waits_for_rows_to_gather(
    own_database: str, settings: Settings, engine: Engine, app: Celery, queue: Any
) -> None:
    """A pass that published rows without filling its batch is followed by
    RELAY_GATHER_SECONDS of waiting before the next pass takes rows, so that rows accepted
    meanwhile are taken, and packed, together; the gather comes before the pass's idle wait,
    not in its place (each of the two passes is followed by one wait)."""
    seed_due_outbox(own_database, 1)
    gathering = settings.model_copy(update={"relay_gather_seconds": 0.5})
    stop = threading.Event()
    waiter = CountingWaiter(stop, waits=2)
    passes: list[float] = []

    def count(_cursor: Any, statement: str, _params: Any) -> None:
        if "-- Take a batch of due, unpublished rows" in statement:
            passes.append(time.monotonic())

    with statements_sent(engine, count):
        run_relay(gathering, engine, app, stop, listener=waiter)

    assert queued_tasks(queue) == [(PROCESS_TASK, ["k-1"])]
    # Two passes (the second took nothing), each followed by one idle wait: the gather came
    # between them, after the publish, not in place of a wait.
    assert len(passes) == 2 and len(waiter.log) == 2
    assert passes[1] - passes[0] >= 0.5
