"""Migrations applied beside a running gateway: a migration waiting for a lock gives its place
up within its lock timeout and is tried again, and migration 0017 takes its locks in the
gateway's order (the keys, then the outbox), so it cannot deadlock with a receiver's
transaction."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from outbox.store.migrate import upgrade
from tests.support import libpq, query


@contextmanager
def _migrating(url: str, revision: str) -> Iterator[list[BaseException]]:
    """`upgrade(url, revision)` in a thread; the list holds what it raised, if anything,
    once the block is left (the thread is joined)."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            upgrade(url, revision)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield raised
    finally:
        thread.join(timeout=120)
        assert not thread.is_alive(), "the migration did not end"


def _until(found: Callable[[], bool], what: str, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not found():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def _waits_for_lock(url: str, table: str) -> Callable[[], bool]:
    """Whether some session waits for a lock on `table` (the migration's, queued)."""

    def waiting() -> bool:
        rows = query(
            url,
            "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = to_regclass(%s)",
            (table,),
        )
        return bool(rows[0][0])

    return waiting


def _connect(url: str, **options: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(libpq(url), options="-c statement_timeout=20000", **options)


def test_a_migration_waiting_for_a_lock_holds_no_reader_up(fresh_database: str) -> None:
    """A transaction holds the attempts table (as a worker's write does) while migration 0019
    needs it alone: a reader that queued behind the migration's request is served while that
    transaction still holds the table (the migration gave its place up; without a lock
    timeout the reader would wait for the holder and fail at its statement timeout), and once
    the holder ends, the migration, tried again, reaches 0019."""
    url = fresh_database
    upgrade(url, "0018")
    with _connect(url) as holder:
        holder.execute("LOCK TABLE attempts IN ROW EXCLUSIVE MODE")
        with _migrating(url, "0019") as raised:
            try:
                _until(_waits_for_lock(url, "attempts"), "the migration waits for attempts")
                with _connect(url, autocommit=True) as reader:
                    assert reader.execute("SELECT count(*) FROM attempts").fetchone() == (0,)
            finally:
                holder.rollback()
    assert raised == []
    assert query(url, "SELECT version_num FROM alembic_version") == [("0019",)]


def test_0017_holds_no_outbox_lock_while_it_waits_for_the_keys(fresh_database: str) -> None:
    """A receiver's transaction has reserved a key and not yet written its outbox row when
    migration 0017 starts: the migration waits for the keys' lock holding no lock on any
    outbox table (taken the other way round, the receiver's outbox insert and the migration
    waited for each other: a deadlock), the insert goes through and commits, and the migration
    then completes."""
    url = fresh_database
    upgrade(url, "0016")
    with _connect(url) as receiver:
        receiver.execute(
            "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id,"
            " source, event_type, route, expires_at) VALUES ('webform:k-1', 'h', 'c',"
            " 'webform', 'crm.lead', 'crm', now() + interval '1 day')"
        )
        with _migrating(url, "0017") as raised:
            try:
                _until(_waits_for_lock(url, "idempotency_keys"), "the migration waits for keys")
                held = query(
                    url,
                    "SELECT c.relname, l.mode FROM pg_locks l JOIN pg_class c ON c.oid = l.relation"
                    " WHERE l.granted AND c.relname LIKE 'outbox%%' AND l.pid IN ("
                    "   SELECT pid FROM pg_locks WHERE NOT granted"
                    "      AND relation = to_regclass('idempotency_keys'))",
                )
                receiver.execute(
                    "INSERT INTO outbox (idempotency_key, task_name, correlation_id)"
                    " VALUES ('webform:k-1', 'idem.process', 'c')"
                )
            finally:
                receiver.commit()
    assert held == []
    assert raised == []
    assert query(url, "SELECT version_num FROM alembic_version") == [("0017",)]
    assert query(url, "SELECT idempotency_key FROM outbox") == [("webform:k-1",)]
