"""Alembic environment: runs migrations on the URL the caller put in the config."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool

from outbox.core.conninfo import sqlalchemy_url
from outbox.core.settings import get_settings
from outbox.store.migrate import LOCK_TIMEOUT_SECONDS

config = context.config


def _url() -> str:
    return sqlalchemy_url(config.get_main_option("sqlalchemy.url") or get_settings().database_url)


def run_migrations_offline() -> None:
    context.configure(url=_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        # Live beside the gateway, a lock is waited for briefly, then the run is tried again
        # (outbox/store/migrate.py).
        connection.exec_driver_sql(f"SET lock_timeout = '{int(LOCK_TIMEOUT_SECONDS * 1000)}ms'")
        connection.commit()
        context.configure(connection=connection, transaction_per_migration=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
