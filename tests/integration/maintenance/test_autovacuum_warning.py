"""The sweeper says at start when the server runs no autovacuum (the gateway's statements stay
fast only while something analyses its tables: tests/integration/worker/test_plans.py)."""

from __future__ import annotations

from structlog.testing import capture_logs

from outbox.core.settings import Settings
from outbox.maintenance.sweeper import AUTOVACUUM_OFF_HINT, _warn_without_autovacuum
from outbox.store.engines import create_sync_engine
from tests.support import query


def test_the_sweeper_warns_when_the_server_runs_no_autovacuum(own_database: str) -> None:
    """Asked of this machine's server: a warning with its hint when autovacuum is off, nothing
    when it is on."""
    off = query(own_database, "SHOW autovacuum") == [("off",)]
    engine = create_sync_engine(Settings(database_url=own_database, redis_url="redis://x"))
    try:
        with capture_logs() as logs:
            warned = _warn_without_autovacuum(engine)
    finally:
        engine.dispose()
    assert warned is off
    expected = [{"event": "sweeper.autovacuum_off", "hint": AUTOVACUUM_OFF_HINT}] if off else []
    assert [{k: e[k] for k in ("event", "hint")} for e in logs if "hint" in e] == expected


def test_a_server_it_cannot_ask_is_not_called_off() -> None:
    """An unreachable server is the sweep's failure to log, not a missing autovacuum."""
    engine = create_sync_engine(
        Settings(
            database_url="postgresql+psycopg://postgres@127.0.0.1:1/none",
            redis_url="redis://x",
            db_timeout_seconds=1,
        )
    )
    try:
        with capture_logs() as logs:
            assert _warn_without_autovacuum(engine) is False
    finally:
        engine.dispose()
    assert logs == []
