"""Migration 0010 on real PostgreSQL: keys stored before namespaces are moved into their source's
namespace, their rows follow, and a repeat sent as before is still a repeat."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from alembic import command
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.core import keys
from outbox.ingest.envelope import Envelope
from outbox.store.migrate import alembic_config, upgrade
from tests.support import Stack, envelope, libpq, query

BEFORE = "0009"

# Sources that slug awkwardly: spaces, ":", characters next to the slug's ranges in ASCII,
# non-ASCII letters (one that casefolds to two), emoji, and lengths around the 40 cut.
AWKWARD_SOURCES = [
    "billing",
    "webform",
    "a.b_c-1",
    "my app",
    "my-app",
    "my:app",
    "shop:eu",
    "`{/@[~",
    "café",
    "strasse",
    "ß",
    "i̇x",
    "ǰ",
    "\U0001f600 shop",
    "ÉCOLE",
    "x" * 40,
    "x" * 41,
    "y" * 50,
    "é" * 50,
    "a\tb",
]
AWKWARD_KEYS = ["o-77", "billing:o-77", "my-app:o-1", "my-app:t.x:" + "b" * 64, "~", ":"]


@pytest.fixture(scope="module")
def sql(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    """One connection to a database at head, where the two functions are."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        yield conn


def _both(conn: psycopg.Connection[Any], source: str, key: str) -> tuple[str, str]:
    row = conn.execute(
        "SELECT key_namespace(%s), namespaced_key(%s, %s)", (source, source, key)
    ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_the_sql_namespace_is_the_python_one(sql: psycopg.Connection[Any]) -> None:
    """`key_namespace` and `namespaced_key` in the database give exactly what
    `keys.source_namespace` and `keys.scoped_client_key` give, for awkward sources and keys."""
    for source in AWKWARD_SOURCES:
        for key in AWKWARD_KEYS:
            python = (keys.source_namespace(source), keys.scoped_client_key(source, key))
            assert _both(sql, source, key) == python, (source, key)


# Any text PostgreSQL can store (no NUL, no lone surrogate), and keys as the header allows.
_STORABLE = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")


@settings(max_examples=300, deadline=None)
@given(
    st.text(_STORABLE, min_size=1, max_size=60),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=80),
)
def test_the_sql_namespace_agrees_on_any_text(
    sql: psycopg.Connection[Any], source: str, key: str
) -> None:
    """The same agreement over generated sources and keys."""
    assert _both(sql, source, key) == (
        keys.source_namespace(source),
        keys.scoped_client_key(source, key),
    )


def _hash(document: dict[str, Any]) -> str:
    return Envelope.model_validate(document).payload_hash(fold_external_id_case=False)


# The backlog: keys `evt-1`..`evt-n` with an event and an outbox row each, every tenth with a
# dead letter, as `webform` clients' own keys were stored before namespaces.
_BACKLOG = [
    """
    INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,
                                  event_type, route, expires_at)
    SELECT 'evt-' || i, 'h', 'c', 'webform', 'crm.lead.created', 'crm', now() + interval '30 days'
      FROM generate_series(1, %(n)s) AS i
    """,
    """
    INSERT INTO events (idempotency_key, source, event_type, external_id, payload)
    SELECT 'evt-' || i, 'webform', 'crm.lead.created', 'x-' || i, '{}'
      FROM generate_series(1, %(n)s) AS i
    """,
    """
    INSERT INTO outbox (idempotency_key, task_name, correlation_id)
    SELECT 'evt-' || i, 'process_event', 'c' FROM generate_series(1, %(n)s) AS i
    """,
    """
    INSERT INTO dead_letters (idempotency_key, kind, error_code, attempts, first_failed_at,
                              last_failed_at)
    SELECT 'evt-' || i, 'permanent', 'http_400', 1, now(), now()
      FROM generate_series(10, %(n)s, 10) AS i
    """,
]


def _seed(url: str, backlog: int) -> dict[str, Any]:
    """Keys as the previous release stored them: `backlog` client keys of `webform` (each with
    its event and outbox row, every tenth with a dead letter), and the cases to watch."""
    succeeded = envelope("done-1")
    spaced = envelope("sp-1", "noop.created", source="My App")
    spaced_client = envelope("sp-2", "noop.created", source="My App")
    derived = keys.derive_key("webform", "crm.lead.created", "derived-1")
    old_spaced = "my-app:noop.created:" + keys.derive_key("my app", "noop.created", "sp-1")[-64:]
    with psycopg.connect(libpq(url), autocommit=True) as conn:
        for statement in _BACKLOG:
            conn.execute(statement, {"n": backlog})
        rows = [
            # (key, source, event_type, route, actor, status, payload_hash)
            (
                "pre-1",
                "webform",
                "crm.lead.created",
                "crm",
                "worker",
                "succeeded",
                _hash(succeeded),
            ),
            ("webform:own-1", "webform", "crm.lead.created", "crm", "worker", "pending", "h"),
            (derived, "webform", "crm.lead.created", "crm", "worker", "pending", "h"),
            (old_spaced, "my app", "noop.created", "default", "worker", "succeeded", _hash(spaced)),
            (
                "sp-client",
                "my app",
                "noop.created",
                "default",
                "worker",
                "succeeded",
                _hash(spaced_client),
            ),
            ("billing:o-77", "billing", "(claims)", "(claims)", "workflow", "pending", "h"),
            # Both forms of one key were stored: the bare one cannot move.
            ("dup-1", "webform", "crm.lead.created", "crm", "worker", "pending", "h"),
            ("webform:dup-1", "webform", "crm.lead.created", "crm", "worker", "pending", "h"),
        ]
        for key, source, event_type, route, actor, status, digest in rows:
            conn.execute(
                "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id,"
                " source, event_type, route, actor, status, result, expires_at)"
                " VALUES (%s, %s, 'corr-before', %s, %s, %s, %s, %s, %s,"
                " now() + interval '30 days')",
                (
                    key,
                    digest,
                    source,
                    event_type,
                    route,
                    actor,
                    status,
                    json.dumps({"status_code": 201}) if status == "succeeded" else None,
                ),
            )
    return {
        "succeeded": succeeded,
        "spaced": spaced,
        "spaced_client": spaced_client,
        "derived": derived,
        "old_spaced": old_spaced,
    }


def _migrate_a_backlog(url: str, redis_url: str, routes_file: Path, tmp_path: Path, n: int) -> None:
    upgrade(url, BEFORE)
    seeded = _seed(url, n)
    upgrade(url)

    scoped = keys.source_namespace("my app")
    assert query(
        url,
        "SELECT count(*) FILTER (WHERE idempotency_key LIKE 'webform:evt-%%'),"
        " count(*) FILTER (WHERE idempotency_key LIKE 'evt-%%')"
        " FROM idempotency_keys",
    ) == [(n, 0)]
    for table, expected in (("events", n), ("outbox", n), ("dead_letters", n // 10)):
        moved = query(
            url,
            f"SELECT count(*) FILTER (WHERE idempotency_key LIKE 'webform:evt-%%'), count(*)"
            f" FROM {table} JOIN idempotency_keys USING (idempotency_key)",
        )
        assert moved == [(expected, expected)], table
    kept = {row[0] for row in query(url, "SELECT idempotency_key FROM idempotency_keys")}
    assert {
        "webform:pre-1",
        "webform:own-1",
        seeded["derived"],
        f"{scoped}:noop.created:{seeded['old_spaced'][-64:]}",
        f"{scoped}:sp-client",
        "billing:o-77",
        "dup-1",
        "webform:dup-1",
    } <= kept
    assert seeded["old_spaced"] not in kept

    receiver = Stack(url, redis_url, routes_file, tmp_path)
    receiver.start_receiver()
    try:
        with receiver.client() as client:
            answers = [
                client.post(
                    "/v1/events", json=seeded["succeeded"], headers={"Idempotency-Key": "pre-1"}
                ),
                client.post("/v1/events", json=seeded["spaced"]),
                client.post(
                    "/v1/events",
                    json=seeded["spaced_client"],
                    headers={"Idempotency-Key": "sp-client"},
                ),
            ]
            read = client.get("/v1/events/webform:evt-7")
    finally:
        receiver.stop_all()
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.headers["idempotent-replayed"] == "true"
        assert answer.json()["correlation_id"] == "corr-before"
    assert answers[0].json()["key"] == "webform:pre-1"
    assert read.status_code == 200 and read.json()["key"] == "webform:evt-7"
    assert query(url, "SELECT count(*) FROM idempotency_keys") == [(n + 8,)]

    # Down and up again: the keys stay namespaced and nothing moves twice.
    command.downgrade(alembic_config(url), BEFORE)
    upgrade(url)
    again = {row[0] for row in query(url, "SELECT idempotency_key FROM idempotency_keys")}
    assert again == kept


def test_a_backlog_of_client_keys_moves_into_namespaces_and_repeats_stay_repeats(
    fresh_database: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """A few thousand keys stored before the upgrade (several batches): client keys move under
    `webform:` with their events, outbox rows and dead letters; derived, already namespaced and
    claims keys stay; a pre-upgrade event sent again with the same header and payload is a
    repeat (200, `Idempotent-Replayed: true`, the first correlation id), and so is a derived
    event of a source whose namespace is hashed."""
    _migrate_a_backlog(fresh_database, redis_url, routes_file, tmp_path, 3_500)


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 2 000 keys a second move, with their rows, on 2 cores
def test_a_large_backlog_moves_in_batches(
    fresh_database: str, redis_url: str, routes_file: Path, tmp_path: Path
) -> None:
    """The same over 120 000 keys."""
    _migrate_a_backlog(fresh_database, redis_url, routes_file, tmp_path, 120_000)


def test_keys_moved_while_in_flight_are_counted_in_a_warning(
    fresh_database: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A key still pending, processing or waiting to retry when it moves is attempted next with
    its new Idempotency-Key: the upgrade says how many there were, so an operator who did not
    drain the workers first knows which downstream calls to look at."""
    upgrade(fresh_database, BEFORE)
    with psycopg.connect(libpq(fresh_database), autocommit=True) as conn:
        for key, status in (
            ("in-flight-1", "pending"),
            ("in-flight-2", "failed_retryable"),
            ("done-1", "succeeded"),
            ("webform:already", "pending"),
        ):
            conn.execute(
                "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id,"
                " source, event_type, route, actor, status, expires_at)"
                " VALUES (%s, 'h', 'c', 'webform', 'crm.lead.created', 'crm', 'worker', %s,"
                " now() + interval '30 days')",
                (key, status),
            )
    with caplog.at_level("INFO"):
        upgrade(fresh_database)
    messages = [record.getMessage() for record in caplog.records]
    assert "key namespaces: 3 event keys moved into their source's namespace" in messages
    assert any(
        message.startswith("key namespaces: 2 moved event keys were still in flight")
        for message in messages
    ), messages
