"""Core schema: idempotency keys, the events inbox, the outbox and dead letters.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE idempotency_keys (
            idempotency_key  text PRIMARY KEY,
            status           text NOT NULL DEFAULT 'pending',
            payload_hash     text NOT NULL,
            correlation_id   text NOT NULL,
            source           text NOT NULL,
            event_type       text NOT NULL,
            route            text NOT NULL,
            workflow_name    text,
            execution_id     text,
            attempts         integer NOT NULL DEFAULT 0,
            -- Bumped by every claim; every later write names it, so a stale holder cannot write.
            fence            bigint NOT NULL DEFAULT 0,
            lease_owner      text,
            locked_until     timestamptz,
            next_attempt_at  timestamptz,
            result           jsonb,
            external_ref     text,
            error_code       text,
            error_detail     text,
            first_failed_at  timestamptz,
            -- Repeats answered by the receiver without a new outbox row.
            duplicate_count  integer NOT NULL DEFAULT 0,
            -- Deliveries a worker refused because the key was finished or held by a live lease.
            blocked_deliveries integer NOT NULL DEFAULT 0,
            -- Claims that took over an expired lease (a crashed or stalled worker's key).
            reclaimed_count  integer NOT NULL DEFAULT 0,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now(),
            expires_at       timestamptz NOT NULL,
            CONSTRAINT idempotency_keys_status_check CHECK (status IN (
                'pending',          -- accepted or reset by a replay; an outbox row exists
                'processing',       -- claimed by a worker: lease_owner, locked_until and fence set
                'succeeded',        -- the action's result is stored; terminal
                'failed_retryable', -- transient error; an outbox row due at next_attempt_at
                'failed_final',     -- a permanent error or spent budget; a dead letter exists
                'quarantined'       -- the payload broke the route's contract; a dead letter exists
            ))
        )
        """
    )
    op.execute(
        "CREATE INDEX idempotency_keys_processing_idx ON idempotency_keys (locked_until)"
        " WHERE status = 'processing'"
    )
    op.execute("CREATE INDEX idempotency_keys_expires_idx ON idempotency_keys (expires_at)")
    # The sweeper's look for keys waiting on a message that may have been lost.
    op.execute(
        "CREATE INDEX idempotency_keys_waiting_idx ON idempotency_keys (updated_at)"
        " WHERE status IN ('pending', 'failed_retryable')"
    )

    op.execute(
        """
        CREATE TABLE events (
            idempotency_key text PRIMARY KEY
                REFERENCES idempotency_keys (idempotency_key) ON DELETE CASCADE,
            source          text NOT NULL,
            event_type      text NOT NULL,
            external_id     text NOT NULL,
            version         text,
            payload         jsonb NOT NULL,
            received_at     timestamptz NOT NULL DEFAULT now()
        )
        """
    )

    op.execute(
        """
        CREATE TABLE outbox (
            id               bigserial PRIMARY KEY,
            idempotency_key  text NOT NULL
                REFERENCES idempotency_keys (idempotency_key) ON DELETE CASCADE,
            task_name        text NOT NULL,
            correlation_id   text NOT NULL,
            available_at     timestamptz NOT NULL DEFAULT now(),
            published_at     timestamptz,
            publish_attempts integer NOT NULL DEFAULT 0,
            created_at       timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    # The relay's only read: due, unpublished rows in order. Published rows drop out of it.
    op.execute(
        "CREATE INDEX outbox_due_idx ON outbox (available_at, id) WHERE published_at IS NULL"
    )
    op.execute("CREATE INDEX outbox_key_idx ON outbox (idempotency_key)")
    # Wake the relay at commit; it polls as well, since a NOTIFY is lost while it is away.
    op.execute(
        """
        CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('outbox', '');
            RETURN NULL;
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER outbox_notify AFTER INSERT ON outbox"
        " FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify()"
    )

    op.execute(
        """
        CREATE TABLE dead_letters (
            id               bigserial PRIMARY KEY,
            idempotency_key  text NOT NULL
                REFERENCES idempotency_keys (idempotency_key) ON DELETE CASCADE,
            kind             text NOT NULL CHECK (kind IN (
                'permanent', 'retries_exhausted', 'quarantined'
            )),
            error_code       text NOT NULL,
            error_detail     text,
            attempts         integer NOT NULL,
            first_failed_at  timestamptz NOT NULL,
            last_failed_at   timestamptz NOT NULL,
            resolution       text NOT NULL DEFAULT 'open' CHECK (resolution IN (
                'open', 'replayed', 'discarded'
            )),
            resolved_by      text,
            resolved_at      timestamptz,
            resolution_note  text,
            created_at       timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("CREATE INDEX dead_letters_key_idx ON dead_letters (idempotency_key)")
    op.execute(
        "CREATE INDEX dead_letters_open_idx ON dead_letters (created_at) WHERE resolution = 'open'"
    )


def downgrade() -> None:
    op.execute("DROP TABLE dead_letters")
    op.execute("DROP TRIGGER outbox_notify ON outbox")
    op.execute("DROP FUNCTION outbox_notify()")
    op.execute("DROP TABLE outbox")
    op.execute("DROP TABLE events")
    op.execute("DROP TABLE idempotency_keys")
