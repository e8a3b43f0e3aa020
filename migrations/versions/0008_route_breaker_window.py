"""A breaker that judges the route, and bulk steps that find their keys by index.

- `route_state` judges a route by its recent calls instead of a streak of failures: a sliding
  window of two buckets (the current one and the one before it, weighted by how much of it
  still falls inside the window), the distinct keys among its failures, and several trial calls
  in half-open (`trial_keys`, `trial_failures`) instead of one probe. The streak and the single
  probe's key and fence are gone.
- `idempotency_keys_circuit_held_idx`: the keys waiting on an open circuit, by route, so
  releasing them when it closes is a batch at a time from an index of just those keys.
- `idempotency_keys_paused_idx`: the keys a pause held (pending, `route_paused`), by route in
  acceptance order, so a resume queues them a batch at a time. Keys that were never held are
  never in either index (a new key's error_code is NULL), so accepting an event costs nothing.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE route_state
            DROP COLUMN consecutive_failures,
            DROP COLUMN probe_key,
            DROP COLUMN probe_fence,
            -- The current bucket of the sliding window and the one before it.
            ADD COLUMN window_started_at  timestamptz,
            ADD COLUMN window_calls       integer NOT NULL DEFAULT 0,
            ADD COLUMN window_failures    integer NOT NULL DEFAULT 0,
            ADD COLUMN previous_calls     integer NOT NULL DEFAULT 0,
            ADD COLUMN previous_failures  integer NOT NULL DEFAULT 0,
            -- Distinct keys among the window's failures (a few are enough to tell a route
            -- from one poisoned key).
            ADD COLUMN failed_keys        text[] NOT NULL DEFAULT '{}',
            -- Half-open: the keys whose trial calls are running (until probe_until), and how
            -- many trials failed since the circuit last opened.
            ADD COLUMN trial_keys         text[] NOT NULL DEFAULT '{}',
            ADD COLUMN trial_failures     integer NOT NULL DEFAULT 0
        """
    )
    op.execute(
        "CREATE INDEX idempotency_keys_circuit_held_idx"
        " ON idempotency_keys (route, next_attempt_at)"
        " WHERE status = 'failed_retryable' AND error_code = 'circuit_open'"
    )
    op.execute(
        "CREATE INDEX idempotency_keys_paused_idx"
        " ON idempotency_keys (route, created_at, idempotency_key)"
        " WHERE status = 'pending' AND error_code = 'route_paused'"
    )


def downgrade() -> None:
    op.execute("DROP INDEX idempotency_keys_paused_idx")
    op.execute("DROP INDEX idempotency_keys_circuit_held_idx")
    op.execute(
        """
        ALTER TABLE route_state
            DROP COLUMN trial_failures,
            DROP COLUMN trial_keys,
            DROP COLUMN failed_keys,
            DROP COLUMN previous_failures,
            DROP COLUMN previous_calls,
            DROP COLUMN window_failures,
            DROP COLUMN window_calls,
            DROP COLUMN window_started_at,
            ADD COLUMN probe_fence bigint,
            ADD COLUMN probe_key text,
            ADD COLUMN consecutive_failures integer NOT NULL DEFAULT 0
        """
    )
