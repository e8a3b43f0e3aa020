"""Protecting the downstream: each route's shared state, its in-flight permits, and an audit of
operators' pauses and resumes.

- `route_state`: one row per route label, shared by every worker process and machine. Whether
  an operator paused the route (and who, when, why); the circuit breaker (closed, open until a
  probe time, half-open while one probe runs), its streak of transient failures and how often
  it re-opened since it last closed (the cool-down doubles with each); the rate limiter's next
  free send time (GCRA's theoretical arrival time).
- `route_permits`: `max_in_flight` slots per limited route. A slot is held by one claim (key and
  fence) until `holder_until`, which the lease keeper moves with the key's lease: a worker that
  dies holding a slot frees it when its lease would have run out, never later.
- `route_changes`: an audit row per pause and resume (who, when, why), like `replays`.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE route_state (
            route                 text PRIMARY KEY,
            paused                boolean NOT NULL DEFAULT false,
            paused_reason         text,
            paused_by             text,
            paused_at             timestamptz,
            circuit               text NOT NULL DEFAULT 'closed'
                CONSTRAINT route_state_circuit_check CHECK (circuit IN (
                    'closed',    -- attempts go through; transient failures are counted
                    'open',      -- no attempt until open_until; keys wait in the outbox
                    'half_open'  -- one probe (probe_key, probe_fence) runs until probe_until
                )),
            consecutive_failures  integer NOT NULL DEFAULT 0,
            -- Re-openings since the circuit last closed: the cool-down doubles with each.
            reopened_count        integer NOT NULL DEFAULT 0,
            opened_at             timestamptz,
            open_until            timestamptz,
            open_reason           text,
            probe_key             text,
            probe_fence           bigint,
            probe_until           timestamptz,
            -- The rate limiter: the earliest time the next send slot is free (GCRA).
            rate_tat              timestamptz,
            updated_at            timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE route_permits (
            route         text NOT NULL,
            slot          integer NOT NULL,
            holder_key    text,
            holder_fence  bigint,
            holder_until  timestamptz,
            PRIMARY KEY (route, slot)
        )
        """
    )
    op.execute(
        """
        CREATE TABLE route_changes (
            id            bigserial PRIMARY KEY,
            route         text NOT NULL,
            action        text NOT NULL CHECK (action IN ('pause', 'resume')),
            reason        text,
            requested_by  text NOT NULL,
            created_at    timestamptz NOT NULL DEFAULT now()
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE route_changes")
    op.execute("DROP TABLE route_permits")
    op.execute("DROP TABLE route_state")
