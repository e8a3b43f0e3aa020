"""Attempts of one process sharing their claim and success statements (`worker.grouped`) on
real PostgreSQL: a batch forms only behind a statement in flight, each key in it is taken,
refused or written exactly as alone, and a key twice in one batch shares it once.

A statement is held in flight by a row lock another connection keeps on its key, so the
attempts that arrive meanwhile queue behind it, as they do under load."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from outbox.core.routes import RouteTable
from outbox.core.settings import Settings
from tests.support import libpq, query, refuse_shared_successes, seed_pending_key, wait_until
from worker.app import Runtime
from worker.grouped import Combiner, GroupedStore
from worker.siblings import claim_together
from worker.store import Blocked, Claim, KeyStore

LEASE = 30.0
# Each statement by the start of its first comment line (a parameter in it is sent rewritten).
CLAIM_ONE = "-- Take a key of this actor that nobody holds"
CLAIM_MANY = "-- Take each of"
SUCCEED_ONE = "-- The effect happened: store the result"
SUCCEED_MANY = "-- Several effects happened"


def sent(statements: Counter[str], prefix: str) -> int:
    """How many statements whose first comment line starts with `prefix` ran."""
    return sum(n for line, n in statements.items() if line.startswith(prefix))


@contextmanager
def row_locked(database_url: str, key: str) -> Iterator[None]:
    """Another transaction holds `key`'s row until the block ends."""
    with psycopg.connect(libpq(database_url)) as conn:
        conn.execute("SELECT 1 FROM idempotency_keys WHERE idempotency_key = %s FOR UPDATE", (key,))
        yield
        conn.rollback()


def lock_waits(database_url: str) -> int:
    """Statements of this database waiting for a row lock."""
    rows = query(
        database_url,
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE wait_event_type = 'Lock' AND datname = current_database()",
    )
    return int(rows[0][0])


def in_threads(calls: Sequence[Callable[..., Any]]) -> tuple[list[threading.Thread], list[Any]]:
    answers: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        answers[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    return threads, answers


def joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join(20)
        assert not thread.is_alive()


def behind_one_in_flight(
    database_url: str,
    locked: str,
    lead: Callable[[], Any],
    calls: Sequence[Callable[[], Any]],
    combiner: Combiner[Any, Any],
) -> tuple[Any, list[Any]]:
    """Run `lead`, whose statement waits on `locked`'s row lock, then `calls`, which queue
    behind it on `combiner`; once all are queued, let the lock go and wait for every one.
    Returns the lead's answer and the calls' answers."""
    with row_locked(database_url, locked):
        head, head_answer = in_threads([lead])
        wait_until(lambda: lock_waits(database_url) == 1, timeout=20, interval=0.01)
        behind, answers = in_threads(calls)
        wait_until(lambda: combiner.waiting() == len(calls), timeout=20, interval=0.01)
    joined(head + behind)
    return head_answer[0], answers


def test_claims_arriving_behind_one_in_flight_share_the_next_statement(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """A claim waits on a row lock; three more arrive meanwhile and go in one statement, each
    held with its own token and holder. Alone, a claim is the single-key statement."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    first = seed_pending_key(db, "first")
    keys = [seed_pending_key(db, f"behind-{n}") for n in range(3)]

    calls = [partial(store.claim, k, f"w-{n}", LEASE) for n, k in enumerate(keys)]
    head_answer, answers = behind_one_in_flight(
        db, first, lambda: store.claim(first, "w-head", LEASE), calls, store._claims
    )

    assert isinstance(head_answer, Claim)
    assert all(isinstance(a, Claim) for a in answers)
    assert len({a.token for a in answers}) == 3
    assert [a.owner for a in answers] == ["w-0", "w-1", "w-2"]
    assert sent(statements, CLAIM_ONE) == 1 and sent(statements, CLAIM_MANY) == 1
    assert query(
        db,
        "SELECT idempotency_key, status, fence, attempts, lease_owner FROM idempotency_keys"
        " WHERE idempotency_key LIKE '%behind%' ORDER BY idempotency_key",
    ) == [(k, "processing", 1, 1, f"w-{n}") for n, k in enumerate(keys)]


def test_a_key_delivered_twice_into_one_batch_is_claimed_once(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """Two deliveries of one key queue behind the same statement: one holds it, the other is
    refused as a live lease (its reason asked as for one key), and the key is claimed once."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    first = seed_pending_key(db, "first")
    twice, other = seed_pending_key(db, "twice"), seed_pending_key(db, "other")

    _, answers = behind_one_in_flight(
        db,
        first,
        lambda: store.claim(first, "w-head", LEASE),
        [
            lambda: store.claim(twice, "w-a", LEASE),
            lambda: store.claim(twice, "w-b", LEASE),
            lambda: store.claim(other, "w-c", LEASE),
        ],
        store._claims,
    )

    held = [a for a in answers[:2] if isinstance(a, Claim)]
    refused = [a for a in answers[:2] if isinstance(a, Blocked)]
    assert len(held) == 1 and [(r.status, r.lease_live) for r in refused] == [("processing", True)]
    assert isinstance(answers[2], Claim)
    assert sent(statements, CLAIM_MANY) == 1 and sent(statements, CLAIM_ONE) == 2
    assert query(
        db,
        "SELECT attempts, fence, blocked_deliveries FROM idempotency_keys"
        " WHERE idempotency_key = %s",
        (twice,),
    ) == [(1, 1, 1)]


def test_successes_behind_one_in_flight_are_one_write_each_under_its_own_fence(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """Behind a success waiting on a row lock: a stale holder's success, the new holder's
    success of the same key and another key's. The stale one writes nothing, the new holder's
    lands (alone: a key shares a statement once), the other key's shares the stale one's."""
    db = own_database
    plain = KeyStore(worker_engine)
    store = GroupedStore(worker_engine, LEASE)
    first, taken, other = (seed_pending_key(db, name) for name in ("first", "taken", "other"))
    head_claim, stale, other_claim = (plain.claim(k, "w", LEASE) for k in (first, taken, other))
    query(
        db,
        "UPDATE idempotency_keys SET locked_until = now() - interval '1 second',"
        " in_flight_until = NULL"
        " WHERE idempotency_key = %s",
        (taken,),
    )
    fresh = plain.claim(taken, "w2", LEASE)
    assert isinstance(stale, Claim) and isinstance(fresh, Claim)
    assert isinstance(head_claim, Claim) and isinstance(other_claim, Claim)
    assert fresh.fence == stale.fence + 1

    head_answer, answers = behind_one_in_flight(
        db,
        first,
        lambda: store.succeed(head_claim, {"n": 0}, None),
        [
            lambda: store.succeed(stale, {"by": "stale"}, "stale"),
            lambda: store.succeed(fresh, {"by": "fresh"}, "fresh"),
            lambda: store.succeed(other_claim, {"by": "other"}, "other"),
        ],
        store._successes,
    )

    assert head_answer is True
    assert answers == [False, True, True]
    assert sent(statements, SUCCEED_ONE) == 2 and sent(statements, SUCCEED_MANY) == 1
    assert query(
        db,
        "SELECT idempotency_key, status, fence, external_ref FROM idempotency_keys"
        " ORDER BY idempotency_key",
    ) == sorted(
        [
            (first, "succeeded", 1, None),
            (taken, "succeeded", 2, "fresh"),
            (other, "succeeded", 1, "other"),
        ]
    )


def test_a_shared_write_that_fails_is_sent_again_by_each_attempt_alone(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """The shared statement fails (the attempt log refuses it, as a full disk would): each of
    its attempts then writes alone, and every success lands once."""
    db = own_database
    plain = KeyStore(worker_engine)
    store = GroupedStore(worker_engine, LEASE)
    keys = [seed_pending_key(db, f"refused-{n}") for n in range(4)]
    claims = [c for c in (plain.claim(k, "w", LEASE) for k in keys) if isinstance(c, Claim)]
    assert len(claims) == 4
    refuse_shared_successes(db)

    _, answers = behind_one_in_flight(
        db,
        keys[0],
        lambda: store.succeed(claims[0], {"n": 0}, None),
        [partial(store.succeed, c, {"n": 1}, None) for c in claims[1:]],
        store._successes,
    )

    assert answers == [True, True, True]
    assert sent(statements, SUCCEED_MANY) == 1 and sent(statements, SUCCEED_ONE) == 4
    assert query(db, "SELECT status, count(*) FROM idempotency_keys GROUP BY 1") == [
        ("succeeded", 4)
    ]
    assert query(db, "SELECT count(*) FROM attempts WHERE outcome = 'succeeded'") == [(4,)]


def test_an_error_of_a_statement_sent_alone_is_its_attempts_own() -> None:
    """A statement sent alone raises in its attempt, as the store's own would; the next
    attempt is not held up by it."""
    calls: list[str] = []

    def alone(item: str) -> str:
        calls.append(item)
        if item == "bad":
            raise RuntimeError("refused")
        return item.upper()

    combiner: Combiner[str, str] = Combiner(alone, lambda items: [i.upper() for i in items])
    with pytest.raises(RuntimeError, match="refused"):
        combiner.submit("bad")
    assert combiner.submit("good") == "GOOD"
    assert calls == ["bad", "good"] and combiner.waiting() == 0


def test_a_worker_process_claims_and_records_through_the_grouped_store(own_database: str) -> None:
    """The worker's runtime hands every attempt the grouped store, with the process's lease
    (a claim under another lease would be sent alone), and a claim through it holds the key."""
    settings = Settings(database_url=own_database, redis_url="redis://x", lease_seconds=7)
    runtime = Runtime(settings=settings, routes=RouteTable([]))
    store = runtime.store()
    try:
        assert isinstance(store, GroupedStore) and store.lease_seconds == 7
        key = seed_pending_key(own_database, "through-runtime")
        claim = store.claim(key, "w", 7)
        assert isinstance(claim, Claim) and store.succeed(claim, {"ok": True}, None)
        assert query(own_database, "SELECT status FROM idempotency_keys") == [("succeeded",)]
    finally:
        store.engine.dispose()


def test_a_worker_process_keeps_every_connection_it_opened(own_database: str) -> None:
    """A peak that takes all of a worker process's connections (its WORKER_DB_POOL_SIZE and
    the one more its budget counts) opens none at the next: a connection closed when it came
    back would be a new backend at the next peak, a fork and cold caches for the database."""
    settings = Settings(database_url=own_database, redis_url="redis://x", worker_db_pool_size=2)
    engine = Runtime(settings=settings, routes=RouteTable([])).store().engine
    backends: list[set[int]] = []
    try:
        for _ in range(3):
            with ExitStack() as peak:
                held = [peak.enter_context(engine.connect()) for _ in range(3)]
                backends.append(
                    {c.execute(text("SELECT pg_backend_pid()")).scalar_one() for c in held}
                )
        assert [len(pids) for pids in backends] == [3, 3, 3]
        assert backends[0] == backends[1] == backends[2]
    finally:
        engine.dispose()


def test_one_key_parts_of_messages_share_the_process_statements(
    own_database: str, worker_engine: Engine, statements: Counter[str]
) -> None:
    """Under a backlog a message's keys start one at a time, as slots free: each such part is
    claimed, and its success written, through the process's statements, so parts of several
    messages arriving behind one in flight share the next (not one statement per key)."""
    db = own_database
    store = GroupedStore(worker_engine, LEASE)
    first = seed_pending_key(db, "first")
    keys = [seed_pending_key(db, f"part-{n}") for n in range(3)]

    calls = [partial(claim_together, store, [k], f"w-{n}", LEASE) for n, k in enumerate(keys)]
    _, parts = behind_one_in_flight(
        db, first, lambda: store.claim(first, "w-head", LEASE), calls, store._claims
    )
    assert sent(statements, CLAIM_ONE) == 1 and sent(statements, CLAIM_MANY) == 1
    pairs = list(zip(parts, keys, strict=True))
    claims = [part.claim(k, f"w-{n}", LEASE) for n, (part, k) in enumerate(pairs)]
    assert all(isinstance(c, Claim) for c in claims)

    head_claim = store.claim(seed_pending_key(db, "second"), "w-head", LEASE)
    assert isinstance(head_claim, Claim)
    done = zip(parts, claims, strict=True)
    _, answers = behind_one_in_flight(
        db,
        head_claim.key,
        lambda: store.succeed(head_claim, {"n": 0}, None),
        [partial(part.succeed, c, {"n": 1}, None) for part, c in done],
        store._successes,
    )
    assert answers == [True, True, True]
    assert sent(statements, SUCCEED_ONE) == 1 and sent(statements, SUCCEED_MANY) == 1
    assert query(
        db,
        "SELECT count(*) FROM idempotency_keys WHERE idempotency_key LIKE '%part-%'"
        " AND status = 'succeeded' AND fence = 1",
    ) == [(3,)]
