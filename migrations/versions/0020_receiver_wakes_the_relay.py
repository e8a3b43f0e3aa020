"""The outbox's NOTIFY is skipped by a statement whose sender wakes the relay after its commit.

A transaction that sends NOTIFY holds one lock of the whole database from just before its
commit until the commit is on disk, so that notifications arrive in commit order. Every accept
sent one through this trigger, so the receivers' commits went one at a time, each waiting for
its own WAL flush instead of sharing one: under load the accept statement spent most of its
time waiting for that lock (pg_stat_activity: `Lock`/`object`). The receiver's accept now sets
`idem.relay_wakeup` to `after_commit` for its own transaction when it writes an outbox row,
and the receiver sends the relay one NOTIFY after such commits (`outbox.ingest.wakeup`).
Every other writer of outbox rows (retries, replays, backfills, lanes handing on) notifies
here as before, and so does a receiver older than this revision.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0020"
down_revision: str | None = "0019"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('idem.relay_wakeup', true) IS DISTINCT FROM 'after_commit' THEN
                PERFORM pg_notify('outbox', '');
            END IF;
            RETURN NULL;
        END
        $$
        """
    )


def downgrade() -> None:
    op.execute(
        """
        CREATE OR REPLACE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox', '');
            RETURN NULL;
        END
        $$
        """
    )
