"""Notifications: the notices to send to the routes file's `[[notify]]` targets, and how far
the notifier has read the gateway's history.

`notices` is an outbox of its own: a notice is inserted once (`dedupe_key` is unique, so two
sweepers that saw the same change never write it twice), sent by whichever notifier holds the
notifications lock, retried with backoff (`due_at`, `tries`, `last_error`) and kept, once
sent, for the record until purged. `notify_cursors` holds each source of notices' position
(the last dead letter read, the last route change read).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE notices (
            id          bigserial PRIMARY KEY,
            target      text NOT NULL,
            kind        text NOT NULL,
            dedupe_key  text NOT NULL UNIQUE,
            payload     jsonb NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now(),
            due_at      timestamptz NOT NULL DEFAULT now(),
            sent_at     timestamptz,
            tries       integer NOT NULL DEFAULT 0,
            last_error  text
        )
        """
    )
    op.execute("CREATE INDEX notices_due_idx ON notices (due_at) WHERE sent_at IS NULL")
    op.execute(
        """
        CREATE TABLE notify_cursors (
            name        text PRIMARY KEY,
            position    bigint NOT NULL DEFAULT 0,
            updated_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE notify_cursors")
    op.execute("DROP TABLE notices")
