"""Apply and inspect the schema with Alembic, from code rather than an ini file on disk.

Migrations run beside the gateway's processes (a rolling upgrade migrates first, while the
previous release serves: docs/how-to/upgrading.md). A migration that waits for a table's lock
holds up every statement queued behind it, intake's included, so it waits at most
`LOCK_TIMEOUT_SECONDS` (set on its session by migrations/env.py), gives its transaction up and
is tried again after a pause, as is a migration chosen as a deadlock's victim. Each migration
commits alone, so a retry starts at the one that gave up.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError

import migrations
from outbox.core.conninfo import sqlalchemy_url
from outbox.core.logs import get_logger

log = get_logger(__name__)

SCRIPT_LOCATION = str(Path(migrations.__file__).parent)
# The gateway's own transactions hold a lock for milliseconds, and a receiver gives a
# statement DB_TIMEOUT_SECONDS (3 s by default) before it answers 503: a migration waiting
# longer for a lock would turn the wait into 503s. Below PostgreSQL's deadlock_timeout (1 s),
# so in a deadlock with the gateway the migration tends to give up before the gateway's
# statement is chosen as the victim.
LOCK_TIMEOUT_SECONDS = 0.5
# Tries of a migration that could not get its locks (or lost a deadlock), and the pause
# between them (drawn in this range, so two retrying runs do not meet again): enough to ride
# out a sweeper's pass or a purge batch, the longest transactions the gateway runs.
LOCK_TRIES = 30
RETRY_PAUSE_SECONDS = (0.5, 2.0)
# PostgreSQL's codes for a lock not granted within lock_timeout, and for a deadlock's victim.
_LOCK_CONFLICTS = frozenset({"55P03", "40P01"})


def alembic_config(database_url: str) -> Config:
    """An Alembic config for this project's migrations against `database_url`."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation would eat '%' in passwords.
    config.set_main_option("sqlalchemy.url", sqlalchemy_url(database_url).replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> str:
    """Bring the database to `revision` (the latest by default); returns the revision asked
    for, the newest one's id for "head" (alembic's own lines are left out of the log). A
    migration that could not get its locks is tried again (see the module's docstring)."""
    for attempt in range(1, LOCK_TRIES + 1):
        try:
            command.upgrade(alembic_config(database_url), revision)
            break
        except DBAPIError as error:
            code = getattr(error.orig, "sqlstate", None)
            if code not in _LOCK_CONFLICTS or attempt == LOCK_TRIES:
                raise
            log.warning("migrations.lock_retry", sqlstate=code, attempt=attempt)
            time.sleep(random.uniform(*RETRY_PAUSE_SECONDS))
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
