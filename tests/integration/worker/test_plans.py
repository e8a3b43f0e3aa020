"""Why the server must analyse the gateway's tables, and what the bench does when it won't.

psycopg prepares a statement on its fifth run; PostgreSQL then plans it for any parameters
(a generic plan) after five more, costed on the tables' size at that moment, and keeps that
plan until the tables' statistics change. A worker that starts on a fresh database made that
plan on nearly empty tables: it reads the whole keys or events table for every claim until
something analyses the tables (autovacuum, within a minute; never, on a server with
autovacuum off, about which the sweeper warns). The bench does autovacuum's work on such a
server (`bench.autovacuum`). Counted with PostgreSQL's own scan counters, never with
timings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import psycopg
from sqlalchemy import Engine, text

from bench.autovacuum import POSTGRESQL_DEFAULTS, StandIn
from tests.support import libpq, query, seed_pending_key
from worker.siblings import claim_together, succeed_keys
from worker.store import Claim, KeyStore, success_params

# Past psycopg's prepare threshold (5) and PostgreSQL's custom plans before a generic (5).
WARM_RUNS = 12
GROWN_TO = 20_000
# PostgreSQL's defaults, but for the nap: the test runs its pass itself.
DEFAULTS = replace(POSTGRESQL_DEFAULTS, naptime_seconds=3600)
TABLES = ("idempotency_keys", "events", "outbox", "attempts")


def _counts(database_url: str, sql: str) -> dict[str, int]:
    """A statistics view's counter by name."""
    with psycopg.connect(libpq(database_url), autocommit=True) as conn:
        return {name: count for name, count in conn.execute(sql).fetchall()}


def _full_reads(database_url: str) -> dict[str, int]:
    return _counts(
        database_url,
        "SELECT relname, seq_scan FROM pg_stat_user_tables"
        " WHERE relname IN ('idempotency_keys', 'events', 'dead_letters')",
    )


def _grow(database_url: str, rows: int) -> list[str]:
    """`rows` pending keys with their events, written in one statement each."""
    query(
        database_url,
        "INSERT INTO idempotency_keys (idempotency_key, payload_hash, correlation_id, source,"
        " event_type, route, expires_at)"
        " SELECT 'grown-' || n, 'h', 'c-' || n, 'webform', 'crm.lead.created', 'crm',"
        "        now() + interval '1 day' FROM generate_series(1, %s) AS n",
        (rows,),
    )
    query(
        database_url,
        "INSERT INTO events (idempotency_key, source, event_type, external_id, payload)"
        " SELECT 'grown-' || n, 'webform', 'crm.lead.created', 'grown-' || n, '{}'"
        "   FROM generate_series(1, %s) AS n",
        (rows,),
    )
    return [f"grown-{n}" for n in range(1, rows + 1)]


def _flush_counters(engine: Engine) -> None:
    """The worker's connection reports its scans when it next goes idle: now."""
    KeyStore(engine).all(text("SELECT pg_stat_force_next_flush()"), {})


def _autovacuum_off(database_url: str) -> None:
    """This database's own: the server's autovacuum must not step in. It works on a
    partitioned table's partitions (the outbox's days), which take the setting one by one."""
    leaves = query(
        database_url,
        "SELECT relid::regclass::text FROM unnest(CAST(%s AS regclass[])) t,"
        " LATERAL pg_partition_tree(t) WHERE isleaf",
        (list(TABLES),),
    )
    for (table,) in leaves:
        query(database_url, f"ALTER TABLE {table} SET (autovacuum_enabled = false)")


def _index_scans(database_url: str, engine: Engine) -> dict[str, int]:
    _flush_counters(engine)
    return _counts(
        database_url,
        "SELECT indexrelname, idx_scan FROM pg_stat_user_indexes"
        " WHERE relname = 'idempotency_keys'",
    )


def _claims(store: KeyStore, keys: list[str], runs: int) -> None:
    """`runs` claims of two keys in one statement and `runs` of one key alone."""
    for run in range(runs):
        pair = keys[3 * run : 3 * run + 2]
        together = claim_together(store, pair, "w", 30)
        assert all(isinstance(together.claim(key, "w", 30), Claim) for key in pair)
        assert isinstance(store.claim(keys[3 * run + 2], "w", 30), Claim)


def _full_reads_during(
    database_url: str, engine: Engine, step: Callable[[], None]
) -> dict[str, int]:
    """How many times `step`, on the worker's connection, read the keys table and the events
    table from end to end; a read of every dead letter is added on the same connection and
    must be counted, so the counters are known to be live."""
    _flush_counters(engine)
    before = _full_reads(database_url)
    step()
    KeyStore(engine).all(
        text("SELECT count(*) FROM dead_letters d WHERE CAST(d AS text) <> ''"), {}
    )
    _flush_counters(engine)
    after = _full_reads(database_url)
    assert after["dead_letters"] - before["dead_letters"] == 1
    return {table: after[table] - before[table] for table in ("idempotency_keys", "events")}


def test_claims_planned_on_small_tables_read_by_key_once_the_tables_are_analysed(
    own_database: str, worker_engine: Engine
) -> None:
    """The worker's one connection claims keys while the tables hold a few dozen rows, until
    each claim statement has been planned for reuse; then they grow to 20 000 keys. Its claims
    read the whole keys or events table each time, until one pass of the bench's stand-in for
    autovacuum analyses them: from then on, by key."""
    db = own_database
    _autovacuum_off(db)
    store = KeyStore(worker_engine)
    _claims(store, [seed_pending_key(db, f"few-{n}") for n in range(3 * WARM_RUNS)], WARM_RUNS)
    grown = _grow(db, GROWN_TO)

    stale = _full_reads_during(db, worker_engine, lambda: _claims(store, grown[:15], 5))
    assert sum(stale.values()) >= 5, "the plans made on small tables no longer read them whole"

    stand_in = StandIn(DEFAULTS, lambda: [])
    try:
        stand_in.pass_over(libpq(db))
    finally:
        stand_in.stop()
    assert (db.rsplit("/", 1)[-1], "idempotency_keys", "ANALYZE") in {
        done[:3] for done in stand_in.done
    }

    after = _full_reads_during(db, worker_engine, lambda: _claims(store, grown[15:30], 5))
    assert after == {"idempotency_keys": 0, "events": 0}
    assert query(db, "SELECT count(*) FROM idempotency_keys WHERE status = 'processing'") == [
        (3 * WARM_RUNS + 30,)
    ]


def test_shared_successes_find_their_keys_by_key_while_many_keys_are_held(
    own_database: str, worker_engine: Engine
) -> None:
    """The tables were analysed while no key was held; then 5 000 keys are held (a backlog
    being worked, or a partial index full of entries not yet vacuumed away). Successes written
    together, each statement past the point where it is planned for reuse, find their keys by
    the primary key: the index of held keys is never read for them (with the held status
    written as a constant, each of the twelve statements scanned it)."""
    db = own_database
    _autovacuum_off(db)
    grown = _grow(db, GROWN_TO)
    query(db, "ANALYZE idempotency_keys")
    query(
        db,
        "UPDATE idempotency_keys SET status = 'processing', fence = 1, lease_token = 'other',"
        " locked_until = now() + interval '1 hour' WHERE idempotency_key = ANY(%s)",
        (grown[:5000],),
    )
    store = KeyStore(worker_engine)
    pairs = [grown[5000 + 2 * run : 5002 + 2 * run] for run in range(WARM_RUNS)]
    claimed: list[list[Claim]] = []
    for pair in pairs:
        together = claim_together(store, pair, "w", 30)
        claims = [together.claim(key, "w", 30) for key in pair]
        claimed.append([claim for claim in claims if isinstance(claim, Claim)])
        assert len(claimed[-1]) == 2
    before = _index_scans(db, worker_engine)
    for claims in claimed:
        params = [success_params(claim, None, None, None) for claim in claims]
        assert succeed_keys(store, params) == {claim.key for claim in claims}
    after = _index_scans(db, worker_engine)
    assert after["idempotency_keys_processing_idx"] == before["idempotency_keys_processing_idx"]
    assert after["idempotency_keys_pkey"] - before["idempotency_keys_pkey"] >= WARM_RUNS


def test_shared_claims_find_their_keys_by_key_while_many_keys_wait(
    own_database: str, worker_engine: Engine
) -> None:
    """The tables were analysed while every key had succeeded; then 5 000 keys wait again (a
    backlog, or a partial index full of entries not yet vacuumed away). Claims of eight keys
    in one statement, each past the point where it is planned for reuse, find their keys by
    the primary key: the indexes of waiting and held keys are never read for them (with the
    rule in the update's own condition, each of the twelve statements scanned the waiting
    keys' index)."""
    db = own_database
    _autovacuum_off(db)
    grown = _grow(db, GROWN_TO)
    query(db, "UPDATE idempotency_keys SET status = 'succeeded'")
    query(db, "ANALYZE idempotency_keys")
    query(
        db,
        "UPDATE idempotency_keys SET status = 'pending' WHERE idempotency_key = ANY(%s)",
        (grown[:5000],),
    )
    store = KeyStore(worker_engine)
    before = _index_scans(db, worker_engine)
    for run in range(WARM_RUNS):
        wanted = grown[8 * run : 8 * run + 8]
        together = claim_together(store, wanted, "w", 30)
        assert all(isinstance(together.claim(key, "w", 30), Claim) for key in wanted)
    after = _index_scans(db, worker_engine)
    for index in ("idempotency_keys_waiting_idx", "idempotency_keys_processing_idx"):
        assert after[index] == before[index], index
    assert after["idempotency_keys_pkey"] - before["idempotency_keys_pkey"] >= WARM_RUNS
