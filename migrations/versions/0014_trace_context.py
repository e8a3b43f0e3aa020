"""Trace context stored with the event: the W3C `traceparent` (and `tracestate`) the receiver
continued or started, so that the relay's publish and every attempt, hours later and after a
sweeper re-drive, join the same trace. NULL when tracing is off. Written by the accept
statement as JSON (`{"traceparent": "00-…", "tracestate": "…"}`, never baggage), read by the
relay's claim with each outbox row (outbox/core/tracing.py).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("ALTER TABLE events ADD COLUMN trace_context text")


def downgrade() -> None:
    op.execute("ALTER TABLE events DROP COLUMN trace_context")
