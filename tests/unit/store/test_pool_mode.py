"""DATABASE_POOL_MODE: what a connection sends at start, and where a session's work goes."""

from __future__ import annotations

import pytest

from outbox.core.settings import Settings
from outbox.store.engines import _connect_args

POOL = "postgresql://postgres@pgbouncer:6432/idem"
DIRECT = "postgresql://postgres@postgres:5432/idem"


def test_a_session_connection_sends_its_statement_timeout_and_may_prepare() -> None:
    settings = Settings(database_url=DIRECT, db_timeout_seconds=2.5)
    args = _connect_args(settings, "idem", settings.transaction_pooled)
    assert args["options"] == "-c statement_timeout=2500"
    assert "prepare_threshold" not in args


def test_a_transaction_pooled_connection_prepares_nothing_and_sends_no_option() -> None:
    """PgBouncer refuses `options`; a statement prepared on one server connection is unknown
    to the next transaction's."""
    settings = Settings(database_url=POOL, database_pool_mode="transaction")
    args = _connect_args(settings, "idem", settings.transaction_pooled)
    assert args["prepare_threshold"] is None
    assert "options" not in args
    assert args["application_name"] == "idem"


@pytest.mark.parametrize(
    ("mode", "direct", "expected"),
    [
        ("session", "", "postgresql+psycopg://postgres@pgbouncer:6432/idem"),
        ("transaction", "", None),
        ("transaction", DIRECT, "postgresql+psycopg://postgres@postgres:5432/idem"),
        ("session", DIRECT, "postgresql+psycopg://postgres@postgres:5432/idem"),
    ],
)
def test_a_sessions_work_goes_to_the_direct_url_and_never_through_a_transaction_pool(
    mode: str, direct: str, expected: str | None
) -> None:
    settings = Settings(database_url=POOL, database_pool_mode=mode, database_direct_url=direct)
    assert settings.session_url() == expected


def test_an_unknown_pool_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="session"):
        Settings(database_url=POOL, database_pool_mode="statement")
