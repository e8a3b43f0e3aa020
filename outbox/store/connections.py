"""How many PostgreSQL connections a process may hold, and whether the server has them.

Each process kind keeps a bounded pool, independent of how many attempts or requests it has in
flight (docs/explanation/guarantees.md, "Sizing"):

    receiver   DB_POOL_SIZE (20) async + 2 sync (operators, metrics, readiness)
    relay      1 + 1 listening for NOTIFY
    sweeper    2 (+2 overflow)
    worker     (WORKER_DB_POOL_SIZE (4) + 1 for the lease keeper) per process; under prefork
               per child, times WORKER_CONCURRENCY

A process whose own budget cannot fit under the server's `max_connections` (less the
superuser-reserved ones) refuses to start and names the values; one that fits only if others
let go starts with a warning, since other processes come and go.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, text

from outbox.core.logs import get_logger

log = get_logger(__name__)

SERVER_LIMITS = text(
    """
    SELECT current_setting('max_connections')::int AS max_connections,
           current_setting('superuser_reserved_connections')::int AS reserved,
           (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')
               AS in_use
    """
)


class ConnectionBudgetError(Exception):
    """The process needs more connections than the server allows; the message says which."""


@dataclass(frozen=True)
class Budget:
    what: str
    connections: int
    explanation: str


def worker_process_connections(db_pool_size: int) -> int:
    """The connections of one worker process's pool, every one kept open once opened: its
    attempts' WORKER_DB_POOL_SIZE and one for the lease keeper, which shares the pool."""
    return db_pool_size + 1


def worker_budget(pool: str, concurrency: int, db_pool_size: int) -> Budget:
    """A worker's connections: one pool (`worker_process_connections`) per process."""
    processes = concurrency if pool == "prefork" else 1
    per_process = worker_process_connections(db_pool_size)
    return Budget(
        "worker",
        processes * per_process,
        f"WORKER_POOL={pool}: {processes} process(es) x (WORKER_DB_POOL_SIZE={db_pool_size}"
        " + 1 for the lease keeper)",
    )


def check_budget(engine: Engine, budget: Budget) -> None:
    """Refuse a budget the server can never hold; warn when it only fits if others let go."""
    with engine.connect() as conn:
        limits = conn.execute(SERVER_LIMITS).mappings().one()
    available = limits["max_connections"] - limits["reserved"]
    if budget.connections > available:
        raise ConnectionBudgetError(
            f"the {budget.what} needs up to {budget.connections} database connections"
            f" ({budget.explanation}) but PostgreSQL allows {available}"
            f" (max_connections={limits['max_connections']}"
            f" - superuser_reserved_connections={limits['reserved']})"
        )
    if budget.connections + limits["in_use"] > available:
        log.warning(
            "connections.tight",
            process=budget.what,
            needs=budget.connections,
            in_use=limits["in_use"],
            available=available,
        )
