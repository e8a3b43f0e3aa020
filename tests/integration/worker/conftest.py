"""Fixtures of the worker's integration tests: the worker's engine, and stacks that start their own
processes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine

from outbox.core.settings import Settings
from outbox.store import embedded
from outbox.store.engines import create_sync_engine
from tests.support import Downstream, Stack, statements_sent


@pytest.fixture
def protected(
    own_database: str, downstream: Downstream, tmp_path: Path
) -> Iterator[tuple[Stack, Path]]:
    """An unstarted stack on its own database and Redis, with this module's routes; the test
    writes the routes (for its breaker settings) and starts the processes it needs."""
    downstream.reset()
    redis_process, url = embedded.start_redis(tmp_path / "redis", appendonly=False)
    stack = Stack(own_database, url, tmp_path / "routes.toml", tmp_path)
    yield stack, stack.routes_file
    stack.stop_all()
    redis_process.terminate()
    redis_process.wait(timeout=10)


@pytest.fixture
def worker_engine(own_database: str) -> Iterator[Engine]:
    # As the worker makes it: no pre-ping.
    engine = create_sync_engine(
        Settings(database_url=own_database, redis_url="redis://x"), pre_ping=False, autocommit=True
    )
    yield engine
    engine.dispose()


@pytest.fixture
def statements(worker_engine: Engine) -> Iterator[Counter[str]]:
    """How many times each statement ran on the worker's engine, by its first comment line (as
    sent: a parameter named in it reads `%(name)s`)."""
    seen: Counter[str] = Counter()

    def count(_cursor: Any, statement: str, _params: Any) -> None:
        comment = next((s for s in statement.splitlines() if s.strip().startswith("--")), "")
        seen[comment.strip()] += 1

    with statements_sent(worker_engine, count):
        yield seen
