"""Apply and inspect the schema with Alembic, from code rather than an ini file on disk."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection

import migrations
from outbox.core.conninfo import sqlalchemy_url

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)


def alembic_config(database_url: str) -> Config:
    """An Alembic config for this project's migrations against `database_url`."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> str:
    """Bring the database to `revision` (the latest by default); returns the revision asked
    for, the newest one's id for "head" (alembic's own lines are left out of the log)."""
    command.upgrade(alembic_config(database_url), revision)
    if revision != "head":
        return revision
    return ",".join(sorted(ScriptDirectory(SCRIPT_LOCATION).get_heads()))


def head_revisions() -> frozenset[str]:
    """The newest revisions this code knows (read from the migration files)."""
    return frozenset(ScriptDirectory(SCRIPT_LOCATION).get_heads())


def known_revisions() -> frozenset[str]:
    """Every revision this code knows, the oldest to the newest."""
    return frozenset(
        script.revision for script in ScriptDirectory(SCRIPT_LOCATION).walk_revisions()
    )


def schema_serves(
    connection: Connection,
    heads: frozenset[str] | None = None,
    known: frozenset[str] | None = None,
) -> bool:
    """Whether this code runs on the database's schema: it is at the newest revision this code
    knows (`heads`), or past it, at a revision this code does not know (`known`: every one it
    does). Past it is a later release's schema, migrated first in a rolling upgrade: its
    migrations only add, so this release's processes keep working on it until they are
    replaced (docs/how-to/upgrading.md). A schema behind this code's is not served: its
    statements name what the schema lacks. `heads` and `known` are for callers that read them
    once."""
    current = set(MigrationContext.configure(connection).get_current_heads())
    if current == (head_revisions() if heads is None else heads):
        return True
    return bool(current) and current.isdisjoint(known_revisions() if known is None else known)
