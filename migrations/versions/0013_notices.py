"""Notifications: the notices to send to the routes file's `[[notify]]` targets, and how far
the notifier has read the gateway's history.

`notices` is an outbox of its own: a notice is inserted once (`dedupe_key` is unique, so two
sweepers that saw the same change never write it twice), sent by whichever notifier holds the
notifications lock, retried with backoff (`due_at`, `tries`, `last_error`) and kept, once
sent, for the record until purged. `notify_cursors` holds each source of notices' position
(the last dead letter read, the last route change read) as `(position_at, position)`: rows
are read in `(created_at, id)` order up to a horizon no transaction still running started
before, so a row committed late is never skipped (an id alone can commit out of order).

`route_changes` also records the breaker's transitions (`circuit_opened`, `circuit_closed`,
written by the statement that makes them), so the notifier reads one history for pauses,
resumes and circuits; its `(created_at, id)` index is the notifier's read.

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
    # A target's batches: the open one and when the last was sent (one a window at most).
    op.execute("CREATE INDEX notices_target_idx ON notices (target, kind, sent_at)")
    op.execute(
        """
        CREATE TABLE notify_cursors (
            name        text PRIMARY KEY,
            position    bigint NOT NULL DEFAULT 0,
            position_at timestamptz NOT NULL DEFAULT 'epoch',
            updated_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("ALTER TABLE route_changes DROP CONSTRAINT route_changes_action_check")
    op.execute(
        "ALTER TABLE route_changes ADD CONSTRAINT route_changes_action_check CHECK (action IN ("
        "'pause', 'resume', 'circuit_opened', 'circuit_closed'))"
    )
    op.execute("CREATE INDEX route_changes_created_idx ON route_changes (created_at, id)")


def downgrade() -> None:
    op.execute("DROP INDEX route_changes_created_idx")
    op.execute("DELETE FROM route_changes WHERE action IN ('circuit_opened', 'circuit_closed')")
    op.execute("ALTER TABLE route_changes DROP CONSTRAINT route_changes_action_check")
    op.execute(
        "ALTER TABLE route_changes ADD CONSTRAINT route_changes_action_check"
        " CHECK (action IN ('pause', 'resume'))"
    )
    op.execute("DROP TABLE notify_cursors")
    op.execute("DROP TABLE notices")
