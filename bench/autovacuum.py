"""Autovacuum's work on the bench's databases, when the server has autovacuum off.

A production server runs autovacuum (PostgreSQL's default). It matters for more than dead
rows: a statement psycopg prepared gets a plan for any parameters after its tenth run, costed
on the tables' size then, and only new statistics (an ANALYZE) make PostgreSQL plan it again.
On a server with autovacuum off, processes that started on the bench's fresh, empty databases
kept plans that read the whole keys table for every claim: the memory section's worker drained
123 events/s at 20 000 keys, 327 once its connections were replaced
(docs/explanation/performance.md). Such a server measures a misconfiguration, not the gateway.

So when the server's `autovacuum` is off, this thread does what the autovacuum launcher would
do for each database of the run, with the server's own settings: every `autovacuum_naptime`,
VACUUM a table whose dead rows passed `autovacuum_vacuum_threshold` plus
`autovacuum_vacuum_scale_factor` times its rows (paced by autovacuum's cost delay and limit,
which a manual VACUUM is not), and ANALYZE one whose changes since the last analysis passed the
analyze threshold and scale factor. Inserts alone never start a VACUUM here (the launcher's
insert threshold is left out; the bench's tables are updated anyway). The database server's
CPU is measured with it, as it would be with autovacuum on.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

# pg_stat_user_tables: each table's rows, dead rows and changes since its last ANALYZE.
DUE = """
SELECT s.relname, s.n_dead_tup, s.n_mod_since_analyze, greatest(c.reltuples, 0)
  FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
"""


@dataclass(frozen=True)
class Thresholds:
    """The server's autovacuum settings (postgresql.conf), read once."""

    naptime_seconds: float
    vacuum_threshold: int
    vacuum_scale: float
    analyze_threshold: int
    analyze_scale: float
    # VACUUM paced as autovacuum's is (a manual one is not).
    cost_delay_ms: float = 2.0
    cost_limit: int = 200

    def work(self, dead: int, changed: int, rows: float) -> list[str]:
        """What autovacuum would run on a table now: VACUUM, ANALYZE, both or nothing."""
        wanted = []
        if dead > self.vacuum_threshold + self.vacuum_scale * rows:
            wanted.append("VACUUM")
        if changed > self.analyze_threshold + self.analyze_scale * rows:
            wanted.append("ANALYZE")
        return wanted


# PostgreSQL's own defaults (15), for tests.
POSTGRESQL_DEFAULTS = Thresholds(
    naptime_seconds=60,
    vacuum_threshold=50,
    vacuum_scale=0.2,
    analyze_threshold=50,
    analyze_scale=0.1,
)


def server_autovacuum(admin_libpq: str) -> Thresholds | None:
    """The server's thresholds when its autovacuum is off (the bench stands in); None when it
    is on and does this itself."""
    names = (
        "autovacuum",
        "autovacuum_naptime",
        "autovacuum_vacuum_threshold",
        "autovacuum_vacuum_scale_factor",
        "autovacuum_analyze_threshold",
        "autovacuum_analyze_scale_factor",
        "autovacuum_vacuum_cost_delay",
        "autovacuum_vacuum_cost_limit",
        "vacuum_cost_limit",
    )
    with psycopg.connect(admin_libpq, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(names),)
        ).fetchall()
    found: dict[str, str] = dict(rows)
    if found["autovacuum"] == "on":
        return None
    return Thresholds(
        naptime_seconds=float(found["autovacuum_naptime"]),
        vacuum_threshold=int(found["autovacuum_vacuum_threshold"]),
        vacuum_scale=float(found["autovacuum_vacuum_scale_factor"]),
        analyze_threshold=int(found["autovacuum_analyze_threshold"]),
        analyze_scale=float(found["autovacuum_analyze_scale_factor"]),
        cost_delay_ms=float(found["autovacuum_vacuum_cost_delay"]),
        # -1: autovacuum's limit is vacuum_cost_limit's.
        cost_limit=int(found["autovacuum_vacuum_cost_limit"])
        if found["autovacuum_vacuum_cost_limit"] != "-1"
        else int(found["vacuum_cost_limit"]),
    )


class StandIn:
    """Autovacuum's passes over the databases `databases()` names, in a thread of its own."""

    def __init__(self, thresholds: Thresholds, databases: Callable[[], list[str]]) -> None:
        self.thresholds = thresholds
        self._databases = databases
        self._stop = threading.Event()
        self._began = time.monotonic()
        # (database, table, VACUUM or ANALYZE, seconds since the stand-in started)
        self.done: list[tuple[str, str, str, float]] = []
        self._thread = threading.Thread(target=self._run, name="autovacuum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.thresholds.naptime_seconds):
            for libpq_url in self._databases():
                # A database dropped or being made meanwhile is skipped until the next pass.
                with contextlib.suppress(psycopg.Error):
                    self.pass_over(libpq_url)

    def pass_over(self, libpq_url: str) -> None:
        """One launcher pass over one database."""
        with psycopg.connect(libpq_url, autocommit=True) as conn:
            conn.execute(f"SET vacuum_cost_delay = '{self.thresholds.cost_delay_ms:g}ms'")
            conn.execute(f"SET vacuum_cost_limit = {self.thresholds.cost_limit:d}")
            for table, dead, changed, rows in conn.execute(DUE).fetchall():
                for work in self.thresholds.work(dead, changed, rows):
                    conn.execute(sql.SQL("{} {}").format(sql.SQL(work), sql.Identifier(table)))
                    database = libpq_url.rsplit("/", 1)[-1]
                    self.done.append((database, table, work, time.monotonic() - self._began))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
