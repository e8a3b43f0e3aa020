"""Revoked console sessions: a signed-out session stops working even where its cookie was copied.

Sessions are signed cookies, valid by themselves until they expire; signing out records the
session here until its expiry, and every console page looks it up.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE revoked_sessions (
            -- SHA-256 of the cookie value: a row names a session without holding a usable one.
            session_hash  text PRIMARY KEY,
            -- The session's own expiry: past it the cookie is refused anyway and the row goes.
            expires_at    timestamptz NOT NULL
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE revoked_sessions")
