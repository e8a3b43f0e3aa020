"""The attempt log: one row per attempt at a key (and per claim, complete, fail or expiry of a
workflow's key), written by the statement that records the outcome.

Operators read it as a timeline (console, `idem show`, `GET /v1/events/{key}/attempts`). Rows
go with their key (ON DELETE CASCADE, and follow a key moved by migration 0010's kind of rewrite:
ON UPDATE CASCADE); a key keeps its most recent `ATTEMPTS_KEPT_PER_KEY` rows (the writing
statement trims the older ones), so a key retried for weeks stays bounded.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE attempts (
            id               bigserial PRIMARY KEY,
            idempotency_key  text NOT NULL
                REFERENCES idempotency_keys (idempotency_key)
                ON DELETE CASCADE ON UPDATE CASCADE,
            attempt          integer NOT NULL,
            fence            bigint,
            started_at       timestamptz NOT NULL,
            ended_at         timestamptz NOT NULL DEFAULT now(),
            outcome          text NOT NULL CHECK (outcome IN (
                'succeeded', 'transient', 'permanent', 'uncertain', 'reconciled_found',
                'deferred_circuit', 'deferred_limit', 'deferred_pause', 'deferred_lane',
                'deferred_in_progress', 'superseded', 'lease_lost',
                -- a workflow's key (the claims API)
                'claimed', 'completed', 'failed', 'expired')),
            -- This attempt reconciled first: true found the effect, false found none (the
            -- action then ran and `outcome` is its own); NULL: no reconcile.
            reconciled       boolean,
            status_code      integer,
            error_code       text,
            detail           text CHECK (length(detail) <= 500),
            worker           text
        )
        """
    )
    op.execute("CREATE INDEX attempts_key_idx ON attempts (idempotency_key, id)")


def downgrade() -> None:
    op.execute("DROP TABLE attempts")
