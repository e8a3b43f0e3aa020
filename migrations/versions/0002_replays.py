"""Replays audit: one row per executed replay (who, when, which filter, how many keys).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE replays (
            id            bigserial PRIMARY KEY,
            requested_by  text NOT NULL,
            filter        jsonb NOT NULL,
            key_count     integer NOT NULL,
            keys          text[] NOT NULL,
            created_at    timestamptz NOT NULL DEFAULT now()
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE replays")
