"""A worker's connection budget depends on its pool, not on how many attempts are in flight."""

from __future__ import annotations

from outbox.core.settings import Settings
from outbox.store.connections import worker_budget


def test_threads_share_one_bounded_pool() -> None:
    """32 or 256 threads: the same WORKER_DB_POOL_SIZE + 1 connections."""
    assert worker_budget("threads", 32, 4).connections == 5
    assert worker_budget("threads", 256, 4).connections == 5


def test_prefork_pays_a_pool_per_child() -> None:
    """Under prefork every child process has its own pool."""
    budget = worker_budget("prefork", 3, 4)
    assert budget.connections == 15 and "3 process(es)" in budget.explanation


def test_concurrency_defaults_by_pool() -> None:
    """Unset WORKER_CONCURRENCY: 128 threads, or 2 processes under prefork."""
    assert Settings().concurrency() == 128
    assert Settings(worker_pool="prefork").concurrency() == 2
    assert Settings(worker_pool="prefork", worker_concurrency=5).concurrency() == 5
